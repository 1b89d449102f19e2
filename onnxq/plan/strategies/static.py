"""Static quantization: calibrated Q/DQ around every op the rules table (`plan/rules.py`)
knows; the catch-all, asked last (lowered by `emit/qdq`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.plan.rules import FUSABLE_ACTIVATIONS, OP_RULES, OutputMode
from onnxq.plan.strategies import Decision, Planned, Refuse, register_strategy

if TYPE_CHECKING:
    from onnxq.plan.planner import Planner


@register_strategy("static", order=100)
def claim(node: ir.Node, cfg: ResolvedConfig, planner: Planner) -> Decision:
    rule = OP_RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if rule is None and node.op_type in FUSABLE_ACTIVATIONS and node.domain in ("", "ai.onnx"):
        # quantized only as part of the op before it (one int8 kernel), which is float here
        producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        before = f"the {producer.op_type} before it" if producer is not None else "its input"
        if producer is None or producer.name not in planner.plan.quantized_nodes:
            return Refuse(f"{before} stays float, and a {node.op_type} is quantized only with the op it follows")
        if node.inputs[0].name in planner.plan.tensors:
            return Refuse(f"{before} has other readers, and a {node.op_type} is quantized only with an op "
                          "whose output it alone reads: it runs in float on the dequantized output")
        return Refuse(f"{before} writes a float output (its input is not quantized), and a {node.op_type} is "
                      "quantized only with the op it follows")
    if rule is None:
        return Refuse(f"no quantized kernel rule for {node.domain or 'ai.onnx'}::{node.op_type}")
    if rule.applies is not None and not rule.applies(node):
        return Refuse(f"this {node.op_type} cannot reuse its input's parameters")
    if rule.output is OutputMode.SHARED:
        planner.plan_shared(node, rule, cfg)
    else:
        planner.plan_compute(node, rule, cfg)
    return Planned()
