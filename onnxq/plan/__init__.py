"""Decide, before calibration, how every tensor is quantized (`plan_quantization`): the
frozen plan types (`plan`), the plan while it is built (`draft`), the strategies that
claim nodes (`strategies`), tied embeddings and LM heads (`tied`), the walks that return
link ops to float (`prune`), the op rules table (`rules`), the parameters each planned
tensor gets (`params`) and what the execution provider makes of a plan (`providers`)."""

from onnxq.plan.plan import Kind, Lowered, QuantPlan, TensorPlan, Tie, qparams_key
from onnxq.plan.planner import plan_quantization
from onnxq.plan.providers import provider_notes

__all__ = ["Kind", "Lowered", "QuantPlan", "TensorPlan", "Tie", "plan_quantization", "provider_notes", "qparams_key"]
