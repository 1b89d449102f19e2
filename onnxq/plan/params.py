"""The numbers emission writes, computed without touching the graph.

Scales and zero points of activations, and the quantized form of each weight (with the
scale floor that keeps its int32 bias in range), are decided here once. The QDQ emitter
writes them; algorithms that must predict them (bias correction) call the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.graph.external_data import drop_pages
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import compute_qparams, int_type
from onnxq.numerics.weights import QuantizedTensor, bias_safe_weight_scale, quantize_weight
from onnxq.plan import Kind, QuantPlan, TensorPlan

ConstantOf = Callable[[str], "np.ndarray | None"]


def activation_range(
    plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], constant_of: ConstantOf, root: str
) -> tuple[float, float]:
    """Calibrated range of an activation; a constant's range is its values' min and max."""
    if plan.tensors[root].kind is Kind.CONSTANT:
        array = constant_of(root)
        return float(array.min(initial=0.0)), float(array.max(initial=0.0))
    return ranges[root]


def activation_qparams(
    plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], constant_of: ConstantOf,
    name: str, spec: ResolvedSpec | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point of activation `name` quantized with `spec` (default: its own)."""
    root = plan.root_of(name)
    spec = spec or plan.tensors[root].spec
    rmin, rmax = activation_range(plan, ranges, constant_of, root)
    return compute_qparams(rmin, rmax, spec.dtype, spec.symmetric, spec.scale_type, bits=spec.bits)


def bias_input_spec(plan: QuantPlan, bias: TensorPlan) -> ResolvedSpec | None:
    """The spec of the activation the biased node actually reads (after requantization)."""
    act = plan.tensors[bias.bias_inputs[0]]
    return act.requant.get((bias.consumers[0][0], 0)) if bias.consumers else None


def emitted_weight(
    plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], constant_of: ConstantOf,
    tensor: TensorPlan, bias: TensorPlan | None, bias_values: np.ndarray | None = None,
    unfloored: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """A weight quantized exactly as emission stores it (`bias_values`: a candidate bias
    to use instead of the stored one, for algorithms that are about to change it;
    `unfloored`: the weight already quantized without a scale floor, returned as is when
    the bias needs none).

    When the weight's int32 bias would overflow, its scale is raised just enough, per
    channel. A per-tensor scale is raised at most 2x (further would coarsen every
    channel); past that the bias stays float instead. So does it where most channels would
    be raised past 2x: not a few near-zero channels but an input scale too fine for an
    int32 bias (32-bit activations: conv1 of the digits example fell from 47.5 to 14.6 dB
    of weight SQNR). Inputs wider than 16 bits keep it float where any channel would be:
    the raised scale |b| / (2^31 s_in), with s_in = range / 2^bits, adds about
    |b| * sqrt(K / 12) * 2^(bits - 32) of output error over K inputs: against the bias
    itself nothing at 8 or 16 bits, and more than it at 32 (the digits
    classifier, some of whose channels were raised, took the model's output from
    16-bit's 44.7 dB to 23.9).
    """
    array = constant_of(tensor.name)
    qt = unfloored or quantize_weight(array, tensor.spec, tensor.axis, 0.0, tensor.block_size)
    if bias is None or tensor.block_size or bias.bias_inputs[0] not in plan.tensors:
        return qt
    s_in, _ = activation_qparams(plan, ranges, constant_of, bias.bias_inputs[0], bias_input_spec(plan, bias))
    channels = array.shape[tensor.axis] if tensor.axis is not None else 1
    if bias_values is None:
        bias_values = constant_of(bias.source or bias.name)
    floor = bias_safe_weight_scale(bias_values, float(s_in), channels, bias.spec)
    short = floor > np.asarray(qt.scale, dtype=np.float64) * (1 + SCALE_TOLERANCE)
    coarse = floor > 2 * np.asarray(qt.scale, dtype=np.float64)
    wide = _input_bits(plan, bias) > WIDEST_BIAS_INPUT_BITS
    if not np.any(short) or ((tensor.axis is None or wide) and np.any(coarse)) or np.mean(coarse) > 0.5:
        return qt
    floored = quantize_weight(array, tensor.spec, tensor.axis, floor, tensor.block_size)
    if tensor.axis is None or qt.axis is None:
        return floored
    return _merge_channels(qt, floored, short)


# Input widths up to which raising a weight channel for its int32 bias costs nothing
# against the bias (`emitted_weight`).
WIDEST_BIAS_INPUT_BITS = 16


def _input_bits(plan: QuantPlan, bias: TensorPlan) -> int:
    """Bits of the integer grid the biased node reads (8 where it is not an integer one)."""
    spec = bias_input_spec(plan, bias) or plan.tensors[bias.bias_inputs[0]].spec
    try:
        return int_type(spec.dtype, spec.bits).bits
    except KeyError:  # a float grid
        return 8


# Relative slack of the bias floor over a stored scale: a scale floored in float64 and
# stored as float32 may land a rounding step below the floor it was raised to.
SCALE_TOLERANCE = 1e-6


def _merge_channels(kept: QuantizedTensor, floored: QuantizedTensor, short: np.ndarray) -> QuantizedTensor:
    """`kept` with the channels in `short` taken from `floored`: only the channels whose
    scale the bias floor raises are rounded again, so a learned rounding (AdaRound,
    AdaQuant) of the others survives emission."""
    shape = [1] * kept.data.ndim
    shape[kept.axis] = -1
    data = np.where(short.reshape(shape), floored.data, kept.data).astype(kept.data.dtype)
    scale = np.where(short, floored.scale, kept.scale).astype(kept.scale.dtype)
    zero_point = np.where(short, floored.zero_point, kept.zero_point).astype(kept.zero_point.dtype)
    return QuantizedTensor(data, scale, zero_point, kept.axis, kept.block_size)


class WeightCache:
    """Weights quantized without a scale floor, computed once per pipeline and shared by
    the algorithms that predict emission (bias correction) and emission itself. An entry
    remembers the stored tensor it came from and is used only while that tensor is still
    the weight's value, so a pass that rewrites a weight never sees a stale one."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[object, QuantizedTensor]] = {}

    def unfloored(self, tensor: TensorPlan, value: ir.Value) -> QuantizedTensor:
        """The constant `value` quantized as `tensor` says, read only when not cached."""
        source = value.const_value
        key = self._key(tensor)
        entry = self._entries.get(key)
        if source is None or entry is None or entry[0] is not source:
            entry = source, quantize_weight(constant_array(value), tensor.spec, tensor.axis, 0.0, tensor.block_size)
            if source is not None:
                self._entries[key] = entry
                drop_pages(source)  # read once: a mapped weight's pages may go (read again from the file if need be)
        return entry[1]

    def copy(self) -> WeightCache:
        """A cache with the same entries, for a stage that pins into its own copy and hands
        it back (`optimize.context.AlgorithmContext`)."""
        other = WeightCache()
        other._entries = dict(self._entries)
        return other

    def pin(self, tensor: TensorPlan, value: ir.Value, quantized: QuantizedTensor) -> None:
        """Make `quantized` the weight's quantized form while `value` holds its current
        tensor (an algorithm that learned the rounding: AdaRound, AdaQuant)."""
        if value.const_value is not None:
            self._entries[self._key(tensor)] = (value.const_value, quantized)

    def unpin(self, tensor: TensorPlan) -> None:
        """Forget the weight's quantized form: emission rounds it to nearest again."""
        self._entries.pop(self._key(tensor), None)

    def pin_node(self, node: str, value: ir.Value, quantized: object) -> None:
        """Make `quantized` the weight of a lowered node (a MatMulNBits layout GPTQ chose)
        while `value` holds its current tensor."""
        if value.const_value is not None:
            self._entries[("node", node)] = (value.const_value, quantized)

    def pinned_node(self, node: str, value: ir.Value) -> object | None:
        """The weight pinned for lowered node `node`, if `value` still holds its tensor."""
        entry = self._entries.get(("node", node))
        return entry[1] if entry is not None and entry[0] is value.const_value else None

    @staticmethod
    def _key(tensor: TensorPlan) -> tuple:
        return (tensor.name, tensor.spec, tensor.axis, tensor.block_size)


def biases_by_weight(plan: QuantPlan) -> dict[str, TensorPlan]:
    """The bias plan of each weight that has one."""
    return {t.bias_inputs[1]: t for t in plan.tensors.values() if t.bias_inputs is not None}

