"""Static quantization: calibrated Q/DQ around every op the rules table (`plan/rules.py`)
knows; the catch-all, asked last (lowered by `emit/qdq`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, resolve_node_config
from onnxq.plan.rules import FUSABLE_ACTIVATIONS, OP_RULES, OutputMode
from onnxq.plan.strategies import Decision, Planned, Refuse, register_strategy

if TYPE_CHECKING:
    from onnxq.plan.planner import Planner


def _unfused(node: ir.Node, planner: Planner) -> str:
    """Why a Relu/Clip was not absorbed into the op before it (`planner._fusable_activation`)."""
    value = node.inputs[0] if node.inputs else None
    producer = value.producer() if value is not None else None
    before = f"the {producer.op_type} before it" if producer is not None else "its input"
    tail = f"and a {node.op_type} is quantized only with the op it follows"
    if producer is None or producer.name not in planner.plan.quantized_nodes:
        return f"{before} stays float, {tail}"
    if value.name not in planner.plan.tensors:
        cfg = resolve_node_config(planner.config, producer.name or "", producer.op_type)
        why = "no output spec in the config" if cfg is None or cfg.output_tensors is None else \
            "its input is not quantized"
        return f"{before} writes a float output ({why}), {tail}"
    if not planner.config.fuse_activations:
        why = "fuse_activations is off"
    elif value.is_graph_output():
        why = f"the {producer.op_type}'s output is also a graph output"
    elif len(value.consumers()) > 1:
        why = f"the {producer.op_type}'s output has other readers"
    elif node.op_type == "Clip":
        why = "its bounds are computed at run time"
    else:
        why = "its config differs"
    return f"{why}: it runs in float on the dequantized output of {before}"


@register_strategy("static", order=100)
def claim(node: ir.Node, cfg: ResolvedConfig, planner: Planner) -> Decision:
    rule = OP_RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if rule is None and node.op_type in FUSABLE_ACTIVATIONS and node.domain in ("", "ai.onnx"):
        # quantized only as part of the op before it (one int8 kernel), which is float here
        return Refuse(_unfused(node, planner))
    if rule is None:
        return Refuse(f"no quantized kernel rule for {node.domain or 'ai.onnx'}::{node.op_type}")
    if rule.applies is not None and not rule.applies(node):
        return Refuse(f"this {node.op_type} cannot reuse its input's parameters")
    if rule.output is OutputMode.SHARED:
        planner.plan_shared(node, rule, cfg)
    else:
        planner.plan_compute(node, rule, cfg)
    return Planned()
