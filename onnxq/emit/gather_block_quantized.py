"""Embedding lookups on int4 (or 8-bit) tables: onnxruntime's `com.microsoft::GatherBlockQuantized`.

A DequantizeLinear in front of a Gather dequantizes the whole table on every run; this
kernel gathers the int4 rows first and dequantizes only those, with block scales along the
embedding dimension.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config
from onnxq.emit.lowering import LoweringReport, claimed_nodes, register_lowering
from onnxq.graph.edit import GraphEditor, drop_unread
from onnxq.graph.external_data import drop_array_pages
from onnxq.numerics.blocks import packed_codes, stored_zero_points
from onnxq.numerics.weights import QuantizedTensor, quantize_weight
from onnxq.plan.strategies.gather_int4 import can_use_gather_block_quantized, table_array
from onnxq.plan.strategies.matmul_nbits import BITS

CONTRIB = "com.microsoft"


def replace_with_gather_block_quantized(model: ir.Model, edit: GraphEditor, node: ir.Node,
                                        stored: list[ir.Value | None], block_size: int, bits: int = 4) -> None:
    """Replace the Gather `node` by GatherBlockQuantized reading `stored` (quantized table,
    scales, zero points or None), and drop the float table if nothing else reads it."""
    graph = model.graph
    table, out = node.inputs[0], node.outputs[0]
    data, scales, zero_points = stored
    inputs = [data, node.inputs[1], scales, *([zero_points] if zero_points is not None else [])]
    new = ir.node(
        "GatherBlockQuantized", inputs,
        {"gather_axis": 0, "quantize_axis": 1, "block_size": block_size, "bits": bits},
        domain=CONTRIB, name=edit.unique(f"{node.name}_GatherBlockQuantized"),
    )
    new.outputs[0].dtype, new.outputs[0].shape = out.dtype, out.shape
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [out], [new.outputs[0]])
    drop_unread(graph, table)
    model.opset_imports.setdefault(CONTRIB, 1)


def emit_gather_block_quantized(model: ir.Model, nodes: Mapping[str, ResolvedSpec],
                                clip_search: bool = False) -> dict[str, str]:
    """Replace each named Gather by GatherBlockQuantized; returns skipped node -> reason.

    Tables are quantized by `quantize_weight` (full-range signed scales for symmetric
    int4/uint4; `clip_search`: its per-block weight-MSE clipping search)."""
    graph = model.graph
    edit = GraphEditor(graph)
    ready, skipped = claimed_nodes(graph, nodes, can_use_gather_block_quantized)
    for node, spec in ready:
        table = node.inputs[0]
        array = table_array(table)
        qt = _quantize_table(array, spec, clip_search)  # scales in the table's type: the codes round with them
        data, zero_point = qt.data, None if spec.symmetric else qt.zero_point
        bits = BITS[spec.dtype]
        if bits == 8:  # the kernel reads 8-bit codes unsigned, as MatMulNBits stores them (default zero point 128)
            data, zero_point = packed_codes(data, spec), stored_zero_points(qt.zero_point, array.dtype, spec)
        stored = [edit.initializer(f"{table.name}_quantized", data),  # scales in the table's type, the output's
                  edit.initializer(f"{table.name}_scale", qt.scale.astype(array.dtype)),
                  None if zero_point is None else edit.initializer(f"{table.name}_zero_point", zero_point)]
        replace_with_gather_block_quantized(model, edit, node, stored, spec.group_size, bits)
    return skipped


# Rows of a table quantized at a time: each block has its own scale, so the codes are those
# of the whole table at once, with float temporaries of 16 MB instead of a few times the
# table (TinyLlama's 32000 x 2048: 250 MB), and its mapped pages dropped as they are done.
TABLE_CHUNK_VALUES = 1 << 22


def _quantize_table(table: np.ndarray, spec: ResolvedSpec, clip_search: bool) -> QuantizedTensor:
    """`quantize_weight` of a [rows, dim] table in blocks along dim, a chunk of rows at a
    time, with scales in the table's type (float16 for a float16 table: the kernel's)."""
    step = max(1, TABLE_CHUNK_VALUES // max(1, table.shape[1]))
    parts = []
    for start in range(0, table.shape[0], step):
        rows = table[start:start + step]
        parts.append(quantize_weight(rows, spec, 1, block_size=spec.group_size, clip_search=clip_search,
                                     scale_dtype=table.dtype.type))
        drop_array_pages(rows)
    if len(parts) == 1:
        return parts[0]
    data, scale, zero_point = (np.concatenate([getattr(p, f) for p in parts])
                               for f in ("data", "scale", "zero_point"))
    return QuantizedTensor(data, scale, zero_point, 1, spec.group_size)


@register_lowering("gather_block_quantized", order=30)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    return LoweringReport(skipped=emit_gather_block_quantized(model, nodes))
