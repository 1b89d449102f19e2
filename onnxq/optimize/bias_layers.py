"""The layers bias correction corrects (a Conv/Gemm/MatMul with its bias, or the Add after
a MatMul) and the per-channel means of their inputs it solves from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.graph import layout
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import MAX_QUANTIZABLE_RANGE, is_float8, is_integer
from onnxq.optimize.context import AlgorithmContext
from onnxq.plan import Kind, QuantPlan, TensorPlan

if TYPE_CHECKING:  # the algorithm module imports this one
    from onnxq.optimize.bias_correction import BiasCorrectionConfig


@dataclass
class Layer:
    """One layer to correct: its node, weight plan, input and where its bias lives."""

    node: ir.Node
    weight: TensorPlan
    bias_node: ir.Node  # the node holding the bias: the layer itself or a MatMul's Add
    bias_index: int
    channel_axis: int  # channel axis of the input


def bias_add(node: ir.Node, channels: int) -> tuple[ir.Node, int] | None:
    """The Add of a constant [channels] vector that alone consumes a MatMul's output."""
    out = node.outputs[0]
    if out.is_graph_output() or len(out.uses()) != 1:
        return None
    add = out.uses()[0].node
    if add.op_type != "Add" or len(add.inputs) != 2:
        return None
    index = 1 - out.uses()[0].idx
    c = constant_array(add.inputs[index])
    if c is None or c.size != channels or c.shape[-1:] != (channels,):
        return None
    return add, index


def _shared(value: ir.Value | None) -> bool:
    return value is not None and len(value.uses()) > 1


def find_layers(graph: ir.Graph, plan: QuantPlan, opts: BiasCorrectionConfig) -> tuple[list[Layer], list[str]]:
    """The quantized layers whose bias can take a correction, and why others cannot."""
    layers, skipped = [], []
    for node in graph:
        if node.op_type not in opts.op_types or node.name not in plan.quantized_nodes or node.name in opts.skip_layers:
            continue
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        tensor = plan.tensors.get(weight.name) if weight is not None else None
        if tensor is None or tensor.kind is not Kind.WEIGHT:
            continue
        if not (is_integer(tensor.spec.dtype) or is_float8(tensor.spec.dtype)):
            skipped.append(f"{node.name} (weight type {tensor.spec.dtype} has no rounding to correct)")
            continue
        w = constant_array(weight)
        if _shared(weight) or (node.op_type == "MatMul" and w.ndim != 2):
            skipped.append(f"{node.name} (shared or batched weight)")
            continue
        if node.op_type == "MatMul":
            found = bias_add(node, layout.out_channels(node, w.shape))
            if found is None:
                skipped.append(f"{node.name} (MatMul without a bias Add)")
                continue
            bias_node, index = found
        else:
            bias_node, index = node, 2
        axis = layout.act_channel_axis(node, w.ndim)
        bias = bias_node.inputs[index] if index < len(bias_node.inputs) else None
        if bias is None and not opts.add_bias:
            skipped.append(f"{node.name} (no bias)")
            continue
        if _shared(bias) or (bias is not None and node.op_type != "MatMul" and constant_array(bias) is None):
            skipped.append(f"{node.name} (shared or non-constant bias)")
            continue
        if node.op_type == "Gemm" and bias is not None and constant_array(bias).ndim > 1:
            skipped.append(f"{node.name} (2-D Gemm C)")
            continue
        layers.append(Layer(node, tensor, bias_node, index, axis))
    return layers, skipped


@dataclass(frozen=True)
class InputMean:
    """E[x] of a layer input: per channel along each axis a layer reading it as a whole
    needs, and per geometry of the convolutions reading it whose padding or strides need
    them, the window means (`Statistic` "windows": [C, taps])."""

    channel: Mapping[int, np.ndarray] = field(default_factory=dict)
    windows: Mapping[layout.ConvGeometry, np.ndarray] = field(default_factory=dict)

    def channel_mean(self, axis: int) -> np.ndarray:
        return self.channel[axis]

    @property
    def usable(self) -> bool:
        """Finite and within `MAX_QUANTIZABLE_RANGE`: a masking value in the data (float
        min) drags a mean past it, and a correction from it would wreck the bias."""
        return all(bool(np.all(np.abs(a) <= MAX_QUANTIZABLE_RANGE))
                   for a in (*self.channel.values(), *self.windows.values()))


def conv_geometry(node: ir.Node) -> layout.ConvGeometry | None:
    """A Conv's geometry when its mean output needs window means: zero padding and strides
    make it differ from the kernel applied to channel means. None for other ops and for a
    1x1, stride-1, unpadded Conv (a pointwise layer), whose channel means are exact."""
    weight = node.inputs[1] if node.op_type == "Conv" and len(node.inputs) > 1 else None
    shape = weight.shape if weight is not None else None
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    geometry = layout.ConvGeometry.of(node, shape[2:])
    return None if geometry.pointwise else geometry


def requests(layers: list[Layer]) -> list[Statistic]:
    """The statistics bias correction needs: per-channel means of the inputs of layers that
    read them whole, and the window means of convolutions whose padding or strides need
    them, which are all such a convolution's mean output reads (its input's channel means
    too were one more pass over each image, 0.05 s of MobileNet-v1's 1.3 s calibration)."""
    stats = []
    for layer in layers:
        geometry = conv_geometry(layer.node)
        name = layer.node.inputs[0].name
        stats.append(Statistic(name, "mean", layer.channel_axis) if geometry is None
                     else Statistic(name, "windows", layer.channel_axis, geometry))
    return list(dict.fromkeys(stats))


def input_means(model: ir.Model, layers: list[Layer], ctx: AlgorithmContext) -> dict[str, InputMean]:
    """E[x] of every layer input: collected with calibration, or in one pass of its own."""
    stats = requests(layers)
    found = ctx.collect(model, stats, "bias correction")
    means = {name: means_of(name, stats, found) for name in dict.fromkeys(stat.tensor for stat in stats)}
    return {name: mean for name, mean in means.items() if mean is not None}


def means_of(name: str, stats: list[Statistic], found: Mapping[Statistic, np.ndarray | None]) -> InputMean | None:
    """The `InputMean` of tensor `name` from collected statistics (None if one is missing)."""
    mine = [st for st in stats if st.tensor == name and st.reduce in ("mean", "windows")]
    if not mine or any(found.get(st) is None for st in mine):
        return None
    return InputMean({st.axis: found[st] for st in mine if st.reduce == "mean"},
                     {st.window: found[st] for st in mine if st.reduce == "windows"})
