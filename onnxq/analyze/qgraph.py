"""Read a quantized model's structure: which activations pass through Q/DQ and with what
parameters, and which nodes compute on dequantized inputs (the layers).

Works on any QDQ model (onnxq's or another tool's): it looks only at QuantizeLinear /
DequantizeLinear nodes and their constant scale and zero point, and at onnxq's extended
ops (`--format qdq-ext`): an `OnnxqQuantizeDequantize` is a Q/DQ pair in one node, with
its grid in attributes; an `OnnxqBlockQuantizeDequantize` fake-quantizes in blocks (its
readers are layers; it has no per-tensor grid to list).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.graph.fold import constant_array
from onnxq.graph.quantized import EXTENDED_DOMAIN, EXTENDED_OPS
from onnxq.numerics.qmath import FLOAT8_TYPES, INT_TYPES

QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
# Ops the emitters put between a float tensor and the node reading it.
GLUE_OPS = QDQ_OPS | {"Cast"}



@dataclass(frozen=True)
class QuantizedActivation:
    """An activation `name` quantized by `q_node` and read back as `dequantized`."""

    name: str
    dequantized: str
    dtype: str
    low: float  # the smallest value the grid represents (the calibrated range)
    high: float
    # When a Relu or Clip alone reads the dequantized tensor (float8 layouts put it after
    # the DQ), the bounds it clips to: error and clipping count after it (`bounded`), since
    # values beyond them never reach the model.
    bounds: tuple[float, float] | None = None
    # the grid's step where it is uniform (integer types): a value within half a step past
    # an end rounds to it with no more error than any value inside
    step: float | None = None


@dataclass(frozen=True)
class Layer:
    """A node that computes on at least one dequantized input."""

    name: str
    op_type: str
    output: str  # the node's float output as the float model names it
    quantized_output: str | None  # what consumers read when the output is Q/DQ'd
    # The bounds of a Relu/Clip that alone reads the quantized output (as for activations)
    bounds: tuple[float, float] | None = None


def bounded(x: np.ndarray, bounds: tuple[float, float] | None) -> np.ndarray:
    """`x` as the Relu/Clip with `bounds` passes it on (unchanged without one)."""
    return x if bounds is None else np.clip(x, *bounds)


def _grid(zero_point: np.ndarray, scale: float) -> tuple[float, float] | None:
    """The real range a per-tensor (scale, zero point) represents (`numerics.qmath` types)."""
    kind = zero_point.dtype.type
    zp = float(zero_point.reshape(-1)[0])
    for f8 in FLOAT8_TYPES.values():
        if kind is f8.np_dtype:
            return -f8.max_value * scale, f8.max_value * scale
    for info in INT_TYPES.values():
        if kind is info.np_dtype:
            return (info.qmin - zp) * scale, (info.qmax - zp) * scale
    return None


def dequantizer(q: ir.Node) -> ir.Node | None:
    """The DequantizeLinear reading QuantizeLinear `q`'s output, if any."""
    return next((u.node for u in q.outputs[0].uses() if u.node.op_type == "DequantizeLinear"), None)


def _centring(q: ir.Node) -> ir.Node | None:
    """The Sub of a constant per-channel offset before QuantizeLinear `q` whose DQ's only
    reader adds the same offset back (float8 centring, `emit/float8_center.py`), if there
    is one; a model's own Sub before a Q is not one."""
    sub = q.inputs[0].producer() if q.inputs[0] is not None else None
    if sub is None or sub.op_type != "Sub" or len(sub.inputs) != 2 or constant_array(sub.inputs[1]) is None:
        return None
    dq = dequantizer(q)
    readers = list(dq.outputs[0].uses()) if dq is not None else []
    restores = (len(readers) == 1 and readers[0].node.op_type == "Add"
                and list(readers[0].node.inputs) == [dq.outputs[0], sub.inputs[1]])
    return sub if restores else None


def is_extended(node: ir.Node | None, index: int | None = None) -> bool:
    """One of onnxq's extended Q/DQ ops (`EXTENDED_OPS[index]` only, when given)."""
    ops = EXTENDED_OPS if index is None else EXTENDED_OPS[index:index + 1]
    return node is not None and node.domain == EXTENDED_DOMAIN and node.op_type in ops


def is_glue(node: ir.Node | None) -> bool:
    """Q/DQ glue: QuantizeLinear, DequantizeLinear, Cast, onnxq's extended Q/DQ ops, and a
    float8 centring's Sub before a Q or Add after a DQ of the same per-channel offset."""
    if node is None:
        return False
    if node.op_type in GLUE_OPS or is_extended(node):
        return True
    if node.op_type == "Sub" and node.outputs:
        return any(_centring(u.node) is node for u in node.outputs[0].uses() if u.node.op_type == "QuantizeLinear")
    if node.op_type == "Add" and len(node.inputs) == 2 and node.inputs[0] is not None:
        dq = node.inputs[0].producer()
        q = dq.inputs[0].producer() if dq is not None and dq.op_type == "DequantizeLinear" else None
        sub = _centring(q) if q is not None and q.op_type == "QuantizeLinear" else None
        return sub is not None and sub.inputs[1] is node.inputs[1]
    return False


def _restored(dq: ir.Node, offset: ir.Value | None) -> ir.Value:
    """What readers of `dq` get: its output, or the Add putting a centring `offset` back."""
    out = dq.outputs[0]
    uses = list(out.uses())
    if offset is not None and len(uses) == 1 and uses[0].node.op_type == "Add" and offset in uses[0].node.inputs:
        return uses[0].node.outputs[0]
    return out


def _activation(q: ir.Node) -> QuantizedActivation | None:
    """The activation quantized by QuantizeLinear `q`, if it is per-tensor and read back by a
    DQ (through a float8 centring's Sub and Add, when there is one)."""
    sub = _centring(q)
    value = sub.inputs[0] if sub is not None else q.inputs[0]
    if value is None or constant_array(value) is not None or len(q.inputs) < 3:
        return None
    scale, zp = constant_array(q.inputs[1]), constant_array(q.inputs[2])
    if scale is None or zp is None or scale.size != 1:
        return None
    dq = dequantizer(q)
    grid = _grid(zp, float(scale.reshape(-1)[0]))
    if dq is None or grid is None or not value.name:
        return None
    seen = _restored(dq, sub.inputs[1] if sub is not None else None)
    if sub is not None:  # the grid is around each channel's offset: its real range varies by channel
        offset = constant_array(sub.inputs[1])
        grid = (grid[0] + float(offset.min()), grid[1] + float(offset.max()))
    step = float(scale.reshape(-1)[0]) if zp.dtype.kind in "iu" else None  # float8's grid is not uniform
    return QuantizedActivation(value.name, seen.name, str(zp.dtype), *grid, _bounds(seen), step)


def _bounds(value: ir.Value) -> tuple[float, float] | None:
    """The range the Relu/Clip that alone reads `value` clips to, if one does."""
    uses = list(value.uses())
    if len(uses) != 1 or uses[0].node.op_type not in ("Relu", "Clip"):
        return None
    node = uses[0].node
    return (0.0, float("inf")) if node.op_type == "Relu" else layout.clip_bounds(node)


def _extended_activation(node: ir.Node) -> QuantizedActivation | None:
    """The activation an `OnnxqQuantizeDequantize` quantizes and reads back in one node:
    its grid [qmin - zp, qmax - zp] * scale, from its attributes and constant inputs."""
    value = node.inputs[0] if node.inputs else None
    scale = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    zero = constant_array(node.inputs[2]) if len(node.inputs) > 2 else None
    qmin, qmax = node.attributes.get("qmin"), node.attributes.get("qmax")
    if value is None or not value.name or scale is None or scale.size != 1 or zero is None or qmin is None \
            or qmax is None or constant_array(value) is not None:
        return None
    s, z = float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0])
    grid = ((qmin.as_int() - z) * s, (qmax.as_int() - z) * s)
    return QuantizedActivation(value.name, node.outputs[0].name, f"int[{qmin.as_int()}, {qmax.as_int()}]", *grid,
                               _bounds(node.outputs[0]), s)


def quantized_activations(model: ir.Model) -> list[QuantizedActivation]:
    """Every per-tensor quantized activation of `model`, in graph order."""
    found = []
    for node in model.graph:
        if node.op_type == "QuantizeLinear":
            act = _activation(node)
        elif is_extended(node, 0):
            act = _extended_activation(node)
        else:
            continue
        if act is not None:
            found.append(act)
    return found


def _reads_dequantized(node: ir.Node) -> bool:
    return any(v is not None and v.producer() is not None and (
        v.producer().op_type == "DequantizeLinear" or is_extended(v.producer())
        or (v.producer().op_type == "Add" and is_glue(v.producer())))
        for v in node.inputs)


def _dequantizer(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear or extended Q/DQ op that produces `value`, if one does."""
    node = value.producer() if value is not None else None
    return node if node is not None and (node.op_type == "DequantizeLinear" or is_extended(node)) else None


def _quantized_after_activation(value: ir.Value) -> bool:
    """Whether `value`'s lone reader is a Relu/Clip whose output is quantized: a residual Add
    before its Relu under S8S8, A16W8 or XINT8 (no Relu absorbed there)."""
    uses = list(value.uses())
    return len(uses) == 1 and uses[0].node.op_type in ("Relu", "Clip") and bool(uses[0].node.outputs) \
        and _dequantized_output(uses[0].node.outputs[0]) is not None


def _reads_stored(node: ir.Node) -> bool:
    """Whether `node` reads a stored quantized tensor (a weight, a table) through a
    DequantizeLinear of a constant, or of a QuantizeLinear of one (another tool's QDQ
    weights): a weight-only layer, or an integer kernel whose output stays float."""
    def constant(value: ir.Value | None) -> bool:
        return value is not None and (value.const_value is not None or value.is_initializer())

    for v in node.inputs:
        dq = _dequantizer(v)
        if dq is None or not dq.inputs:
            continue
        source = dq.inputs[0]
        q = source.producer() if source is not None else None
        if constant(source) or (q is not None and q.op_type == "QuantizeLinear" and constant(q.inputs[0])):
            return True
    return False


# Ops whose integer kernel may write a float output (onnxruntime fuses MatMul with
# dequantized inputs into MatMulIntegerToFloat, Gemm into QGemm): quantized without a
# QuantizeLinear after them where every input they compute on is dequantized.
FLOAT_WRITING = ("MatMul", "Gemm")


def _float_writing_kernel(node: ir.Node) -> bool:
    """Whether `node` is a MatMul/Gemm on dequantized inputs only (its bias aside)."""
    computed = node.inputs[:2]
    return node.op_type in FLOAT_WRITING and len(computed) == 2 and all(_dequantizer(v) is not None for v in computed)


def _dequantized_output(value: ir.Value) -> ir.Value | None:
    """The DQ output consumers read when `value` is quantized right after it is computed."""
    for use in value.uses():
        if is_extended(use.node, 0):
            return use.node.outputs[0]
        q = use.node
        if q.op_type == "Sub" and len(q.outputs[0].uses()) == 1:  # float8 centring (checked below)
            after = next(iter(q.outputs[0].uses())).node
            q = after if after.op_type == "QuantizeLinear" and _centring(after) is q else q
        if q.op_type == "QuantizeLinear":
            dq = dequantizer(q)
            if dq is not None:
                sub = _centring(q)
                return _restored(dq, sub.inputs[1] if sub is not None else None)
    return None


def bias_add(node: ir.Node) -> ir.Node | None:
    """The Add of a constant that alone reads `node`'s output: a bias the float8 layout
    moved out of its Conv/Gemm (the layer is measured with it, whose output keeps the
    float model's name)."""
    if node.op_type not in ("Conv", "Gemm") or not node.outputs:
        return None
    uses = list(node.outputs[0].uses())
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return None
    add = uses[0].node
    other = [v for v in add.inputs if v is not node.outputs[0]]
    return add if len(other) == 1 and other[0] is not None and constant_array(other[0]) is not None else None


def layers(model: ir.Model) -> list[Layer]:
    """The nodes that compute on dequantized inputs and are quantized themselves, in graph
    order: their output quantized (directly, or through the lone Relu/Clip after them), a
    stored quantized tensor read, a MatMul/Gemm on dequantized inputs (an integer kernel
    writing float), or onnxq's extended ops read (block formats store the weight rounded
    and write a float output). A float node that only reads its neighbours' dequantized
    outputs was listed and ranked, and keeping it float changed nothing (MiniLM's GELU
    Divs, trust trial)."""
    found = []
    for node in model.graph:
        if is_glue(node) or not node.outputs or not _reads_dequantized(node):
            continue
        add = bias_add(node)
        out = (add or node).outputs[0]
        if not out.name:
            continue
        dq = _dequantized_output(out)
        if dq is None and not _quantized_after_activation(out) and not _reads_stored(node) \
                and not _float_writing_kernel(node) and not any(is_extended(_dequantizer(v)) for v in node.inputs):
            continue  # a float node that only reads its quantized neighbours' outputs (a GELU's Div)
        found.append(Layer(node.name, node.op_type, out.name, dq.name if dq is not None else None,
                           _bounds(dq) if dq is not None else None))
    return found
