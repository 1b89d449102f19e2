"""One layer's corrected bias: the mean output error of its weights as emission will
quantize them, removed from its bias, the new bias planned as emission will store it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import QuantizationSpec
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor, set_constant
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import dequantize
from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize.bias_layers import InputMean, Layer, conv_geometry
from onnxq.plan import Kind, QuantPlan, TensorPlan
from onnxq.plan.params import WeightCache, biases_by_weight, emitted_weight


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


class Emission:
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
        """W_q in float32, given the bias the layer will have (it floors the weight scale)."""
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
    return dequantize(qt.data, qt.scale, qt.zero_point, qt.axis, qt.block_size)


def planned_bias_spec(plan: QuantPlan) -> ResolvedSpec | None:
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


# (W_q, W) -> mean output error per channel, in float64. W_q comes in float32, W as stored:
# each function casts them as it needs (no float64 copies of both: VGG-19's classifier is
# 400 MB in float32).
ErrorFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def correct(model: ir.Model, plan: QuantPlan, layer: Layer, error: ErrorFn, emission: Emission,
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
    last = None
    for _ in range(3):  # the weight scale floor depends on the bias: let it settle
        wq = emission.dequantized_weight(layer.weight, node.inputs[1], bias_plan, bias)
        if wq is last:  # the same weight as the step before (its floor did not move): the same bias
            break
        new = base - error(wq, w) / beta
        settled = np.array_equal(new, bias)
        bias, last = new, wq
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
