"""QOperator format: a QDQ model's quantized patterns as onnxruntime's integer kernels.

A pattern is an op whose quantized inputs come from DequantizeLinear and whose output (if
the kernel has a quantized output) goes only into a QuantizeLinear. `to_qoperator`
replaces it by one integer node (QLinearConv, QLinearMatMul, com.microsoft QGemm,
QLinearAdd, ...) reading the DequantizeLinear inputs and writing the QuantizeLinear
output, so Q/DQ remain only at the entry and exit of each integer region and around ops
without a kernel. Data-movement ops (MaxPool, Reshape, Transpose, ...) whose input and
output carry the same scale and zero point run on the 8-bit tensor directly.
The way back is `qoperator_expand.py`; the table of kernels both read,
`qoperator_kernels.py`; the `convert` command, `format_convert.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.emit.qoperator_kernels import (
    CONTRIB,
    DATA_MOVEMENT,
    EIGHT_BIT,
    QOPS,
    FormatReport,
    QOp,
    bias_scale,
    channel_axis,
    constant_size,
    replace_value,
    same_scales,
)
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.graph.quantized import DOMAINS
from onnxq.plan.rules import pads_with_zero_or_edges


@dataclass(frozen=True)
class _Dq:
    node: ir.Node

    @property
    def data(self) -> ir.Value:
        return self.node.inputs[0]

    @property
    def scale(self) -> ir.Value:
        return self.node.inputs[1]

    @property
    def zero_point(self) -> ir.Value | None:
        return self.node.inputs[2] if len(self.node.inputs) > 2 else None

    def per_tensor(self) -> bool:
        return self.scale.shape is not None and self.scale.shape.rank() == 0 or constant_size(self.scale) == 1


def _dq_of(value: ir.Value | None) -> _Dq | None:
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in DOMAINS:
        return None
    if node.inputs[0].dtype not in EIGHT_BIT or "block_size" in node.attributes:
        return None
    return _Dq(node)


def _pad_inputs(node: ir.Node, dq: ir.Node) -> list[ir.Value | None] | None:
    """Pad's inputs after its data, for padding the 8-bit tensor itself: a constant pad of
    0 becomes the zero point (0 in float); edge and reflect padding need nothing. None
    where the pad value is another constant (the rules table quantizes no such Pad)."""
    rest = list(node.inputs[1:])
    if not pads_with_zero_or_edges(node):
        return None
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return rest
    zero_point = dq.inputs[2] if len(dq.inputs) > 2 else None
    return [rest[0], zero_point, *rest[2:]] if zero_point is not None or len(rest) > 2 else rest[:1]


def _quantized_in_qdq(node: ir.Node) -> bool:
    """Whether `node` reads a quantized constant weight, or reads dequantized inputs and has
    its output quantized, in any type (float8, 16- and 4-bit, blocks: QOperator's kernels
    take none of them, and a run of FP8_E4M3 had said only "qoperator format: nothing")."""
    for v in node.inputs:
        dq = v.producer() if v is not None else None
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.domain in DOMAINS and constant_size(dq.inputs[0]):
            return True
    uses = list(node.outputs[0].uses())
    reads_dq = any(v is not None and v.producer() is not None and v.producer().op_type == "DequantizeLinear"
                   for v in node.inputs)  # a float op (Softmax) whose output feeds a quantized one is no Q/DQ node
    return reads_dq and len(uses) == 1 and uses[0].node.op_type == "QuantizeLinear" and uses[0].node.domain in DOMAINS


def _q_after(value: ir.Value) -> ir.Node | None:
    """The QuantizeLinear that is the only reader of `value`, if any (8-bit, per tensor)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    if node.op_type != "QuantizeLinear" or node.domain not in DOMAINS or uses[0].idx != 0:
        return None
    if node.outputs[0].dtype not in EIGHT_BIT or constant_size(node.inputs[1]) != 1:
        return None
    return node


def _zero_point(editor: GraphEditor, dq_or_q: ir.Node, dtype: ir.DataType) -> ir.Value:
    if len(dq_or_q.inputs) > 2 and dq_or_q.inputs[2] is not None:
        return dq_or_q.inputs[2]
    np_dtype = np.uint8 if dtype == ir.DataType.UINT8 else np.int8
    return editor.initializer(f"{dq_or_q.name}_zero_point", np.zeros((), np_dtype))


def _refusal(qop: QOp, node: ir.Node) -> tuple[str | None, list[_Dq], ir.Node | None]:
    """Why `node` cannot become `qop` (None if it can), its input DQs and output Q."""
    reason = qop.check(node)
    if reason:
        return reason, [], None
    positions = [i for slot in qop.layout if slot[0] in ("q", "split") for i in slot[1:]]
    if any(slot[0] == "q*" for slot in qop.layout):
        positions = list(range(len(node.inputs)))
    dqs = [_dq_of(node.inputs[i]) if i < len(node.inputs) else None for i in positions]
    if any(dq is None for dq in dqs):
        return "an input is not an 8-bit integer DequantizeLinear (QOperator kernels take int8/uint8)", [], None
    for i, dq in zip(positions, dqs, strict=True):
        if dq.per_tensor():
            continue
        if i not in qop.per_channel:
            return f"input {i} has per-channel scales", [], None
        axis = dq.node.attributes.get("axis")
        if _axis(axis.as_int() if axis is not None else 1, dq.data) != channel_axis(qop, node):
            return f"input {i} has scales along another axis than the kernel's", [], None
    for slot in qop.layout:
        if slot[0] == "raw" and slot[1] < len(node.inputs) and node.inputs[slot[1]] is not None:
            bias = _int32_dq(node.inputs[slot[1]])
            if bias is None:
                return "its bias is not an int32 DequantizeLinear", [], None
            want = bias_scale(node, dqs[0].scale, dqs[1].scale)
            have, zp = constant_array(bias.scale), constant_array(bias.zero_point) if bias.zero_point else 0
            if want is None or have is None or not same_scales(have, want) or np.any(zp != 0):
                return "its int32 bias is not scaled by input scale x weight scale", [], None
    q = _q_after(node.outputs[0])
    mismatch = _type_mismatch(qop, positions, dqs, q)
    if mismatch:
        return mismatch, [], None
    if q is None and qop.output == "required":
        return "its output is not quantized", [], None
    if q is not None and qop.output == "float":
        return "its output is quantized", [], None
    return None, dqs, q


def _type_mismatch(qop: QOp, positions: list[int], dqs: list[_Dq], q: ir.Node | None) -> str | None:
    """Why onnxruntime has no `qop` kernel for these 8-bit types, if it has none: its CPU
    kernels take one type for the activations and the output, and int8 or that type for a
    weight (uint8 activations with int8 or uint8 weights, int8 with int8); QLinearConv of
    int8 activations and uint8 weights failed to load, and every node went float."""
    first = dqs[0].data.dtype
    for i, dq in zip(positions[1:], dqs[1:], strict=True):
        dtype = dq.data.dtype
        if dtype != first and not (i in qop.per_channel and dtype == ir.DataType.INT8):
            what = "weights" if i in qop.per_channel else f"input {i}"
            return f"onnxruntime has no {qop.qop} kernel for {_name(first)} inputs with {_name(dtype)} {what}"
    if q is not None and qop.output != "float" and q.outputs[0].dtype != first:
        return f"onnxruntime has no {qop.qop} kernel for {_name(first)} inputs with a {_name(q.outputs[0].dtype)} output"
    return None


def _name(dtype: ir.DataType | None) -> str:
    return dtype.name.lower() if dtype is not None else "unknown"


def _axis(axis: int, value: ir.Value) -> int | None:
    rank = value.shape.rank() if value.shape is not None else None
    return axis + rank if axis < 0 and rank is not None else axis


def _int32_dq(value: ir.Value) -> _Dq | None:
    node = value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.inputs[0].dtype != ir.DataType.INT32:
        return None
    return _Dq(node)


def _kernel_inputs(qop: QOp, node: ir.Node, dqs: list[_Dq], q: ir.Node | None,
                   editor: GraphEditor) -> list[ir.Value | None]:
    inputs: list[ir.Value | None] = []
    pending = iter(dqs)
    for slot in qop.layout:
        if slot[0] in ("q", "q*"):
            for dq in (pending if slot[0] == "q*" else [next(pending)]):
                inputs += [dq.data, dq.scale, _zero_point(editor, dq.node, dq.data.dtype)]
        elif slot[0] == "split":
            pair = [next(pending) for _ in slot[1:]]
            inputs += [dq.data for dq in pair] + [dq.scale for dq in pair]
            inputs += [_zero_point(editor, dq.node, dq.data.dtype) for dq in pair]
        elif slot[0] == "raw":
            value = node.inputs[slot[1]] if slot[1] < len(node.inputs) else None
            inputs.append(None if value is None else value.producer().inputs[0])
        elif q is not None:
            inputs += [q.inputs[1], _zero_point(editor, q, q.outputs[0].dtype)]
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs


def _replace(graph: ir.Graph, old: ir.Node, new: ir.Node, result: ir.Value) -> None:
    """Put `new` where `old` was; `result` (an output of the nodes removed) moves onto it."""
    graph.insert_before(old, new)
    replace_value(result, new.outputs[0])


def _remove_unused(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    for node in nodes:
        if node.graph is graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _same_params(a: ir.Node, b: ir.Node) -> bool:
    """Whether a DequantizeLinear and a QuantizeLinear use equal scales and zero points."""
    for i in (1, 2):
        x = constant_array(a.inputs[i]) if len(a.inputs) > i and a.inputs[i] is not None else None
        y = constant_array(b.inputs[i]) if len(b.inputs) > i and b.inputs[i] is not None else None
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            return False
    return a.inputs[0].dtype == b.outputs[0].dtype


def to_qoperator(model: ir.Model) -> FormatReport:
    """Rewrite the QDQ patterns of `model` as integer kernels, in place (module doc)."""
    graph = model.graph
    editor = GraphEditor(graph)
    report = FormatReport()
    used_contrib = False
    for node in list(graph):
        if node.graph is not graph or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in DATA_MOVEMENT:
            dq, q = _dq_of(node.inputs[0]) if node.inputs else None, _q_after(node.outputs[0])
            rest = list(node.inputs[1:]) if dq is None or node.op_type != "Pad" else _pad_inputs(node, dq.node)
            if dq is not None and q is not None and len(node.outputs) == 1 and _same_params(dq.node, q) \
                    and rest is not None:
                out = ir.Value(name=editor.unique(f"{node.name}_int"), type=q.outputs[0].type,
                               shape=q.outputs[0].shape)
                new = ir.node(node.op_type, [dq.data, *rest], attributes=dict(node.attributes),
                              outputs=[out], name=editor.unique(f"{node.name}_quant"))
                _replace(graph, node, new, q.outputs[0])
                graph.remove([q, node], safe=True)
                _remove_unused(graph, [dq.node])
                report.converted[node.op_type + " (8-bit)"] += 1
            continue
        if node.op_type not in QOPS:
            continue
        tried = [(qop, *_refusal(qop, node)) for qop in QOPS[node.op_type]]
        fits = [t for t in tried if t[1] is None]
        if not fits:
            # a node quantized in QDQ form (its output quantized again, or a quantized constant weight);
            # a float node that merely reads quantized neighbours' outputs stays out of the note
            if _quantized_in_qdq(node):
                report.kept[node.name] = f"{node.op_type}: {tried[0][1]}"
            continue
        qop, _, dqs, q = fits[0]
        attrs = {name: a for name, a in node.attributes.items() if name not in qop.drop}
        attrs.update(qop.extra(node, model))
        result = q.outputs[0] if q is not None else node.outputs[0]
        out = ir.Value(name=editor.unique(f"{node.name}_{qop.qop}"), type=result.type, shape=result.shape)
        new = ir.node(qop.qop, _kernel_inputs(qop, node, dqs, q, editor), attributes=attrs, domain=qop.domain,
                      outputs=[out], name=editor.unique(f"{node.name}_{qop.qop}"))
        bias = [node.inputs[s[1]].producer() for s in qop.layout
                if s[0] == "raw" and s[1] < len(node.inputs) and node.inputs[s[1]] is not None]
        _replace(graph, node, new, result)
        graph.remove([node] + ([q] if q is not None else []), safe=True)
        _remove_unused(graph, [dq.node for dq in dqs] + bias)
        report.converted[qop.qop] += 1
        used_contrib |= qop.domain == CONTRIB
    if used_contrib:
        model.opset_imports.setdefault(CONTRIB, 1)
    return report
