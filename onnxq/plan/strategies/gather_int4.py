"""int4 (or 8-bit) embedding tables: a weight-only Gather becomes com.microsoft::GatherBlockQuantized
(lowered by `emit/gather_block_quantized`), which dequantizes only the rows it looks up.
The table is a constant, or the Transpose of one that load left unfolded (a tied LM head's
weight past `graph.fold.MAX_FOLD_ELEMENTS`)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, ResolvedSpec
from onnxq.graph.fold import constant_array
from onnxq.plan.draft import Draft
from onnxq.plan.strategies.matmul_nbits import row_block
from onnxq.plan.strategies.registry import Decision, Lower, register_strategy, weights_only

TYPES = ("int4", "uint4", "int8", "uint8")
# The tables onnxruntime's CPU kernel dequantizes (its scales and output in the table's type;
# an fp16 genai folder's tied table is the LM head's float16 weight).
TABLE_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


def transposed_constant(value: ir.Value) -> ir.Value | None:
    """The constant rank-2 tensor that `value` is the Transpose of, else None."""
    node = value.producer()
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = node.attributes.get("perm")
    source = node.inputs[0]
    array = constant_array(source)
    if array is None or array.ndim != 2 or (perm is not None and list(perm.as_ints()) != [1, 0]):
        return None
    return source


def table_array(value: ir.Value) -> np.ndarray | None:
    """The table a Gather reads: its constant, or the transposed constant behind a Transpose."""
    array = constant_array(value)
    if array is not None:
        return array
    source = transposed_constant(value)
    return None if source is None else constant_array(source).T


def can_use_gather_block_quantized(node: ir.Node, spec: ResolvedSpec) -> str | None:
    """Why `node` cannot become GatherBlockQuantized with `spec`, or None if it can."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
        return "not a Gather"
    if str(spec.dtype) not in TYPES or spec.qscheme != "per_group":
        return "needs 4- or 8-bit integer per-group weights"
    size = spec.group_size or 0
    if size < 16 or size & (size - 1):
        return "block size must be a power of two >= 16"
    attr = node.attributes.get("axis")
    if attr is not None and attr.as_int() != 0:
        return "only lookups along axis 0"
    table = table_array(node.inputs[0])
    if table is None or table.ndim != 2 or table.dtype not in TABLE_TYPES:
        return "needs a constant float32 or float16 rank-2 table"
    return None


@register_strategy("gather_block_quantized", order=20)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    if node.op_type == "Gather" and weights_only(cfg) and cfg.weight is not None \
            and can_use_gather_block_quantized(node, cfg.weight) is None:
        return Lower(row_block(cfg.weight, table_array(node.inputs[0]).shape[1]))
    return None
