"""Dynamic quantization: weights quantized offline, activations at run time.

No calibration is needed: every quantized node gets its own DynamicQuantizeLinear
(uint8, asymmetric, range taken from the tensor at run time) and an integer kernel on
offline-quantized int8/uint8 weights. The patterns are the ones onnxruntime fuses:

* MatMul / Gemm: DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(x_scale * w_scale)
  [-> Add(bias)], which onnxruntime turns into MatMulIntegerToFloat and then
  DynamicQuantizeMatMul. Gemm's transB/alpha/beta are folded into the constant weight
  and bias offline.
* Conv: DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul(scales) [-> Add(bias)].
  onnxruntime's CPU ConvInteger takes int8 or uint8 weights but only a per-tensor weight
  zero point, so per-channel weights need equal zero points (symmetric); otherwise the
  weight falls back to per-tensor quantization.
* LSTM: com.microsoft DynamicQuantizeLSTM with transposed int8/uint8 W and R and their
  scales and zero points per direction (per tensor) or per direction and gate unit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config, DType
from onnxq.emit.lowering import LoweringReport, register_lowering
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.numerics.weights import QuantizedTensor, quantize_weight

CONTRIB = "com.microsoft"
WEIGHT_DTYPES = (DType.INT8, DType.UINT8)
SCHEMES = ("per_tensor", "per_channel")


@dataclass
class DynamicReport:
    """What the dynamic emitter did: quantized nodes, skipped nodes and notes, by node name."""

    quantized: dict[str, str] = field(default_factory=dict)  # node name -> op type
    skipped: dict[str, str] = field(default_factory=dict)  # node name -> reason
    notes: dict[str, str] = field(default_factory=dict)  # node name -> what was changed


class _Builder:
    """Collects the new nodes of one rewrite; they are inserted together before the old node."""

    def __init__(self, editor: GraphEditor, prefix: str) -> None:
        self.editor = editor
        self.prefix = prefix
        self.nodes: list[ir.Node] = []

    def const(self, suffix: str, array: np.ndarray) -> ir.Value:
        return self.editor.initializer(f"{self.prefix}_{suffix}", np.asarray(array))

    def op(self, op_type: str, inputs: list[ir.Value | None], suffix: str,
           attrs: Mapping | None = None, n_out: int = 1, domain: str = "",
           dtypes: tuple[ir.DataType | None, ...] = ()) -> list[ir.Value]:
        """Add one node; returns its outputs (named `<prefix>_<suffix>[_i]`)."""
        outs = []
        for i in range(n_out):
            value = ir.Value(name=self.editor.unique(f"{self.prefix}_{suffix}" + (f"_{i}" if i else "")))
            if i < len(dtypes):
                value.dtype = dtypes[i]
            outs.append(value)
        name = self.editor.unique(f"{self.prefix}_{op_type}")
        self.nodes.append(ir.node(op_type, inputs, dict(attrs or {}), domain=domain, outputs=outs, name=name))
        return outs


# -- checks and offline math ----------------------------------------------------------


def _spec_reason(spec: ResolvedSpec) -> str | None:
    if spec.dtype not in WEIGHT_DTYPES:
        return f"weight dtype {spec.dtype} not supported by the integer kernels (int8/uint8 only)"
    if spec.qscheme not in SCHEMES:
        return f"qscheme {spec.qscheme} not supported for dynamic quantization (per_tensor/per_channel)"
    return None


def _float_reason(value: ir.Value | None, what: str) -> str | None:
    """Reason when a known dtype is not float32 (DynamicQuantizeLinear takes float32 only)."""
    if value is not None and value.dtype not in (None, ir.DataType.FLOAT):
        return f"{what} is {value.dtype}, dynamic quantization needs float32"
    return None


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _uniform(zp: np.ndarray) -> np.ndarray:
    """A per-channel zero point whose entries are all equal, as a scalar."""
    zp = np.asarray(zp)
    first = zp.reshape(-1)[0]
    return np.asarray(first) if np.all(zp == first) else zp


def _quantize(w: np.ndarray, spec: ResolvedSpec, axis: int) -> QuantizedTensor:
    """Quantize per channel along `axis` (per tensor when the spec says so)."""
    return quantize_weight(w, spec, axis if spec.qscheme == "per_channel" else None)


# -- graph surgery --------------------------------------------------------------------


def _replace(graph: ir.Graph, node: ir.Node, builder: _Builder, outputs: list[ir.Value]) -> None:
    """Insert the builder's nodes before `node`, move its outputs' uses and names, remove it."""
    graph.insert_before(node, builder.nodes)
    for old, new in zip(node.outputs, outputs):
        name = old.name  # "" for an absent optional output: the new one is absent too
        if old.dtype is not None:
            new.dtype = old.dtype
        new.shape = old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = None
        new.name = name
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for value in inputs:
        if value.const_value is not None and not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name, None)


def _scaled_integer_op(b: _Builder, x: ir.Value, op_type: str, w: QuantizedTensor,
                       w_scale: np.ndarray, attrs: Mapping | None = None) -> ir.Value:
    """DynamicQuantizeLinear(x) -> op_type(x_q, w_q, x_zp, w_zp) -> Cast -> Mul(x_s * w_s)."""
    u8, i32, f32 = ir.DataType.UINT8, ir.DataType.INT32, ir.DataType.FLOAT
    x_q, x_s, x_zp = b.op("DynamicQuantizeLinear", [x], "x_quantized", n_out=3, dtypes=(u8, f32, u8))
    w_q = b.const("weight_quantized", w.data)
    w_zp = b.const("weight_zero_point", _uniform(w.zero_point))
    (acc,) = b.op(op_type, [x_q, w_q, x_zp, w_zp], "int32", attrs, dtypes=(i32,))
    (acc_f,) = b.op("Cast", [acc], "float", {"to": ir.DataType.FLOAT}, dtypes=(f32,))
    (scale,) = b.op("Mul", [x_s, b.const("weight_scale", w_scale.astype(np.float32))], "scale", dtypes=(f32,))
    (y,) = b.op("Mul", [acc_f, scale], "scaled", dtypes=(f32,))
    return y


def _add_bias(b: _Builder, y: ir.Value, bias: np.ndarray | None) -> ir.Value:
    if bias is None:
        return y
    (out,) = b.op("Add", [y, b.const("bias", bias.astype(np.float32))], "biased", dtypes=(ir.DataType.FLOAT,))
    return out


# -- per op type ----------------------------------------------------------------------


@dataclass
class _Context:
    graph: ir.Graph
    editor: GraphEditor
    report: DynamicReport


def _emit_matrix(ctx: _Context, node: ir.Node, w: np.ndarray, bias: np.ndarray | None,
                 spec: ResolvedSpec) -> None:
    """Rewrite `node` as x @ w (+ bias) with w [K, N] quantized per column or per tensor."""
    qt = _quantize(w, spec, axis=1)
    b = _Builder(ctx.editor, node.name)
    y = _scaled_integer_op(b, node.inputs[0], "MatMulInteger", qt, np.asarray(qt.scale))
    _replace(ctx.graph, node, b, [_add_bias(b, y, bias)])


def _matmul(ctx: _Context, node: ir.Node, spec: ResolvedSpec) -> str | None:
    w = constant_array(_input(node, 1))
    if w is None:
        return "weight (input 1) is not a constant"
    if w.ndim != 2:
        return f"weight has rank {w.ndim}; only rank-2 weights are quantized"
    if reason := _float_reason(node.inputs[1], "weight") or _float_reason(node.inputs[0], "input"):
        return reason
    _emit_matrix(ctx, node, w, None, spec)
    return None


def _gemm_bias(c: np.ndarray | None, beta: float, n: int) -> np.ndarray | None:
    """beta * C as a [N] vector when it broadcasts like one (what onnxruntime fuses), else as is."""
    if c is None:
        return None
    c = np.asarray(c, dtype=np.float64) * beta
    if c.size == 1:
        return np.full(n, float(c.reshape(-1)[0]))
    if c.size == n and c.shape[-1] == n:
        return c.reshape(n)
    return c


def _weight_and_bias(node: ir.Node, bias_label: str) -> tuple[np.ndarray, np.ndarray | None] | str:
    """The constant weight (input 1) and bias (input 2, if any), or why the node cannot be
    quantized dynamically."""
    w = constant_array(_input(node, 1))
    if w is None:
        return "weight (input 1) is not a constant"
    bias_value = _input(node, 2)
    bias = constant_array(bias_value)
    if bias_value is not None and bias is None:
        return f"{bias_label} (input 2) is not a constant"
    return _float_reason(node.inputs[1], "weight") or _float_reason(node.inputs[0], "input") or (w, bias)


def _gemm(ctx: _Context, node: ir.Node, spec: ResolvedSpec) -> str | None:
    if layout.gemm_transposes(node)[0]:
        return "Gemm with transA=1 is not quantized dynamically"
    found = _weight_and_bias(node, "bias C")
    if isinstance(found, str):
        return found
    w, c = found
    w = np.asarray(layout.matrix_kn(node, w), dtype=np.float64)
    w = w * float(layout.attr(node, "alpha", 1.0))
    bias = _gemm_bias(c, layout.beta(node), w.shape[1])
    _emit_matrix(ctx, node, w, bias, spec)
    return None


def _conv_weight(w: np.ndarray, spec: ResolvedSpec) -> tuple[QuantizedTensor, str | None]:
    """Quantize a Conv weight; per-channel zero points must be equal for ConvInteger."""
    qt = _quantize(w, spec, axis=0)
    if np.asarray(_uniform(qt.zero_point)).ndim == 0:
        return qt, None
    note = "per-channel zero points differ (asymmetric); ConvInteger needs one: quantized per tensor"
    return quantize_weight(w, spec, None), note


def _conv(ctx: _Context, node: ir.Node, spec: ResolvedSpec) -> str | None:
    found = _weight_and_bias(node, "bias")
    if isinstance(found, str):
        return found
    w, bias = found
    qt, note = _conv_weight(w, spec)
    channel_shape = (-1,) + (1,) * (w.ndim - 2)  # broadcasts on the channel axis of the output
    scale = np.asarray(qt.scale).reshape(channel_shape) if np.ndim(qt.scale) else np.asarray(qt.scale)
    b = _Builder(ctx.editor, node.name)
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    y = _scaled_integer_op(b, node.inputs[0], "ConvInteger", qt, scale, attrs)
    _replace(ctx.graph, node, b, [_add_bias(b, y, None if bias is None else bias.reshape(channel_shape))])
    if note:
        ctx.report.notes[node.name] = note
    return None


def _lstm_weight(w: np.ndarray, spec: ResolvedSpec) -> tuple[QuantizedTensor, str | None]:
    """Quantize W or R [dirs, 4H, in] per direction, or per direction and gate unit.

    Returns data transposed to [dirs, in, 4H], as DynamicQuantizeLSTM expects, scales and
    zero points of shape [dirs] or [dirs, 4H], and a note when per-channel fell back to
    per-tensor: onnxruntime wants per-channel zero points all 0 (int8) or all equal (uint8).
    """
    dirs, rows, _ = w.shape
    note = None
    if spec.qscheme == "per_channel":
        qt = quantize_weight(w.reshape(dirs * rows, -1), spec, 0)
        zp = qt.zero_point.reshape(dirs, rows)
        if np.all(zp == (0 if spec.dtype == DType.INT8 else zp.flat[0])):
            data = qt.data.reshape(w.shape)
            return _lstm_tensor(data, qt.scale.reshape(dirs, rows), zp), None
        note = "per-channel zero points not all equal (asymmetric): quantized per tensor"
    parts = [quantize_weight(w[d], spec, None) for d in range(dirs)]
    data = np.stack([p.data for p in parts])
    scale = np.stack([np.asarray(p.scale).reshape(()) for p in parts])
    zp = np.stack([np.asarray(p.zero_point).reshape(()) for p in parts])
    return _lstm_tensor(data, scale, zp), note


def _lstm_tensor(data: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> QuantizedTensor:
    transposed = np.ascontiguousarray(data.transpose(0, 2, 1))
    return QuantizedTensor(transposed, scale.astype(np.float32), zp, None)


def _lstm(ctx: _Context, node: ir.Node, spec: ResolvedSpec) -> str | None:
    w, r = constant_array(_input(node, 1)), constant_array(_input(node, 2))
    if w is None or r is None:
        return "W or R is not a constant"
    if w.ndim != 3 or r.ndim != 3:
        return "W and R must have rank 3"
    if layout.attr(node, "layout", 0):
        return "LSTM layout=1 is not supported by DynamicQuantizeLSTM"
    if reason := _float_reason(node.inputs[1], "W") or _float_reason(node.inputs[0], "input"):
        return reason
    (qw, note_w), (qr, note_r) = _lstm_weight(w, spec), _lstm_weight(r, spec)
    b = _Builder(ctx.editor, node.name)
    extras = [b.const("W_quantized", qw.data), b.const("R_quantized", qr.data)]
    optional = [_input(node, i) for i in range(3, 8)]
    params = [b.const("W_scale", qw.scale), b.const("W_zero_point", qw.zero_point),
              b.const("R_scale", qr.scale), b.const("R_zero_point", qr.zero_point)]
    attrs = {name: attr.value for name, attr in node.attributes.items() if name != "layout"}
    outs = b.op("DynamicQuantizeLSTM", [node.inputs[0], *extras, *optional, *params], "out", attrs,
                n_out=len(node.outputs), domain=CONTRIB)
    _replace(ctx.graph, node, b, outs)
    if note_w or note_r:
        ctx.report.notes[node.name] = note_w or note_r
    return None


_EMITTERS: dict[str, Callable[[_Context, ir.Node, ResolvedSpec], str | None]] = {
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "LSTM": _lstm,
}


def emit_dynamic(model: ir.Model, nodes: Mapping[str, ResolvedSpec]) -> DynamicReport:
    """Quantize `nodes` (node name -> resolved weight spec) dynamically, in place.

    Nodes that cannot be quantized are left in float and listed in `skipped` with why.
    """
    graph = model.graph
    ctx = _Context(graph, GraphEditor(graph), DynamicReport())
    by_name = {node.name: node for node in graph}
    for name, spec in nodes.items():
        node = by_name.get(name)
        if node is None:
            ctx.report.skipped[name] = "no node of this name in the graph"
            continue
        emitter = _EMITTERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if emitter is None:
            ctx.report.skipped[name] = f"{node.op_type} is not quantized dynamically"
            continue
        reason = _spec_reason(spec) or emitter(ctx, node, spec)
        if reason:
            ctx.report.skipped[name] = reason
        else:
            ctx.report.quantized[name] = node.op_type
    if "LSTM" in ctx.report.quantized.values():
        model.opset_imports.setdefault(CONTRIB, 1)
    return ctx.report


@register_lowering("dynamic", order=10)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    report = emit_dynamic(model, nodes)
    return LoweringReport(report.skipped, notes=[f"dynamic {name}: {note}" for name, note in report.notes.items()])
