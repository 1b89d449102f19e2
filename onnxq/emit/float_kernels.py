"""Keep float the Conv/ConvTranspose/Gemm that the plan leaves float next to quantized ops.

onnxruntime's `WeightBiasQuantization` (qdq_transformer/weight_bias_quantization.cc,
level 1: every default session) rewrites a Conv, ConvTranspose or Gemm whose input 0
comes from a DequantizeLinear with a per-tensor scale, whose weight is a float
initializer and whose output leads to a QuantizeLinear (through Relu/Clip at most, in
onnxruntime 1.32): it quantizes the weight to int8 per tensor and the bias to int32, and
the QDQ fusion then runs the node as an int8 kernel. A node onnxq keeps float (excluded by
the user, raised to float by an accuracy search, kept by the latency plan) would run
quantized per tensor instead. Measured: MobileNet-v1 with its 13 depthwise convolutions
excluded gave 0.5 dB output SQNR in a default session (their per-tensor weights), 23.4 dB
with them quantized per channel, and 23.6 dB (float, as asked) with this rewrite.

The same rule rewrites the float bias of a node whose weight is quantized (a
DequantizeLinear) as Cast<int32>(Round(b / (x_scale * w_scale))), without a range check.
onnxq leaves a bias float only where that int32 would overflow (`qdq.quantize_bias`), so
onnxruntime's rewrite wraps it: an A16W8 Conv reading values of about 1e-4 (input scale
2e-9, weight scale 5e-4, bias 0.06) gave 0.0 dB output SQNR in a default session, its
bias garbage. Such a node is guarded the same way and runs as written: DequantizeLinear
inputs, float bias (that model, a YOLO-like random-weight detector: 54.7 -> 115.8 dB; 8-bit
activations: 83.8).

The rule fires only for a per-tensor input scale (a scalar or a single value), so every
such float node (whatever its output leads to: onnxruntime's own condition on it has
changed between versions) reads its input through a DequantizeLinear of its own whose
scale and zero point are per channel, every channel the same value: the same arithmetic,
a pattern the rule skips. Float8 and 4-bit inputs are left as they are (`float8.py` keeps
float8 exact; onnxq writes no 4-bit activations); a node whose input has one channel
cannot be written this way (a one-value scale counts as per tensor) and is named in the
note.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array

REWRITTEN_OPS = ("Conv", "ConvTranspose", "Gemm")
# Zero-point types of the integer Q/DQ the rule is guarded against here.
INTEGER_POINTS = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32)


@dataclass
class FloatKernels:
    """The nodes given a per-channel DequantizeLinear, and those that could not be."""

    guarded: list[str] = field(default_factory=list)
    exposed: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        if not self.exposed:
            return None
        return (f"{len(self.exposed)} Conv/Gemm with a float weight or bias read a one-channel quantized input, "
                "which onnxruntime's default session rewrites (per-tensor int8 weights, an int32 bias): "
                f"{', '.join(self.exposed[:5])}")


def _input_channels(node: ir.Node, weight: tuple[int, ...]) -> tuple[int, int] | None:
    """(axis, channels) of input 0 that a per-channel scale runs along, for a weight of
    shape `weight`."""
    if node.op_type == "Conv":
        group = node.attributes.get("group")
        return 1, weight[1] * (group.as_int() if group is not None else 1)
    if node.op_type == "ConvTranspose":
        return 1, weight[0]
    if len(weight) != 2:
        return None
    trans_a, trans_b = (node.attributes.get(a) for a in ("transA", "transB"))
    k = weight[1] if trans_b is not None and trans_b.as_int() else weight[0]
    return (0 if trans_a is not None and trans_a.as_int() else 1), k


def _rewritten_weight(node: ir.Node) -> tuple[int, ...] | None:
    """The weight's shape where the rule would rewrite the node given a per-tensor
    input: a float32 weight initializer, or a quantized weight beside a float32 bias
    initializer (module doc); else None."""
    weight = constant_array(node.inputs[1])
    if weight is not None:
        return weight.shape if weight.dtype == np.float32 else None
    dq = node.inputs[1].producer() if node.inputs[1] is not None else None
    if dq is None or dq.op_type != "DequantizeLinear" or len(node.inputs) < 3:
        return None
    bias = constant_array(node.inputs[2])
    codes = constant_array(dq.inputs[0])
    if bias is None or bias.dtype != np.float32 or codes is None:
        return None
    return codes.shape


def _per_tensor_dq(value: ir.Value) -> tuple[ir.Node, np.ndarray, np.ndarray | None] | None:
    """The DequantizeLinear producing `value`, with its scale and zero point (None where
    it has none), where the scale is per tensor and the data an integer type."""
    dq = value.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.inputs) < 2 or dq.inputs[0] is None:
        return None
    scale = constant_array(dq.inputs[1])
    zero = constant_array(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else None
    # The data type, from the zero point where the value carries none (uint8 without either).
    data = dq.inputs[0].dtype.numpy().type if dq.inputs[0].dtype is not None else \
        (zero.dtype.type if zero is not None else np.uint8)
    if scale is None or scale.size != 1 or data not in INTEGER_POINTS:
        return None
    return dq, scale, zero


def keep_float_kernels(model: ir.Model) -> FloatKernels:
    """Give every Conv/ConvTranspose/Gemm with a float weight or a float bias that reads a
    per-tensor DequantizeLinear a per-channel one of its own (module doc), in place."""
    found = FloatKernels()
    edit = GraphEditor(model.graph)
    for node in list(model.graph):
        if node.op_type not in REWRITTEN_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        source = _per_tensor_dq(node.inputs[0]) if node.inputs[0] is not None else None
        weight = _rewritten_weight(node) if source is not None else None
        if weight is None or source is None:
            continue
        dq, scale, zero = source
        channels = _input_channels(node, weight)
        if channels is None or channels[1] <= 1:
            found.exposed.append(node.name)
            continue
        axis, n = channels
        base = f"{node.name}_input"
        inputs = [dq.inputs[0], edit.initializer(f"{base}_scale", np.full(n, scale.item(), scale.dtype))]
        if zero is not None:
            inputs.append(edit.initializer(f"{base}_zero_point", np.full(n, zero.item(), zero.dtype)))
        attrs = {k: a for k, a in dq.attributes.items() if k not in ("axis", "block_size")}
        out = edit.add_node("DequantizeLinear", inputs, f"{base}_dq", {**attrs, "axis": axis},
                            dtype=ir.DataType.from_numpy(scale.dtype), shape=node.inputs[0].shape,
                            domain=dq.domain)
        node.replace_input_with(0, out)
        found.guarded.append(node.name)
        if not dq.outputs[0].uses() and not dq.outputs[0].is_graph_output():
            model.graph.remove(dq, safe=True)  # every reader has its own now
    if found.guarded:
        model.graph.sort()
    return found
