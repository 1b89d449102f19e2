"""Decide, before calibration, how every tensor is quantized (`plan_quantization`), with the
op rules table (`rules`) and the parameters each planned tensor gets (`params`)."""

from onnxq.plan.planner import Kind, QuantPlan, TensorPlan, plan_quantization, qparams_key

__all__ = ["Kind", "QuantPlan", "TensorPlan", "plan_quantization", "qparams_key"]
