"""Decide, before calibration, how every tensor is quantized (`plan_quantization`): the
frozen plan types (`plan`), the strategies that claim nodes (`strategies`), the op rules
table (`rules`) and the parameters each planned tensor gets (`params`)."""

from onnxq.plan.plan import Kind, Lowered, QuantPlan, TensorPlan, qparams_key
from onnxq.plan.planner import plan_quantization

__all__ = ["Kind", "Lowered", "QuantPlan", "TensorPlan", "plan_quantization", "qparams_key"]
