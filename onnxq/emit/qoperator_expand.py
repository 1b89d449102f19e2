"""QOperator format, the way back: `to_qdq` expands every integer kernel (and 8-bit
data-movement op) into DequantizeLinear -> float op -> QuantizeLinear, the inverse of
`to_qoperator`; `to_float` strips every Q/DQ (weights dequantized), for debugging.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from onnxq.emit.qoperator_kernels import (
    BY_KERNEL,
    DATA_MOVEMENT,
    EIGHT_BIT,
    FormatReport,
    QOp,
    bias_scale,
    channel_axis,
    constant_size,
    replace_value,
)
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array, dequantized_constant
from onnxq.graph.quantized import DOMAINS
from onnxq.numerics.qmath import INT_TYPES


def _params(graph: ir.Graph) -> dict[ir.Value, tuple[ir.Value, ir.Value | None]]:
    """Scale and zero point of every 8-bit tensor a QuantizeLinear, an integer kernel or an
    8-bit data-movement op produces, in graph order."""
    params: dict[ir.Value, tuple[ir.Value, ir.Value | None]] = {}
    for node in graph:
        if node.op_type == "QuantizeLinear" and node.domain in DOMAINS:
            params[node.outputs[0]] = (node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None)
        elif (node.domain, node.op_type) in BY_KERNEL:
            slots = _slots(BY_KERNEL[(node.domain, node.op_type)], node)
            if "out" in slots:
                params[node.outputs[0]] = slots["out"]
        elif node.op_type in DATA_MOVEMENT and node.inputs and node.inputs[0] in params:
            params[node.outputs[0]] = params[node.inputs[0]]
    return params


def _slots(qop: QOp, node: ir.Node) -> dict:
    """The kernel's inputs by slot: {k: (x, scale, zp)} for quantized inputs, {("raw", k):
    value} for raw ones, "out": (scale, zp) when it has a quantized output."""
    slots: dict = {}
    inputs, i = list(node.inputs), 0
    for slot in qop.layout:
        if slot[0] == "q":
            slots[slot[1]] = tuple(inputs[i:i + 3])
            i += 3
        elif slot[0] == "split":
            n = len(slot) - 1
            for j, k in enumerate(slot[1:]):
                slots[k] = (inputs[i + j], inputs[i + n + j], inputs[i + 2 * n + j] if i + 2 * n + j < len(inputs)
                            else None)
            i += 3 * n
        elif slot[0] == "q*":
            for k, j in enumerate(range(i, len(inputs), 3)):
                slots[k] = tuple(inputs[j:j + 3])
            i = len(inputs)
        elif slot[0] == "raw":
            slots[("raw", slot[1])] = inputs[i] if i < len(inputs) else None
            i += 1
        elif i < len(inputs) and inputs[i] is not None:
            slots["out"] = (inputs[i], inputs[i + 1] if i + 1 < len(inputs) else None)
            i += 2
    return slots


def _weight_axis(qop: QOp, node: ir.Node, k: int, scale: ir.Value) -> int | None:
    return None if (constant_size(scale) or 1) == 1 else channel_axis(qop, node)


def _dq(editor: GraphEditor, graph: ir.Graph, before: ir.Node, x: ir.Value, scale: ir.Value,
        zp: ir.Value | None, axis: int | None, name: str) -> ir.Value:
    out = ir.Value(name=editor.unique(f"{name}_dq"), type=ir.TensorType(scale.dtype), shape=x.shape)
    attrs = {"axis": axis} if axis is not None else {}
    inputs = [x, scale] + ([zp] if zp is not None else [])
    graph.insert_before(before, ir.node("DequantizeLinear", inputs, attrs, outputs=[out],
                                        name=editor.unique(f"{name}_DequantizeLinear")))
    return out


def to_qdq(model: ir.Model) -> FormatReport:
    """Expand every integer kernel (and 8-bit data-movement op) into DequantizeLinear ->
    float op -> QuantizeLinear, in place: the inverse of `to_qoperator`."""
    graph = model.graph
    editor = GraphEditor(graph)
    report = FormatReport()
    for node in list(graph):
        key = (node.domain, node.op_type)
        if key not in BY_KERNEL:
            continue
        if _expand_kernel(graph, editor, node, BY_KERNEL[key], model):
            report.converted[node.op_type] += 1
        else:
            report.kept[node.name] = f"{node.op_type}: its bias scale is not a constant"
    params = _params(graph)  # every 8-bit tensor now comes from a QuantizeLinear
    for node in list(graph):
        if node.op_type in DATA_MOVEMENT and node.inputs and node.inputs[0] in params and \
                node.inputs[0].dtype in EIGHT_BIT:
            scale, zp = params[node.inputs[0]]
            x = _dq(editor, graph, node, node.inputs[0], scale, zp, None, node.name)
            node.replace_input_with(0, x)
            if node.op_type == "Pad" and len(node.inputs) > 2 and node.inputs[2] is not None:
                node.replace_input_with(2, None)  # the zero point it padded with is 0 in float
            params[_requantize_output(graph, editor, node, scale, zp)] = (scale, zp)
            report.converted[node.op_type + " (8-bit)"] += 1
    return report


def _requantize_output(graph: ir.Graph, editor: GraphEditor, node: ir.Node, scale: ir.Value,
                       zp: ir.Value | None) -> ir.Value:
    """Make `node` write float and quantize its output with (scale, zp) after it; the
    quantized value, which took the place of the node's output."""
    old = node.outputs[0]
    q_out = ir.Value(name=editor.unique(f"{node.name}_q"), type=old.type, shape=old.shape)
    old.replace_all_uses_with(q_out, replace_graph_outputs=True)
    name = old.name
    old.name, q_out.name = editor.unique(f"{node.name}_float"), name
    old.type = ir.TensorType(scale.dtype)
    graph.insert_after(node, ir.node("QuantizeLinear", [old, scale] + ([zp] if zp is not None else []),
                                     outputs=[q_out], name=editor.unique(f"{node.name}_QuantizeLinear")))
    return q_out


def _expand_kernel(graph: ir.Graph, editor: GraphEditor, node: ir.Node, qop: QOp, model: ir.Model) -> bool:
    slots = _slots(qop, node)
    inputs: dict[int, ir.Value | None] = {}
    for k, triple in ((k, v) for k, v in slots.items() if isinstance(k, int)):
        x, scale, zp = (*triple, None)[:3]
        inputs[k] = _dq(editor, graph, node, x, scale, zp, _weight_axis(qop, node, k, scale), f"{node.name}_in{k}")
    for key, value in slots.items():
        if isinstance(key, tuple) and value is not None:
            scale = bias_scale(node, slots[0][1], slots[1][1])
            if scale is None:
                return False
            inputs[key[1]] = _dq(editor, graph, node, value, editor.initializer(f"{node.name}_bias_scale", scale),
                                 editor.initializer(f"{node.name}_bias_zero_point", np.zeros(scale.shape, np.int32)),
                                 0 if scale.ndim else None, f"{node.name}_bias")
    float_inputs = [inputs.get(k) for k in range(max(inputs) + 1)]
    extra = set(qop.extra(node, model))
    attrs = {name: a for name, a in node.attributes.items() if name not in extra}
    out = node.outputs[0]
    float_type = ir.TensorType(slots["out"][0].dtype) if "out" in slots else out.type
    float_node = ir.node(qop.op, float_inputs, attrs, outputs=[ir.Value(name=editor.unique(f"{node.name}_float"),
                                                                         type=float_type, shape=out.shape)],
                         name=editor.unique(f"{node.name}_{qop.op}"))
    graph.insert_before(node, float_node)
    result = float_node.outputs[0]
    if "out" in slots:
        scale, zp = slots["out"]
        q_out = ir.Value(name=editor.unique(f"{node.name}_q"), type=out.type, shape=out.shape)
        graph.insert_after(float_node, ir.node("QuantizeLinear", [result, scale] + ([zp] if zp is not None else []),
                                               outputs=[q_out], name=editor.unique(f"{node.name}_QuantizeLinear")))
        result = q_out
    replace_value(out, result)
    graph.remove(node, safe=True)
    return True


def to_float(model: ir.Model) -> FormatReport:
    """Strip every Q/DQ: integer kernels are expanded first, constant weights are stored
    dequantized, and each QuantizeLinear -> DequantizeLinear pair becomes a Clip to its
    representable range (keeping absorbed Relu/Clip; only rounding goes). For debugging
    accuracy: the float model with quantized weights and clipped activations."""
    graph = model.graph
    report = to_qdq(model)
    editor = GraphEditor(graph)
    removed = Counter()
    for node in list(graph):
        if node.op_type != "DequantizeLinear" or node.domain not in DOMAINS:
            continue
        source = node.inputs[0]
        producer = source.producer()
        if producer is not None and producer.op_type == "QuantizeLinear" and producer.domain in DOMAINS:
            value = _clamp(graph, editor, node, producer)
        else:
            array = dequantized_constant(node)
            if array is None:
                continue
            value = editor.initializer(f"{node.outputs[0].name}_float", array)
        _bypass(graph, node, value)
        removed["DequantizeLinear"] += 1
        if producer is not None and not any(o.uses() or o.is_graph_output() for o in producer.outputs):
            graph.remove(producer, safe=True)
            removed["QuantizeLinear"] += 1
    report.converted.update(removed)
    return report


def _clamp(graph: ir.Graph, editor: GraphEditor, dq: ir.Node, q: ir.Node) -> ir.Value:
    """The float tensor a Q -> DQ pair quantized, clipped to the pair's representable range
    (which holds any Relu or Clip the quantizer absorbed): only the rounding goes."""
    scale, zp = constant_array(q.inputs[1]), constant_array(q.inputs[2]) if len(q.inputs) > 2 else None
    dtype = q.outputs[0].dtype
    info = next((t for t in INT_TYPES.values() if dtype is not None and t.onnx_type == dtype.value), None)
    if scale is None or scale.size != 1 or info is None:
        return q.inputs[0]
    zero = 0 if zp is None else int(np.asarray(zp).reshape(()))
    bounds = [np.asarray((v - zero) * scale.reshape(()), dtype=scale.dtype) for v in (info.qmin, info.qmax)]
    low, high = (editor.initializer(f"{dq.name}_{end}", b) for end, b in zip(("min", "max"), bounds, strict=True))
    clip = ir.node("Clip", [q.inputs[0], low, high], outputs=[ir.Value(name=editor.unique(f"{dq.name}_clipped"),
                                                                       type=dq.outputs[0].type)],
                   name=editor.unique(f"{dq.name}_Clip"))
    graph.insert_before(dq, clip)
    return clip.outputs[0]


def _bypass(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    """Remove `node`, its readers reading `value` instead (a graph output keeps its name
    through an Identity)."""
    old = node.outputs[0]
    if old.is_graph_output():
        identity = ir.node("Identity", [value], outputs=[ir.Value(type=old.type, shape=old.shape)],
                           name=f"{node.name}_Identity")
        graph.insert_before(node, identity)
        replace_value(old, identity.outputs[0])
    else:
        old.replace_all_uses_with(value)
    graph.remove(node, safe=True)
