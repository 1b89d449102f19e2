"""Gather the quantized rows of an embedding table first, then dequantize only those.

A DequantizeLinear in front of a Gather dequantizes the whole table on every run:
onnxruntime keeps DequantizeLinear out of constant folding (its QDQ fusions need it), and
where the Gather's output is quantized again (static QDQ) its fusion turns DQ -> Gather ->
Q into an 8-bit Gather, but where the output stays float (dynamic and weight-only
recipes) it does not. all-MiniLM-L6 W8_DYNAMIC dequantized its 30522 x 384 word table per
run: 6.6-15 ms at batch 1 against onnxruntime's quantize_dynamic model's 3.4-6.6 (2 cores,
AVX512-VNNI).

Such a Gather is rewritten to read the integer table, and the rows it took are
dequantized: by the same DequantizeLinear for a per-tensor table; for a per-row table
(axis 0) by the rows' own scales and zero points, gathered beside them, as
(float(q) - float(zp)) * scale, which is what DequantizeLinear computes (integers exact in
float), so the outputs are bit for bit those of the whole-table form. Gathers whose output
a QuantizeLinear reads are left as they are (onnxruntime's fusion serves them), as are
blocked tables (GatherBlockQuantized's, `gather_block_quantized.py`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxq.graph.edit import GraphEditor

# Table types gathered as they are (onnxruntime's CPU Gather takes them; 4-bit tables go to
# GatherBlockQuantized, float8 ones stay as they were).
GATHERED_TYPES = frozenset({ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16})


def _row_dequantize(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value | None, bool] | None:
    """(integer table, scale, zero point or None, per-row) of a DequantizeLinear of a
    constant 2-d table per tensor or per row; None for any other."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or "block_size" in node.attributes \
            and node.attributes["block_size"].value:
        return None
    table, scale = node.inputs[0], node.inputs[1]
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if table is None or table.const_value is None or len(table.const_value.shape) != 2 or scale is None \
            or scale.const_value is None or table.const_value.dtype not in GATHERED_TYPES:
        return None
    rows = scale.const_value.size != 1
    axis = node.attributes["axis"].value if "axis" in node.attributes else 1
    if rows and (axis % 2 != 0 or len(scale.const_value.shape) != 1):
        return None
    if zero is not None and zero.const_value is None:
        return None
    if rows and scale.const_value.dtype != ir.DataType.FLOAT and table.const_value.dtype.bitwidth > 8:
        return None  # a 16-bit code is not exact in a half type: the product would round twice
    return table, scale, zero, rows


def _gathers(value: ir.Value) -> list[ir.Node] | None:
    """The Gathers on axis 0 that read `value` as their data, when they are all its readers
    and none has its output quantized again; else None."""
    uses = list(value.uses())
    nodes = [use.node for use in uses]
    if value.is_graph_output() or not nodes or any(
            use.idx != 0 or n.op_type != "Gather" or n.domain not in ("", "ai.onnx")
            or ("axis" in n.attributes and n.attributes["axis"].value != 0) for use, n in zip(uses, nodes)):
        return None
    if any(u.node.op_type == "QuantizeLinear" for n in nodes for u in n.outputs[0].uses()):
        return None
    return nodes


def _column(edit: GraphEditor, value: ir.Value) -> ir.Value:
    """A per-row constant [rows] as [rows, 1]: gathered rows broadcast over the row's values."""
    array = value.const_value.numpy()
    return edit.initializer(f"{value.name}_rows", np.ascontiguousarray(array.reshape(-1, 1)))


def gather_before_dequantize(model: ir.Model) -> int:
    """Rewrite each Gather of a dequantized table (module doc); how many."""
    graph = model.graph
    edit = GraphEditor(graph)
    rewritten = 0
    for dq in list(graph):
        found = _row_dequantize(dq)
        gathers = _gathers(dq.outputs[0]) if found is not None else None
        if gathers is None:
            continue
        table, scale, zero, rows = found
        float_type = scale.const_value.dtype
        scale_rows = _column(edit, scale) if rows else None
        zero_rows = _column(edit, zero) if rows and zero is not None and np.any(zero.const_value.numpy()) else None
        for gather in gathers:
            indices, out = gather.inputs[1], gather.outputs[0]
            name = gather.name or out.name
            picked = ir.node("Gather", [table, indices], {"axis": 0}, name=edit.unique(f"{name}_rows"))
            if not rows:
                tail = [ir.node("DequantizeLinear", [picked.outputs[0], scale, *([zero] if zero is not None else [])],
                                name=edit.unique(f"{name}_dequantize"))]
            else:
                cast = ir.node("Cast", [picked.outputs[0]], {"to": int(float_type)}, name=edit.unique(f"{name}_cast"))
                tail, codes = [cast], cast.outputs[0]
                if zero_rows is not None:
                    zeros = ir.node("Gather", [zero_rows, indices], {"axis": 0}, name=edit.unique(f"{name}_zero"))
                    zero_cast = ir.node("Cast", [zeros.outputs[0]], {"to": int(float_type)},
                                        name=edit.unique(f"{name}_zero_cast"))
                    centred = ir.node("Sub", [codes, zero_cast.outputs[0]], name=edit.unique(f"{name}_centre"))
                    tail += [zeros, zero_cast, centred]
                    codes = centred.outputs[0]
                scales = ir.node("Gather", [scale_rows, indices], {"axis": 0}, name=edit.unique(f"{name}_scale"))
                tail += [scales, ir.node("Mul", [codes, scales.outputs[0]], name=edit.unique(f"{name}_dequantize"))]
            last = tail[-1].outputs[0]
            last.dtype, last.shape = out.dtype, out.shape
            ir.convenience.replace_nodes_and_values(graph, gather, [gather], [picked, *tail], [out], [last])
            rewritten += 1
        if not dq.outputs[0].uses():
            graph.remove(dq, safe=True)
    return rewritten
