"""A layer's weight and bias as emission writes them: the nearest rounding emission would
use, the int32 bias floor on the weight scale, a solution stored for emission, and where
the emitted graph adds the bias (the replay gives a fitted bias there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import dequantize
from onnxq.numerics.weights import QuantizedTensor, bias_safe_weight_scale
from onnxq.optimize.context import AlgorithmContext
from onnxq.optimize.layerwise.grid import CodeGrid
from onnxq.optimize.layerwise.layers import (
    Layer,
    from_matrices,
    to_channels,
)
from onnxq.optimize.layerwise.problem import Problem, Solution
from onnxq.optimize.layerwise.replay import Replay
from onnxq.plan import QuantPlan
from onnxq.plan.params import (
    SCALE_TOLERANCE,
    activation_qparams,
    bias_input_spec,
    biases_by_weight,
    emitted_weight,
)

WEIGHT_PREFIX = "onnxq_layerwise_w::"
BIAS_PREFIX = "onnxq_layerwise_b::"


def constant_of(model: ir.Model) -> Callable[[str], np.ndarray | None]:
    return lambda name: constant_array(model.graph.initializers.get(name))


def emitted_nearest(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], ctx: AlgorithmContext,
             layer: Layer) -> QuantizedTensor:
    """The layer's weight as emission will quantize it (nearest, with the bias's scale floor)."""
    plain = ctx.weights.unfloored(layer.weight, layer.node.inputs[1])
    bias_plan = biases_by_weight(plan).get(layer.weight.name)
    usable = bias_plan if bias_plan is not None and bias_plan.bias_inputs[0] in plan.tensors else None
    return emitted_weight(plan, ranges, constant_of(model), layer.weight, usable, None, plain)


def bias_floor(model: ir.Model, plan: QuantPlan, ranges, layer: Layer, bias: np.ndarray,
                channels: int) -> np.ndarray:
    """The smallest weight scale per channel ([channels], or [1] per tensor) that keeps
    the bias `bias` (per output channel, Gemm's beta applied) in its int32 range (0 when
    the bias is not quantized); emission floors by the stored bias, without beta."""
    bias_plan = biases_by_weight(plan).get(layer.weight.name)
    if bias_plan is None or bias_plan.bias_inputs[0] not in plan.tensors:
        return np.zeros(channels)
    s_in, _ = activation_qparams(plan, ranges, constant_of(model), bias_plan.bias_inputs[0],
                                 bias_input_spec(plan, bias_plan))
    stored = np.asarray(bias, dtype=np.float64) / (layer.beta() or 1.0)
    return np.asarray(bias_safe_weight_scale(stored, float(s_in), channels, bias_plan.spec), dtype=np.float64).reshape(-1)


def bias_fits(model: ir.Model, plan: QuantPlan, ranges, layer: Layer, bias: np.ndarray, scale: np.ndarray) -> bool:
    """Whether a new bias keeps its int32 form in range with the weight scale `scale`."""
    floor = bias_floor(model, plan, ranges, layer, bias, np.size(scale))
    return bool(np.all(floor <= np.asarray(scale, dtype=np.float64).reshape(-1) * (1 + SCALE_TOLERANCE)))


def store_solution(model: ir.Model, layer: Layer, solution: Solution, problem: Problem, qt: QuantizedTensor) -> QuantizedTensor:
    """Write a new bias into the float model and return the quantized weight emission must
    use. The float weights stay as they are: later algorithms (bias correction) measure
    the quantized weights' error against them."""
    node = layer.node
    shape = layer.weight_array().shape
    if solution.bias is not None and layer.bias is not None:
        layer.set_bias(model.graph, solution.bias.reshape(-1))
    scale = solution.scale if solution.scale is not None else problem.scale  # learned, else searched
    scale = (scale.reshape(-1) if problem.per_channel else scale.reshape(-1)[:1]).reshape(np.shape(qt.scale))
    return with_codes(node, solution.codes, shape, qt, np.asarray(scale.astype(qt.scale.dtype)),
                      lambda zp: problem.grid)


def with_codes(node: ir.Node, codes: np.ndarray, shape: tuple[int, ...], qt: QuantizedTensor, scale: np.ndarray,
               grid: Callable[[np.ndarray], CodeGrid]) -> QuantizedTensor:
    """`qt` with learned `codes` (the layer's matrices, relative to the zero point) stored
    in `grid(zero point per channel)`, and `scale`."""
    g, m = codes.shape[:2]
    zp = to_channels(qt.zero_point, g, m)
    stored = grid(zp).store(from_matrices(node, codes + zp, shape), qt.data.dtype)
    return QuantizedTensor(stored, scale, qt.zero_point, qt.axis)


def dequantized(qt: QuantizedTensor) -> np.ndarray:
    return dequantize(qt.data, qt.scale, qt.zero_point, qt.axis)


@dataclass(frozen=True)
class BiasSlot:
    """Where the emitted graph adds a layer's bias: input `index` of node `node`; `shape`
    None for the layer's own bias input (stored divided by Gemm's beta), else the shape of
    the constant of the Add that float8 emission moved it into (`emit.float8.bias_to_add`,
    beta folded in)."""

    node: str
    index: int
    shape: tuple[int, ...] | None


def bias_slot(qnode: ir.Node, layer: Layer) -> BiasSlot | None:
    """The emitted layer's `BiasSlot`, None when it has none that a fitted bias can go in."""
    if len(qnode.inputs) > 2 and qnode.inputs[2] is not None:
        return BiasSlot(qnode.name, 2, None)
    for use in qnode.outputs[0].uses():
        other = use.node.inputs[1 - use.idx] if use.node.op_type == "Add" else None
        if other is not None and other.const_value is not None and other.shape is not None:
            return BiasSlot(use.node.name, 1 - use.idx, tuple(other.shape))
    return None


def slot_value(layer: Layer, slot: BiasSlot, added: np.ndarray) -> np.ndarray:
    """The bias `added` (per output channel, as added) as the emitted graph's slot holds it."""
    values = added / layer.beta() if slot.shape is None else added.reshape(slot.shape)
    return values.astype(np.float32)


def replay_bias(replay: Replay, layer: Layer, slot: BiasSlot, added: np.ndarray) -> None:
    """Give the replayed layer the bias `added` (per output channel, as added), where
    the emitted graph adds it."""
    replay.set_initializer(BIAS_PREFIX + layer.name, slot_value(layer, slot, added))
    replay.set_input(slot.node, slot.index, BIAS_PREFIX + layer.name)
