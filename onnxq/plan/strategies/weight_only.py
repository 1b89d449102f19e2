"""Weight-only and dynamic configs still store embedding tables quantized: a Gather on a
constant table gets a quantized table read through DequantizeLinear (static QDQ lowering)."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.graph.fold import constant_array
from onnxq.plan.draft import Draft
from onnxq.plan.rules import OP_RULES
from onnxq.plan.strategies.registry import (
    Decision,
    Planned,
    Refuse,
    register_strategy,
    weights_only,
)
from onnxq.plan.strategies.static import plan_weight


@register_strategy("weight_only_gather", order=30)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    if node.op_type != "Gather" or not weights_only(cfg) or node.domain not in ("", "ai.onnx"):
        return None
    if plan_weight(draft, node, OP_RULES["Gather"], cfg) is None:
        if cfg.weight is None and node.inputs and constant_array(node.inputs[0]) is not None:
            return Refuse("its table is kept float by the config (weight dtype float32)")
        return Refuse("Gather on non-constant data: nothing to quantize")
    draft.quantized(node)
    return Planned()
