"""Block formats (MX*, BFP16; qdq-ext only): the inputs and weights of Conv, Gemm and
MatMul share one power-of-two exponent per block and need no calibration. The node is
lowered by `emit/block_format`; any other node configured with a block format stays float."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.numerics.qmath import BLOCK_DTYPES
from onnxq.plan.draft import Draft
from onnxq.plan.strategies.registry import Decision, Lower, Refuse, register_strategy

BLOCK_OPS = ("Conv", "Gemm", "MatMul")


@register_strategy("block_format", order=5)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    specs = [s for s in (cfg.input_tensors, cfg.weight) if s is not None]
    if not any(s.dtype in BLOCK_DTYPES for s in specs):
        return None
    if node.op_type not in BLOCK_OPS or node.domain not in ("", "ai.onnx"):
        return Refuse(f"block formats apply to the inputs and weights of {', '.join(BLOCK_OPS)}")
    if not all(s.dtype in BLOCK_DTYPES for s in specs):
        return Refuse("a block format beside integer quantization in one node; give both the block format")
    return Lower(specs[0])
