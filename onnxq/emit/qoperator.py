"""QOperator format: a QDQ model's quantized patterns as onnxruntime's integer kernels, and
back.

A pattern is an op whose quantized inputs come from DequantizeLinear and whose output (if
the kernel has a quantized output) goes only into a QuantizeLinear. `to_qoperator`
replaces it by one integer node (QLinearConv, QLinearMatMul, com.microsoft QGemm,
QLinearAdd, ...) reading the DequantizeLinear inputs and writing the QuantizeLinear
output, so Q/DQ remain only at the entry and exit of each integer region and around ops
without a kernel. Data-movement ops (MaxPool, Reshape, Transpose, ...) whose input and
output carry the same scale and zero point run on the 8-bit tensor directly.
`to_qdq` expands every such node back into DequantizeLinear -> float op ->
QuantizeLinear, and `to_float` strips all Q/DQ (weights dequantized), for debugging.

One table (`QOPS`) describes each kernel's input layout, so both directions read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array, dequantized_constant
from onnxq.graph.quantized import DOMAINS

CONTRIB = "com.microsoft"
EIGHT_BIT = (ir.DataType.UINT8, ir.DataType.INT8)

# Layout slots of an integer kernel's inputs: ("q", i) the float op's input i as its
# quantized tensor, scale and zero point; ("split", i, j) inputs i and j as x_i, x_j,
# scale_i, scale_j, zp_i, zp_j (MatMulIntegerToFloat); ("raw", i) the float op's input i
# unchanged (the int32 bias, whose DequantizeLinear is dropped); ("out",) the output's
# scale and zero point; ("q*",) every input, quantized (variadic).
Slot = tuple


@dataclass(frozen=True)
class QOp:
    """How the float op `op` becomes the integer kernel `qop`."""

    op: str
    qop: str
    domain: str
    layout: tuple[Slot, ...]
    # "required": needs a QuantizeLinear after it; "optional": float output allowed too;
    # "float": writes float (no QuantizeLinear after it).
    output: str = "required"
    per_channel: tuple[int, ...] = ()  # quantized inputs that may have per-channel scales
    extra: Callable[[ir.Node, ir.Model], dict] = lambda node, model: {}
    drop: tuple[str, ...] = ()  # float-op attributes the kernel does not take
    check: Callable[[ir.Node], str | None] = lambda node: None


def _softmax_extra(node: ir.Node, model: ir.Model) -> dict:
    return {"opset": model.opset_imports.get("", 13)}


def _gemm_check(node: ir.Node) -> str | None:
    beta = node.attributes.get("beta")
    if len(node.inputs) > 2 and beta is not None and beta.as_float() != 1.0:
        return "Gemm with beta != 1"
    return None


def _pool_check(node: ir.Node) -> str | None:
    return "AveragePool with dilations" if "dilations" in node.attributes else None


_TABLE = (
    QOp("Conv", "QLinearConv", "", (("q", 0), ("q", 1), ("out",), ("raw", 2)), per_channel=(1,)),
    QOp("MatMul", "QLinearMatMul", "", (("q", 0), ("q", 1), ("out",)), per_channel=(1,)),
    QOp("MatMul", "MatMulIntegerToFloat", CONTRIB, (("split", 0, 1),), output="float", per_channel=(1,)),
    QOp("Gemm", "QGemm", CONTRIB, (("q", 0), ("q", 1), ("raw", 2), ("out",)), output="optional",
        per_channel=(1,), drop=("beta",), check=_gemm_check),
    QOp("Add", "QLinearAdd", CONTRIB, (("q", 0), ("q", 1), ("out",))),
    QOp("Mul", "QLinearMul", CONTRIB, (("q", 0), ("q", 1), ("out",))),
    QOp("Concat", "QLinearConcat", CONTRIB, (("out",), ("q*",))),
    QOp("AveragePool", "QLinearAveragePool", CONTRIB, (("q", 0), ("out",)),
        extra=lambda node, model: {"channels_last": 0}, check=_pool_check),
    QOp("GlobalAveragePool", "QLinearGlobalAveragePool", CONTRIB, (("q", 0), ("out",)),
        extra=lambda node, model: {"channels_last": 0}),
    QOp("Sigmoid", "QLinearSigmoid", CONTRIB, (("q", 0), ("out",))),
    QOp("LeakyRelu", "QLinearLeakyRelu", CONTRIB, (("q", 0), ("out",))),
    QOp("Softmax", "QLinearSoftmax", CONTRIB, (("q", 0), ("out",)), extra=_softmax_extra),
)
QOPS: dict[str, tuple[QOp, ...]] = {op: tuple(q for q in _TABLE if q.op == op) for op in dict.fromkeys(q.op for q in _TABLE)}
BY_KERNEL = {(q.domain, q.qop): q for q in _TABLE}
# Ops that only move or select data: they run on 8-bit tensors as they are (input 0).
DATA_MOVEMENT = ("MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Resize", "Gather",
                 "Slice", "DepthToSpace", "SpaceToDepth", "Identity")


@dataclass
class FormatReport:
    """What a format conversion did: converted ops by kernel, and quantized nodes left in
    Q/DQ form with the reason."""

    converted: Counter = field(default_factory=Counter)
    kept: dict[str, str] = field(default_factory=dict)
    left: Counter = field(default_factory=Counter)  # weight-only / dynamic kernels, not rewritten

    def note(self, what: str) -> str:
        done = ", ".join(f"{op} {n}" for op, n in sorted(self.converted.items())) or "nothing"
        line = {"qoperator": f"qoperator: made {done}",
                "qdq": f"qdq: rewrote {done} as Q/DQ around float ops",
                "float": f"float: removed {done}"}.get(what, f"{what}: {done}")
        if self.kept:
            reasons = Counter(self.kept.values())
            line += "; kept as Q/DQ: " + "; ".join(f"{why} x{n}" for why, n in sorted(reasons.items()))
        if self.left:
            line += "; left as they are (weight-only or dynamic kernels): " + ", ".join(
                f"{op} x{n}" for op, n in sorted(self.left.items()))
        return line


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
        return self.scale.shape is not None and self.scale.shape.rank() == 0 or _size(self.scale) == 1


def _size(value: ir.Value) -> int | None:
    array = constant_array(value)
    return None if array is None else int(array.size)


def _dq_of(value: ir.Value | None) -> _Dq | None:
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in DOMAINS:
        return None
    if node.inputs[0].dtype not in EIGHT_BIT or "block_size" in node.attributes:
        return None
    return _Dq(node)


def _q_after(value: ir.Value) -> ir.Node | None:
    """The QuantizeLinear that is the only reader of `value`, if any (8-bit, per tensor)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    if node.op_type != "QuantizeLinear" or node.domain not in DOMAINS or uses[0].idx != 0:
        return None
    if node.outputs[0].dtype not in EIGHT_BIT or _size(node.inputs[1]) != 1:
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
        return "an input is not 8-bit DequantizeLinear", [], None
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
            if want is None or have is None or not _same_scales(have, want) or np.any(zp != 0):
                return "its int32 bias is not scaled by input scale x weight scale", [], None
    q = _q_after(node.outputs[0])
    if q is None and qop.output == "required":
        return "its output is not quantized", [], None
    if q is not None and qop.output == "float":
        return "its output is quantized", [], None
    return None, dqs, q


def _axis(axis: int, value: ir.Value) -> int | None:
    rank = value.shape.rank() if value.shape is not None else None
    return axis + rank if axis < 0 and rank is not None else axis


def channel_axis(qop: QOp, node: ir.Node) -> int | None:
    """The axis of the weight (input 1) along which the kernel takes per-channel scales."""
    if qop.op == "Gemm":
        trans = node.attributes.get("transB")
        return 0 if trans is not None and trans.as_int() else 1
    if qop.op == "MatMul":
        weight = node.inputs[1]
        return 1 if weight.shape is not None and weight.shape.rank() == 2 else None
    return 0


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
    _replace_value(result, new.outputs[0])


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
            if dq is not None and q is not None and len(node.outputs) == 1 and _same_params(dq.node, q):
                out = ir.Value(name=editor.unique(f"{node.name}_int"), type=q.outputs[0].type,
                               shape=q.outputs[0].shape)
                new = ir.node(node.op_type, [dq.data, *node.inputs[1:]], attributes=dict(node.attributes),
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
            if any(_dq_of(v) for v in node.inputs):
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


# ---------------------------------------------------------------------------------------
# back to QDQ, and to float


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
    return None if (_size(scale) or 1) == 1 else channel_axis(qop, node)


def _dq(editor: GraphEditor, graph: ir.Graph, before: ir.Node, x: ir.Value, scale: ir.Value,
        zp: ir.Value | None, axis: int | None, name: str) -> ir.Value:
    out = ir.Value(name=editor.unique(f"{name}_dq"), type=ir.TensorType(scale.dtype), shape=x.shape)
    attrs = {"axis": axis} if axis is not None else {}
    inputs = [x, scale] + ([zp] if zp is not None else [])
    graph.insert_before(before, ir.node("DequantizeLinear", inputs, attrs, outputs=[out],
                                        name=editor.unique(f"{name}_DequantizeLinear")))
    return out


def _same_scales(have: np.ndarray, want: np.ndarray) -> bool:
    """Whether a bias's scales equal the wanted ones: one value for all, or one per channel
    (a single channel's [1] and () both count as one)."""
    have, want = np.ravel(have), np.ravel(want)
    return have.size in (1, want.size) and bool(np.allclose(np.broadcast_to(have, want.shape), want,
                                                             rtol=1e-5, atol=0))


def bias_scale(node: ir.Node, x_scale: ir.Value, w_scale: ir.Value) -> np.ndarray | None:
    """The scale an int32 bias must have: input scale x weight scale (x alpha for Gemm)."""
    arrays = [constant_array(x_scale), constant_array(w_scale)]
    if any(a is None for a in arrays):
        return None
    alpha = node.attributes.get("alpha")
    scale = arrays[0].astype(np.float32) * arrays[1].astype(np.float32)
    if alpha is not None:
        scale = scale * np.float32(alpha.as_float())
    return scale.reshape(-1) if scale.size > 1 else scale.reshape(())


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
    _replace_value(out, result)
    graph.remove(node, safe=True)
    return True


def _replace_value(old: ir.Value, new: ir.Value) -> None:
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = None
    new.name = name


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
    from onnxq.numerics.qmath import INT_TYPES

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
        _replace_value(old, identity.outputs[0])
    else:
        old.replace_all_uses_with(value)
    graph.remove(node, safe=True)


FORMATS: dict[str, Callable[[ir.Model], FormatReport]] = {
    "qoperator": to_qoperator,
    "qdq": to_qdq,
    "float": to_float,
}


def convert_format(model: ir.Model, to: str) -> FormatReport:
    """`model` rewritten in place into format `to` (qdq, qoperator or float)."""
    from onnxq.graph.edit import drop_unused_initializers

    report = FORMATS[to](model)
    drop_unused_initializers(model.graph)
    model.graph.sort()
    return report


def convert_model(source: str, output: str, to: str) -> str:
    """Read a quantized model, write it in format `to` (atomically; never over the input)
    and return one summary line. A model with no Q/DQ or integer kernel is refused."""
    from onnxq.errors import ModelError, OnnxqError
    from onnxq.graph.load import read_model
    from onnxq.graph.quantized import describe, opaque_kernels, quantized_ops
    from onnxq.graph.save import check_output_path, save_model

    if to not in FORMATS:
        raise OnnxqError(f"unknown format {to!r}; use one of: {', '.join(FORMATS)}")
    check_output_path(output, source)
    model = read_model(source)
    if not quantized_ops(model):
        raise ModelError(f"{source} has no QuantizeLinear/DequantizeLinear or integer kernel: it is not a "
                         "quantized model; quantize it first with onnxq quantize")
    opaque = opaque_kernels(model)
    if opaque and to == "float":
        raise ModelError(f"{source} holds weight-only or dynamic kernels ({describe(opaque)}) that convert "
                         "cannot turn back into float ops; quantize the float model again instead")
    report = convert_format(model, to)
    report.left = opaque
    save_model(model, output)
    return f"onnxq: {source} -> {output}\n  {report.note(to)}"
