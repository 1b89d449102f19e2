"""Empirical bias correction (Nagel et al., "Data-Free Quantization", ICCV 2019, sec. 4.2).

Rounding weights shifts the mean of every output channel: E[y_q - y] = (W_q - W) E[x].
This algorithm runs after calibration, quantizes each weight exactly as the emitter will
(same spec, axis and bias-safe scale floor), measures E[x] of the layer's input on the
calibration data (collected in the calibration pass: per-channel sums inside onnxruntime) and subtracts the expected
error from the bias.

- Gemm / MatMul: the error is (W_q - W) applied to the per-channel mean of the input.
- Conv: the error is conv(E[x], W_q - W) averaged over output positions: the weight error
  times, per channel and kernel tap, the mean of the zero-padded input values the tap
  reads (window means, summed inside onnxruntime with calibration), so padding and
  strides are accounted for exactly; a 1x1, stride-1, unpadded Conv needs channel means
  alone.
- Bias: Conv and Gemm without one get one (int32, like the model's other biases);
  a MatMul is corrected through the Add of a constant [N] vector that alone consumes
  its output, and skipped without one (adding an Add would add a quantized op).
- Layers whose weight or bias initializer is shared with other nodes are skipped, and so
  are layers whose bias AdaRound/AdaQuant fitted (`bias: true`): their bias already
  corrects the mean output error against the quantized model's own inputs, and a second
  correction from float inputs undoes that (MobileNet-v1 per-tensor int8: 85.25 -> 60.9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import QuantizationSpec
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor, set_constant
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import dequantize, is_float8, is_integer
from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize import PassContext, register_algorithm, statistics_of
from onnxq.plan import Kind, QuantPlan, TensorPlan
from onnxq.plan.params import WeightCache, biases_by_weight, emitted_weight

OP_TYPES = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class BiasCorrectionConfig:
    """Options of the `bias_correction` algorithm.

    op_types: layer types to correct. skip_layers: node names left alone.
    add_bias: give Conv/Gemm layers without a bias one to hold the correction.
    empirical: after the correction from float inputs, set each bias, layer by layer in
      graph order, so that the layer's mean output over its inputs in the quantized model
      (as emitted, the layers before it corrected) equals the float layer's (Nagel et
      al.'s empirical correction): it also removes the mean shift that upstream rounding
      and clipping carry through nonlinearities. One pass over the calibration data per
      layer.
    """

    ALGORITHM: ClassVar[str] = "bias_correction"

    op_types: tuple[str, ...] = OP_TYPES
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    add_bias: bool = True
    empirical: bool = False


@dataclass
class Layer:
    """One layer to correct: its node, weight plan, input and where its bias lives."""

    node: ir.Node
    weight: TensorPlan
    bias_node: ir.Node  # the node holding the bias: the layer itself or a MatMul's Add
    bias_index: int
    channel_axis: int  # channel axis of the input


def _bias_add(node: ir.Node, channels: int) -> tuple[ir.Node, int] | None:
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
            found = _bias_add(node, layout.out_channels(node, w.shape))
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
    """E[x] of a layer input: per channel along each requested axis, and per geometry of
    the convolutions reading it whose padding or strides need them, the window means
    (`Statistic` "windows": [C, taps])."""

    channel: Mapping[int, np.ndarray]
    windows: Mapping[layout.ConvGeometry, np.ndarray] = field(default_factory=dict)

    def channel_mean(self, axis: int) -> np.ndarray:
        return self.channel[axis]


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
    """The statistics bias correction needs: per-channel means of every layer input, and the
    window means of convolutions whose padding or strides need them."""
    stats = [Statistic(layer.node.inputs[0].name, "mean", layer.channel_axis) for layer in layers]
    for layer in layers:
        geometry = conv_geometry(layer.node)
        if geometry is not None:
            stats.append(Statistic(layer.node.inputs[0].name, "windows", layer.channel_axis, geometry))
    return list(dict.fromkeys(stats))


def input_means(model: ir.Model, layers: list[Layer], ctx: PassContext) -> dict[str, InputMean]:
    """E[x] of every layer input: collected with calibration, or in one pass of its own."""
    stats = requests(layers)
    found = ctx.collect(model, stats, "bias correction")
    means = {name: _means_of(name, stats, found) for name in dict.fromkeys(stat.tensor for stat in stats)}
    return {name: mean for name, mean in means.items() if mean is not None}


def _means_of(name: str, stats: list[Statistic], found: Mapping[Statistic, np.ndarray | None]) -> InputMean | None:
    """The `InputMean` of tensor `name` from collected statistics (None if one is missing)."""
    channel = {st.axis: found.get(st) for st in stats if st.tensor == name and st.reduce == "mean"}
    if not channel or any(v is None for v in channel.values()):
        return None
    windows = {st.window: found[st] for st in stats
               if st.tensor == name and st.reduce == "windows" and found.get(st) is not None}
    return InputMean(channel, windows)


@statistics_of("bias_correction")
def bias_correction_requests(model: ir.Model, plan: QuantPlan, opts: BiasCorrectionConfig) -> list[Statistic]:
    """Requested before calibration, so the calibration pass collects them too."""
    layers, _ = find_layers(model.graph, plan, opts)
    return requests(layers)


def output_error(layer: Layer, eps: np.ndarray, mean: InputMean) -> np.ndarray:
    """E[(W_q - W) x] per output channel (before any Gemm beta)."""
    node = layer.node
    geometry = conv_geometry(node)
    windows = mean.windows.get(geometry) if geometry is not None else None
    if windows is not None:  # sum over channels and taps of weight error x window mean
        g, m = layout.groups(node), eps.shape[0]
        per_group = eps.reshape(g, m // g, eps.shape[1], -1)
        return np.einsum("gmct,gct->gm", per_group, windows.reshape(g, eps.shape[1], -1)).reshape(m)
    err = layout.apply_to_input(node, eps, mean.channel_mean(layer.channel_axis))
    return float(layout.attr(node, "alpha", 1.0)) * err if node.op_type == "Gemm" else err


class _Emission:
    """How emission will quantize each weight (shared with the emitter: `plan.params`)."""

    def __init__(self, model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
                 weights: WeightCache) -> None:
        self.plan = plan
        self.ranges = ranges
        self.initializers = model.graph.initializers
        self.bias_of = biases_by_weight(plan)
        self.weights = weights
        self.dequantized: dict[str, tuple[QuantizedTensor, np.ndarray]] = {}  # weight -> (unfloored, as float)

    def constant_of(self, name: str) -> np.ndarray | None:
        return constant_array(self.initializers.get(name))

    def dequantized_weight(self, tensor: TensorPlan, weight: ir.Value, bias_plan: TensorPlan | None,
                           bias: np.ndarray) -> np.ndarray:
        """W_q as float, given the bias the layer will have (it floors the weight scale)."""
        usable = bias_plan is not None and bias_plan.bias_inputs[0] in self.plan.tensors
        plain = self.weights.unfloored(tensor, weight)
        qt = emitted_weight(self.plan, self.ranges, self.constant_of, tensor,
                            bias_plan if usable else None, bias, plain)
        if qt is not plain:  # the bias floors this weight's scale
            return _dequantized(qt)
        cached = self.dequantized.get(tensor.name)
        if cached is None or cached[0] is not plain:
            cached = self.dequantized[tensor.name] = plain, _dequantized(plain)
        return cached[1]


def _dequantized(qt: QuantizedTensor) -> np.ndarray:
    return dequantize(qt.data, qt.scale, qt.zero_point, qt.axis, qt.block_size).astype(np.float64)


def _bias_spec(plan: QuantPlan) -> ResolvedSpec | None:
    """How to quantize added biases: like the model's biases (the int32 default if it has none).

    The plan does not record each node's config, so an added bias cannot know whether its
    node was meant to keep a float bias; when the model's biases disagree, it stays float.
    """
    specs = {t.spec for t in plan.tensors.values() if t.kind is Kind.BIAS}
    if not specs:
        return merge_specs([QuantizationSpec()], "bias")
    return specs.pop() if len(specs) == 1 else None


def _new_bias_plan(plan: QuantPlan, layer: Layer, spec: ResolvedSpec | None) -> TensorPlan | None:
    """How a bias added to a Conv/Gemm is quantized: like the model's other biases."""
    act, weight = layer.node.inputs[0], layer.node.inputs[1]
    if spec is None or act.name not in plan.tensors or plan.tensors[act.name].kind is not Kind.ACTIVATION:
        return None
    return TensorPlan("", Kind.BIAS, spec, bias_inputs=(act.name, weight.name), consumers=((layer.node.name, 2),))


def _bias_array(layer: Layer) -> np.ndarray | None:
    """The layer's bias initializer as stored (None: it has none)."""
    inputs = layer.bias_node.inputs
    value = inputs[layer.bias_index] if layer.bias_index < len(inputs) else None
    return constant_array(value) if value is not None else None


def float_bias(layer: Layer) -> np.ndarray:
    """The bias the layer adds now, one value per output channel (zeros without one)."""
    old = _bias_array(layer)
    channels = layout.out_channels(layer.node, constant_array(layer.node.inputs[1]).shape)
    if old is None:
        return np.zeros(channels)
    return np.broadcast_to(old.astype(np.float64).reshape(-1), (channels,)).copy()


ErrorFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (W_q, W) -> mean output error per channel


def correct(model: ir.Model, plan: QuantPlan, layer: Layer, error: ErrorFn, emission: _Emission,
            bias_spec: ResolvedSpec | None, base: np.ndarray | None = None) -> QuantPlan | None:
    """Set the layer's bias to `base` (default: its bias now) less its mean output error
    `error(W_q, W)`: the plan with the bias planned (a new one is added to it), or None
    if nothing changed."""
    node = layer.node
    w = constant_array(node.inputs[1])
    channels = layout.out_channels(node, w.shape)
    old = _bias_array(layer)
    bias_plan = _new_bias_plan(plan, layer, bias_spec) if old is None else emission.bias_of.get(layer.weight.name)
    beta = layout.beta(node)  # an added C is scaled by beta too
    now = float_bias(layer)
    bias = base = now if base is None else base
    for _ in range(3):  # the weight scale floor depends on the bias: let it settle
        wq = emission.dequantized_weight(layer.weight, node.inputs[1], bias_plan, bias)
        new = base - error(wq, w.astype(np.float64)) / beta
        settled = np.array_equal(new, bias)
        bias = new
        if settled:
            break
    if np.array_equal(bias, now):
        return None
    if old is None:
        value = GraphEditor(model.graph).initializer(f"{node.name}_bias", bias.astype(w.dtype))
        node.resize_inputs(3)
        node.replace_input_with(2, value)
        if bias_plan is not None:
            plan = plan.with_tensor(dataclasses.replace(bias_plan, name=value.name,
                                                                 axis=0 if channels > 1 else None))
    else:
        shape = old.shape if old.size == channels else (channels,)
        set_constant(model.graph, layer.bias_node, layer.bias_index, bias.reshape(shape).astype(old.dtype),
                     f"{node.name}_bias")
    return plan


@register_algorithm("bias_correction", options=BiasCorrectionConfig, data="required", rewrites=("biases",))
def bias_correction(
    model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
    opts: BiasCorrectionConfig, ctx: PassContext,
) -> str | tuple[str, QuantPlan]:
    """Remove the mean output error that weight rounding causes (see module doc)."""
    layers, skipped = find_layers(model.graph, plan, opts)
    fitted = [x for x in layers if x.node.name in ctx.fitted_biases]
    layers = [x for x in layers if x.node.name not in ctx.fitted_biases]
    if fitted and not layers and not skipped:
        by = sorted({ctx.fitted_biases[x.node.name] for x in fitted})
        return f"nothing to correct: the biases of all {len(fitted)} layers were fitted by {' and '.join(by)}"
    skipped += [f"{x.node.name} (bias fitted by {ctx.fitted_biases[x.node.name]})" for x in fitted]
    if not layers:
        dynamic = plan.nodes_for("dynamic")
        why = (f" ({len(dynamic)} quantized dynamically: their activations' grid is set at run time, and "
               "their kernels take no separate bias)" if dynamic else "")
        return "no statically quantized layer to correct" + why + (
            f"; skipped {', '.join(skipped[:5])}" if skipped else "")
    means = input_means(model, layers, ctx)
    emission = _Emission(model, plan, ranges, ctx.weights)
    bias_spec = _bias_spec(plan)
    added = sum(1 for layer in layers if layer.bias_index >= len(layer.bias_node.inputs)
                or layer.bias_node.inputs[layer.bias_index] is None)
    base = {layer.node.name: float_bias(layer) for layer in layers}
    corrected = set()
    for layer in layers:
        mean = means.get(layer.node.inputs[0].name)
        if mean is None:
            continue
        new_plan = correct(model, plan, layer, _analytic(layer, mean), emission, bias_spec)
        if new_plan is not None:
            plan = new_plan
            corrected.add(layer.node.name)
    note = f"{len(corrected)} of {len(layers)} biases corrected"
    if added:
        note += f" ({added} added)"
    if opts.empirical and corrected:
        plan, extra = _empirical(model, plan, ranges, [x for x in layers if x.node.name in corrected], means,
                                 base, ctx, bias_spec)
        note += extra
    if skipped:
        note += f"; {len(skipped)} skipped: {', '.join(skipped[:3])}" + (" ..." if len(skipped) > 3 else "")
    return note, plan


def _analytic(layer: Layer, mean: InputMean) -> ErrorFn:
    """E[(W_q - W) x] over the float inputs."""
    return lambda wq, w: output_error(layer, wq - w, mean)


def _empirical_error(layer: Layer, float_mean: InputMean, quant_mean: InputMean) -> ErrorFn:
    """E[W_q x_q] - E[W x]: the quantized layer's mean output over its quantized inputs
    against the float layer's over float inputs (biases aside)."""
    return lambda wq, w: output_error(layer, wq, quant_mean) - output_error(layer, w, float_mean)


def _empirical(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], layers: list[Layer],
               float_means: Mapping[str, InputMean], base: Mapping[str, np.ndarray], ctx: PassContext,
               bias_spec: ResolvedSpec | None) -> tuple[QuantPlan, str]:
    """Empirical correction, one layer at a time in graph order: emit the model as it is
    (the layers before already corrected), measure the layer's quantized input means in a
    pass over the data, and re-solve its bias from its original value. Sequential on
    purpose: correcting every layer from one measurement counts each upstream shift twice
    (once in the upstream bias, once downstream), and on MobileNet v1 that compounded
    through the depth to 2 dB of output SQNR. Re-emitting per layer (rather than replaying
    one emitted graph, as AdaRound does) keeps every emission layout right by construction
    and streams the data: MobileNet v1 18.6 s and 420 MB peak, against 9.0 s and 889 MB
    replayed."""
    from onnxq.emit.trial import emit_trial  # emission imports the optimisers' registry

    if ctx.data is None or ctx.data.source is None:
        return plan, "; not empirical: it runs the quantized model on the calibration data, and there is none"
    if not ctx.data.replayable:
        return plan, ("; not empirical: the calibration data can be read only once (pass a path, a dict of "
                      "arrays, a list of feeds or a reader with rewind())")
    done = 0
    for layer in layers:
        fmean = float_means.get(layer.node.inputs[0].name)
        if fmean is None:
            continue
        emitted = model.clone()
        emit_trial(emitted, plan, ranges, weights=ctx.weights, qdq_domain=ctx.qdq_domain, extended=ctx.extended,
                   statistics=ctx.emission_statistics)
        twin = next((n for n in emitted.graph if n.name == layer.node.name), None)
        if twin is None:
            continue
        stats = requests([dataclasses.replace(layer, node=twin)])
        name = twin.inputs[0].name
        _prefix(emitted, twin.inputs[0])  # the layer itself goes too
        found = collect(emitted, stats, ctx.data, ctx.calibration, False, "bias correction (empirical)")
        quant = _means_of(name, stats, found)
        if quant is None:
            continue
        emission = _Emission(model, plan, ranges, ctx.weights)
        new_plan = correct(model, plan, layer, _empirical_error(layer, fmean, quant), emission, bias_spec,
                           base[layer.node.name])
        plan = new_plan if new_plan is not None else plan
        done += 1
    return plan, f"; {done} empirical (on the quantized model's own inputs, layer by layer)"


def _prefix(model: ir.Model, value: ir.Value) -> None:
    """Cut `model` down to the nodes `value` needs, with `value` its only output (each
    layer's pass then runs the model up to that layer, not the whole of it)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    if value.is_graph_input():
        return
    model.graph.outputs.clear()
    model.graph.outputs.append(value)
    RemoveUnusedNodesPass()(model)
