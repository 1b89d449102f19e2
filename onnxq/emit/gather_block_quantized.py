"""Embedding lookups on int4 tables: onnxruntime's `com.microsoft::GatherBlockQuantized`.

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
from onnxq.graph.edit import GraphEditor
from onnxq.graph.external_data import drop_array_pages, release
from onnxq.graph.fold import constant_array
from onnxq.numerics.weights import QuantizedTensor, quantize_weight
from onnxq.plan.strategies.gather_int4 import can_use_gather_block_quantized

CONTRIB = "com.microsoft"


def emit_gather_block_quantized(model: ir.Model, nodes: Mapping[str, ResolvedSpec],
                                clip_search: bool = False) -> dict[str, str]:
    """Replace each named Gather by GatherBlockQuantized; returns skipped node -> reason.

    Tables are quantized by `quantize_weight` (full-range signed scales for symmetric
    int4/uint4; `clip_search`: its per-block weight-MSE clipping search)."""
    graph = model.graph
    edit = GraphEditor(graph)
    ready, skipped = claimed_nodes(graph, nodes, can_use_gather_block_quantized)
    for node, spec in ready:
        name = node.name
        table = node.inputs[0]
        qt = _quantize_table(constant_array(table), spec, clip_search)
        inputs = [
            edit.initializer(f"{table.name}_quantized", qt.data), node.inputs[1],
            edit.initializer(f"{table.name}_scale", qt.scale.astype(np.float32)),
        ]
        if not spec.symmetric:
            inputs.append(edit.initializer(f"{table.name}_zero_point", qt.zero_point))
        out = node.outputs[0]
        new = ir.node(
            "GatherBlockQuantized", inputs,
            {"gather_axis": 0, "quantize_axis": 1, "block_size": spec.group_size, "bits": 4},
            domain=CONTRIB, name=edit.unique(f"{name}_GatherBlockQuantized"),
        )
        new.outputs[0].dtype, new.outputs[0].shape = out.dtype, out.shape
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [out], [new.outputs[0]])
        if not table.uses() and not table.is_graph_output():
            graph.initializers.pop(table.name, None)
            release(table.const_value)
        model.opset_imports.setdefault(CONTRIB, 1)
    return skipped


# Rows of a table quantized at a time: each block has its own scale, so the codes are those
# of the whole table at once, with float temporaries of 16 MB instead of a few times the
# table (TinyLlama's 32000 x 2048: 250 MB), and its mapped pages dropped as they are done.
TABLE_CHUNK_VALUES = 1 << 22


def _quantize_table(table: np.ndarray, spec: ResolvedSpec, clip_search: bool) -> QuantizedTensor:
    """`quantize_weight` of a [rows, dim] table in blocks along dim, a chunk of rows at a time."""
    step = max(1, TABLE_CHUNK_VALUES // max(1, table.shape[1]))
    parts = []
    for start in range(0, table.shape[0], step):
        rows = table[start:start + step]
        parts.append(quantize_weight(rows, spec, 1, block_size=spec.group_size, clip_search=clip_search))
        drop_array_pages(rows)
    if len(parts) == 1:
        return parts[0]
    data, scale, zero_point = (np.concatenate([getattr(p, f) for p in parts])
                               for f in ("data", "scale", "zero_point"))
    return QuantizedTensor(data, scale, zero_point, 1, spec.group_size)


@register_lowering("gather_block_quantized", order=30)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    return LoweringReport(skipped=emit_gather_block_quantized(model, nodes))
