"""Walk the layers in graph order: statistics, optimise, keep the better rounding, pin it.

`reconstruct` is the whole of an algorithm but its per-layer optimiser: AdaRound and
AdaQuant each register a function `optimise(problem, options) -> Solution` and call it.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from tqdm import tqdm

from onnxq.calibrate.data import iter_batches, model_inputs
from onnxq.emit.trial import emit_trial
from onnxq.errors import CalibrationDataError
from onnxq.graph.edit import set_constant
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import dequantize
from onnxq.numerics.weights import QuantizedTensor, bias_safe_weight_scale
from onnxq.optimize.layerwise.activation import Activation, following
from onnxq.optimize.layerwise.clip import search_scale
from onnxq.optimize.layerwise.gram import Gram, position_stride
from onnxq.optimize.layerwise.grid import CodeGrid, code_grid
from onnxq.optimize.layerwise.guard import keep_learned
from onnxq.optimize.layerwise.layers import (
    Layer,
    find_layers,
    from_matrices,
    to_channels,
    to_matrices,
)
from onnxq.optimize.layerwise.replay import Replay, ReplayError
from onnxq.optimize.layerwise.sampled import BIAS_DAMPING, ThroughActivation
from onnxq.plan import QuantPlan
from onnxq.plan.params import (
    SCALE_TOLERANCE,
    WeightCache,
    activation_qparams,
    bias_input_spec,
    biases_by_weight,
    emitted_weight,
)
from onnxq.target.pairs import enforce_pairs

# Bytes of the positions a layer keeps for a loss through its activation (`sampled.py`).
SAMPLE_BYTES = 64 << 20
WEIGHT_PREFIX = "onnxq_layerwise_w::"
BIAS_PREFIX = "onnxq_layerwise_b::"


@dataclass
class Problem:
    """One layer's reconstruction, in code units of its weight grid.

    Weights are [g, M, K] matrices (`layers.to_matrices`); `h` [g, K+1, K+1] and `t`
    [g, M, K+1] are `gram.Gram`'s H and T per position, with `damping` times the mean
    diagonal of H holding weights near their float values where the data says nothing;
    `energy` is the float output's mean square per output channel and position.
    Codes are relative to the zero point and lie on `grid` (`grid.py`).
    """

    w: np.ndarray  # float weights [g, M, K]
    bias: np.ndarray  # [g, M]
    scale: np.ndarray  # [g, M, 1]
    grid: CodeGrid  # the codes the weight type has
    nearest: np.ndarray  # codes of nearest rounding as emitted [g, M, K]
    h: np.ndarray
    t: np.ndarray
    energy: float
    has_bias: bool  # whether the algorithm may change the bias
    per_channel: bool  # one scale per output channel (else one for the tensor)
    through: ThroughActivation | None = None  # the loss through the activation after the layer

    @property
    def reference(self) -> float:
        """The mean square the loss is relative to: of the float output, or through an
        activation of what passes it (so the regulariser keeps its weight)."""
        if self.through is None:
            return self.energy
        return max(self.through.energy, 1e-6 * self.energy)

    @property
    def outputs(self) -> int:
        return self.w.shape[0] * self.w.shape[1]

    @functools.cached_property
    def _h32(self) -> np.ndarray:
        return self.h.astype(np.float32)

    @functools.cached_property
    def _t32(self) -> np.ndarray:
        return self.t.astype(np.float32)

    @functools.cached_property
    def _t32k(self) -> np.ndarray:
        return np.ascontiguousarray(self._t32[:, :, :-1])

    def full(self, weights: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """[g, M, K+1]: weights with the bias column."""
        return np.concatenate([weights, bias[..., None]], axis=2)

    def loss(self, weights: np.ndarray, bias: np.ndarray) -> float:
        """Mean squared output error per output channel and position (through the
        activation when `through`), relative to the float output's mean square."""
        v = self.full(weights, bias)
        if self.through is not None:  # on the sample alone: never below 0, so no step can game it
            return self.through.sampled_loss(v.astype(np.float32))
        value = (np.sum(v * (v @ self.h)) - 2.0 * np.sum(v * self.t)) / self.outputs + self.energy
        return float(value / self.energy) if self.energy > 0 else float(value)

    def linear_bias(self, weights: np.ndarray) -> np.ndarray:
        """The bias minimising the output error before any activation for `weights` (the
        least-squares mean correction)."""
        k = weights.shape[2]
        num = self.t[:, :, k] - np.einsum("gmk,gk->gm", weights, self.h[:, :k, k])
        return num / np.maximum(self.h[:, k, k][:, None], 1e-30)

    def best_bias(self, weights: np.ndarray) -> np.ndarray:
        """The bias minimising the loss for `weights`."""
        linear = self.linear_bias(weights)
        return linear if self.through is None else self.through.best_bias(weights, linear)

    def gradient(self, full: np.ndarray, step: int, tune_bias: bool,
                 with_loss: bool = False) -> tuple[np.ndarray, float | None]:
        """The loss's gradient in the weights [g, M, K] at float32 weights with the bias
        column `full` [g, M, K+1], in units of 2 / (outputs x reference) (the mean of
        (V x_q - W x_f) x_q^T over positions), and with `with_loss` the loss there (through
        an activation: on step `step`'s mini-batch alone, as `loss`). With `tune_bias` the
        bias column first moves to (toward, through an activation) its best, in place."""
        k = self.w.shape[2]
        if self.through is not None:
            correction, curvature, loss = self.through.correction(full, step)
            grad = full @ self._h32 - self._t32
            grad += correction
            if tune_bias:  # one damped Gauss-Newton step per channel
                full[:, :, k] -= grad[:, :, k] / (curvature + BIAS_DAMPING)
            return grad[:, :, :k], loss
        if tune_bias:  # the minimum over the bias: its gradient is the partial one there
            full[:, :, k] = self.linear_bias(full[:, :, :k])
        if not with_loss:
            grad = full @ self._h32[:, :, :k]
            grad -= self._t32k
            return grad, None
        vh = full @ self._h32
        loss = float(np.sum(full * (vh - 2 * self._t32))) * (1.0 / (self.outputs * max(self.energy, 1e-30))) + 1.0
        return (vh - self._t32)[:, :, :k], loss


@dataclass
class Solution:
    """What an optimiser returns: codes [g, M, K] relative to the zero point, and
    optionally new float weights, a new bias [g, M] and new scales (like `Problem.scale`)."""

    codes: np.ndarray
    weights: np.ndarray | None = None
    bias: np.ndarray | None = None
    scale: np.ndarray | None = None


Optimiser = Callable[[Problem, object], Solution]


def _statistics(layer: Layer, replay: Replay, wbar: np.ndarray, kernel: tuple[int, ...], xq: str, xf: str,
                cap: int, sample_cap: int = 0) -> Gram:
    gram = None
    for batch in replay.inputs(list(dict.fromkeys([xq, xf]))):
        if gram is None:
            stride = position_stride(layer.node, batch[xq], kernel, replay.samples, cap)
            gram = Gram.empty(wbar.shape[0], wbar.shape[2] - 1, kernel, stride, sample_cap, replay.samples)
        gram.update(layer.node, wbar, batch[xq], batch[xf])
    return gram


def _problem(layer: Layer, qt: QuantizedTensor, gram: Gram, damping: float, full: np.ndarray,
             activation: Activation | None = None, batch: int = 0) -> Problem:
    """The layer's `Problem` from its statistics; `full`: its float weights with the bias
    column, [g, M, K+1]; `activation`: the one after the layer, when the loss runs
    through it (on the positions `gram` sampled, `batch` per step)."""
    wm, bias = full[:, :, :-1], full[:, :, -1]
    g, m, k = wm.shape
    scale, zp = to_channels(qt.scale, g, m), to_channels(qt.zero_point, g, m)
    positions = max(gram.positions, 1)
    h, c = gram.h / positions, gram.c / positions
    t = full @ c.transpose(0, 2, 1)
    energy = gram.energy / positions / (g * m)
    # Damping: + delta |V - W|^2 on the weight part, delta a share of H's mean diagonal.
    diag = np.einsum("gii->gi", h[:, :k, :k])
    delta = damping * np.maximum(diag.mean(axis=1), 1e-12)  # per group
    h[:, np.arange(k), np.arange(k)] += delta[:, None]
    t[:, :, :k] += delta[:, None, None] * wm
    energy += float(np.sum(delta[:, None, None] * wm * wm)) / (g * m)
    nearest = to_matrices(layer.node, qt.data.astype(np.float64)) - zp
    through = None
    if activation is not None and gram.kept_x:
        through = ThroughActivation.build(activation, *gram.sample(), batch)
    return Problem(wm, bias, scale, code_grid(layer.weight.spec, zp), nearest, h, t, energy,
                   layer.bias is not None, qt.axis is not None, through)


def _constant_of(model: ir.Model) -> Callable[[str], np.ndarray | None]:
    return lambda name: constant_array(model.graph.initializers.get(name))


def _emitted(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], ctx,
             layer: Layer) -> QuantizedTensor:
    """The layer's weight as emission will quantize it (nearest, with the bias's scale floor)."""
    plain = ctx.weights.unfloored(layer.weight, layer.node.inputs[1])
    bias_plan = biases_by_weight(plan).get(layer.weight.name)
    usable = bias_plan if bias_plan is not None and bias_plan.bias_inputs[0] in plan.tensors else None
    return emitted_weight(plan, ranges, _constant_of(model), layer.weight, usable, None, plain)


def _bias_floor(model: ir.Model, plan: QuantPlan, ranges, layer: Layer, bias: np.ndarray,
                channels: int) -> np.ndarray:
    """The smallest weight scale per channel ([channels], or [1] per tensor) that keeps
    the bias `bias` (per output channel, Gemm's beta applied) in its int32 range (0 when
    the bias is not quantized); emission floors by the stored bias, without beta."""
    bias_plan = biases_by_weight(plan).get(layer.weight.name)
    if bias_plan is None or bias_plan.bias_inputs[0] not in plan.tensors:
        return np.zeros(channels)
    s_in, _ = activation_qparams(plan, ranges, _constant_of(model), bias_plan.bias_inputs[0],
                                 bias_input_spec(plan, bias_plan))
    stored = np.asarray(bias, dtype=np.float64) / (layer.beta() or 1.0)
    return np.asarray(bias_safe_weight_scale(stored, float(s_in), channels, bias_plan.spec), dtype=np.float64).reshape(-1)


def _bias_fits(model: ir.Model, plan: QuantPlan, ranges, layer: Layer, bias: np.ndarray, scale: np.ndarray) -> bool:
    """Whether a new bias keeps its int32 form in range with the weight scale `scale`."""
    floor = _bias_floor(model, plan, ranges, layer, bias, np.size(scale))
    return bool(np.all(floor <= np.asarray(scale, dtype=np.float64).reshape(-1) * (1 + SCALE_TOLERANCE)))


def _quantized_graph(model: ir.Model, plan: QuantPlan, ranges, ctx, inputs: str) -> ir.Model:
    """The graph the layers' inputs come from: the model as emitted (`quantized`), or the
    float model whose layers get their quantized weights (`weights`, `float`: see the
    options of AdaRound)."""
    qmodel = model.clone()
    if inputs == "quantized":
        emit_trial(qmodel, plan, ranges, weights=ctx.weights, qdq_domain=ctx.qdq_domain, extended=ctx.extended,
                   statistics=ctx.emission_statistics)
    return qmodel


def _store(model: ir.Model, layer: Layer, solution: Solution, problem: Problem, qt: QuantizedTensor) -> QuantizedTensor:
    """Write a new bias into the float model and return the quantized weight emission must
    use. The float weights stay as they are: later algorithms (bias correction) measure
    the quantized weights' error against them."""
    node = layer.node
    shape = layer.weight_array().shape
    if solution.bias is not None and layer.bias is not None:
        layer.set_bias(model.graph, solution.bias.reshape(-1))
    scale = solution.scale if solution.scale is not None else problem.scale  # learned, else searched
    scale = (scale.reshape(-1) if problem.per_channel else scale.reshape(-1)[:1]).reshape(np.shape(qt.scale))
    scale = scale.astype(qt.scale.dtype)
    g, m = solution.codes.shape[:2]
    zp = to_channels(qt.zero_point, g, m)
    codes = from_matrices(node, solution.codes + zp, shape)
    return QuantizedTensor(problem.grid.store(codes, qt.data.dtype), np.asarray(scale), qt.zero_point, qt.axis)


def _dequantized(qt: QuantizedTensor) -> np.ndarray:
    return dequantize(qt.data, qt.scale, qt.zero_point, qt.axis)


def reconstruct(
    name: str, optimise: Optimiser, model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
    options, ctx,
) -> str:
    """Optimise every layer `options` selects with `optimise`, in graph order (module doc)."""
    layers, refused = find_layers(model.graph, plan, options.op_types, options.skip_layers, options.layers)
    if not layers:
        return f"no quantized {'/'.join(options.op_types) or 'named'} layer to optimise" + _listed("skipped", refused)
    if ctx.data is None or ctx.data.source is None:
        raise CalibrationDataError(f"{name} needs calibration data; pass --calib-data PATH")
    if not ctx.data.replayable:
        return ("skipped: the calibration data can be read only once; pass a path, a dict of arrays, "
                "a list of feeds or a reader with rewind()")
    original = model.clone() if options.validation_every else None
    qmodel = _quantized_graph(model, plan, ranges, ctx, options.inputs)
    qnodes = {n.name: n for n in qmodel.graph}
    for layer in [x for x in layers if x.name not in qnodes]:
        refused[layer.name] = "not found in the emitted graph"
        layers.remove(layer)
    slots = {layer.name: _bias_slot(qnodes[layer.name], layer) for layer in layers if layer.bias is not None}
    for layer in [x for x in layers if x.name in slots and slots[x.name] is None]:
        refused[layer.name] = "its bias is neither an input nor an Add after it in the emitted graph"
        layers.remove(layer)
    nearest = {layer.name: _emitted(model, plan, ranges, ctx, layer) for layer in layers}
    split = _Split(options.validation_every)
    batches = split.training(_batches(ctx, model, name))
    float_proto = ir.to_proto(model)
    replay = Replay(float_proto, ir.to_proto(qmodel), batches, ctx.calibration.providers,
                    int(options.cache_budget_mb) << 20)
    del qmodel
    for layer in layers:
        qt = nearest[layer.name]
        replay.set_initializer(WEIGHT_PREFIX + layer.name, _dequantized(qt))
        replay.set_input(layer.name, 1, WEIGHT_PREFIX + layer.name)
    report = _Report()
    bar = tqdm(layers, desc=name, unit="layer", file=sys.stderr, leave=False,
               disable=not (sys.stderr.isatty() if ctx.progress is None else ctx.progress))
    try:
        for layer in bar:
            qt = nearest[layer.name]
            xf = replay.float_name(layer.node.inputs[0].name)
            xq = xf if options.inputs == "float" else qnodes[layer.name].inputs[0].name
            try:
                result = _one_layer(optimise, model, plan, ranges, options, layer, qt, replay, (xq, xf), report)
            except ReplayError as exc:
                report.kept[layer.name] = str(exc)
                break
            bar.set_postfix_str(report.last)
            if result is not None:
                ctx.weights.pin(layer.weight, layer.node.inputs[1], result)
                report.pinned.append(layer)
                replay.set_initializer(WEIGHT_PREFIX + layer.name, _dequantized(result))
                if report.bias_changed.get(layer.name) is not None:
                    ctx.fitted_biases[layer.name] = name
                    _replay_bias(replay, layer, slots[layer.name], report.bias_changed[layer.name])
    finally:
        bar.close()
        replay.close()
    line = report.line(len(layers), refused, replay.samples, replay.samples + split.held_out_samples)
    if original is not None and report.pinned:
        if split.held_out:
            line += _guard(name, model, original, float_proto, plan, ranges, ctx, split, report)
        else:
            line += (f"; no model-level check: fewer than {options.validation_every} calibration batches "
                     "to hold one out")
    return line


@dataclass(frozen=True)
class BiasSlot:
    """Where the emitted graph adds a layer's bias: input `index` of node `node`; `shape`
    None for the layer's own bias input (stored divided by Gemm's beta), else the shape of
    the constant of the Add that float8 emission moved it into (`emit.float8.bias_to_add`,
    beta folded in)."""

    node: str
    index: int
    shape: tuple[int, ...] | None


def _bias_slot(qnode: ir.Node, layer: Layer) -> BiasSlot | None:
    """The emitted layer's `BiasSlot`, None when it has none that a fitted bias can go in."""
    if len(qnode.inputs) > 2 and qnode.inputs[2] is not None:
        return BiasSlot(qnode.name, 2, None)
    for use in qnode.outputs[0].uses():
        other = use.node.inputs[1 - use.idx] if use.node.op_type == "Add" else None
        if other is not None and other.const_value is not None and other.shape is not None:
            return BiasSlot(use.node.name, 1 - use.idx, tuple(other.shape))
    return None


def _replay_bias(replay: Replay, layer: Layer, slot: BiasSlot, added: np.ndarray) -> None:
    """Give the replayed layer the bias `added` (per output channel, as added), where
    the emitted graph adds it."""
    values = added / layer.beta() if slot.shape is None else added.reshape(slot.shape)
    replay.set_initializer(BIAS_PREFIX + layer.name, values.astype(np.float32))
    replay.set_input(slot.node, slot.index, BIAS_PREFIX + layer.name)


def _batches(ctx, model: ir.Model, name: str) -> Iterator[Mapping[str, np.ndarray]]:
    return iter_batches(ctx.data, model_inputs(model), ctx.calibration.batch_size, ctx.calibration.max_samples,
                        f"{name} data", ctx.calibration.max_batches)


class _Split:
    """Every n-th calibration batch held out from the statistics, to check the model on."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.held_out = 0
        self.held_out_samples = 0

    def _validation(self, index: int) -> bool:
        return bool(self.every) and index % self.every == self.every - 1

    def training(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
        for i, batch in enumerate(batches):
            if self._validation(i):
                self.held_out += 1
                self.held_out_samples += len(next(iter(batch.values()))) if batch else 0
            else:
                yield batch

    def validation(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
        return (batch for i, batch in enumerate(batches) if self._validation(i))


def _guard(name: str, model: ir.Model, original: ir.Model, float_proto, plan: QuantPlan, ranges, ctx,
           split: _Split, report: _Report) -> str:
    """Check the whole model (`guard.py`); undo everything when nearest rounding is closer."""
    def emitted(source: ir.Model, weights: WeightCache) -> onnx.ModelProto:
        copy = source.clone()
        emit_trial(copy, plan, ranges, weights=weights, qdq_domain=ctx.qdq_domain, extended=ctx.extended,
                   statistics=ctx.emission_statistics)
        return ir.to_proto(copy)

    keep, learned_db, near_db = keep_learned(
        emitted(original, WeightCache()), emitted(model, ctx.weights), float_proto,
        split.validation(_batches(ctx, model, name)), ctx.calibration.providers)
    where = f"{split.held_out} held-out calibration batches"
    if keep:
        return f"; model output SQNR on {where} {learned_db:.1f} dB (nearest rounding {near_db:.1f} dB)"
    for layer in report.pinned:
        ctx.weights.unpin(layer.weight)
        ctx.fitted_biases.pop(layer.name, None)
        for holder, index in [layer.bias] if layer.bias is not None else []:
            value = holder.inputs[index]
            before = original.graph.initializers.get(value.name) if value is not None else None
            if before is not None and before.const_value is not value.const_value:
                set_constant(model.graph, holder, index, before.const_value.numpy(), value.name)
    return (f"; undone: the model's output SQNR on {where} fell to "
            f"{learned_db:.1f} dB from nearest rounding's {near_db:.1f} dB (errors of many layers add up "
            f"differently; with per-tensor weights try cross-layer equalization first: --cle)")


def _one_layer(optimise: Optimiser, model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
               options, layer: Layer, qt: QuantizedTensor, replay: Replay, names: tuple[str, str],
               report: _Report) -> QuantizedTensor | None:
    node = layer.node
    w = layer.weight_array()
    wm = to_matrices(node, w.astype(np.float64))
    g, m, k = wm.shape
    wbar = np.concatenate([wm, layer.bias_array().reshape(g, m, 1)], axis=2)
    kernel = tuple(w.shape[2:]) if node.op_type == "Conv" else ()
    activation = following(model.graph, node, (g, m), len(kernel)) if options.activation else None
    sample_cap = min(options.sample_positions, SAMPLE_BYTES // (4 * g * (k + 1 + m))) if activation else 0
    gram = _statistics(layer, replay, wbar, kernel, *names, options.max_positions, sample_cap)
    short = gram.positions < options.min_rows * (k + 1)
    if short:  # too few rows to learn K codes per output: fit only its scale and bias
        report.short[layer.name] = math.ceil(options.min_rows * (k + 1) / max(gram.positions / replay.samples, 1e-9))
    problem = _problem(layer, qt, gram, options.damping, wbar, activation, options.batch_positions)
    if problem.through is not None:
        report.through[activation.op_type] = report.through.get(activation.op_type, 0) + 1
    before = problem.loss(problem.nearest * problem.scale, problem.bias)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if options.search_scale and layer.weight.spec.pairs is None:
            floor = _bias_floor(model, plan, ranges, layer, problem.bias.reshape(-1), np.size(qt.scale))
            problem = search_scale(problem, to_channels(floor, g, m) if problem.per_channel else floor.max(),
                                   layer.weight.spec.scale_type)
        solution = _fit_only(problem, options) if short else optimise(problem, options)
    if layer.weight.spec.pairs is not None:
        solution.codes = _pair_safe(layer, qt, solution, problem)
    scale = solution.scale if solution.scale is not None else problem.scale
    new_bias = solution.bias if solution.bias is not None else problem.bias
    after = problem.loss(solution.codes * scale, new_bias)
    if not (math.isfinite(after) and math.isfinite(before)):
        report.kept[layer.name] = "loss not finite (NaN/Inf): nearest rounding kept"
        report.last = "non-finite loss"
        return None
    report.last = f"{layer.name}: {before:.3g} -> {after:.3g}"
    if after >= before:
        report.losses.append((layer.name, before, before))
        return None
    if solution.bias is not None and not _bias_fits(model, plan, ranges, layer, solution.bias, scale):
        solution = Solution(solution.codes, solution.weights, None, solution.scale)
        after = problem.loss(solution.codes * scale, problem.bias)
        if after >= before:
            report.losses.append((layer.name, before, before))
            return None
    report.losses.append((layer.name, before, after))
    result = _store(model, layer, solution, problem, qt)
    if solution.bias is not None and layer.bias is not None:
        report.bias_changed[layer.name] = solution.bias.reshape(-1).astype(np.float32)
    return result


def _fit_only(problem: Problem, options) -> Solution:
    """Nearest rounding on the problem's (searched) scale, with the bias re-solved: the
    few parameters that a layer with too few rows to learn its rounding can still fit."""
    bias = problem.best_bias(problem.nearest * problem.scale) if options.bias and problem.has_bias else None
    return Solution(problem.nearest.copy(), bias=bias)


def _pair_safe(layer: Layer, qt: QuantizedTensor, solution: Solution, problem: Problem) -> np.ndarray:
    """The solution's codes with every kernel pair the saturating kernels add held in range."""
    node, shape = layer.node, layer.weight_array().shape
    scale = solution.scale if solution.scale is not None else problem.scale
    real = solution.weights if solution.weights is not None else problem.w
    codes = from_matrices(node, solution.codes, shape)
    fixed = enforce_pairs(codes, from_matrices(node, real / scale, shape), qt.axis, layer.weight.spec.pairs)
    return to_matrices(node, fixed)


class _Report:
    def __init__(self) -> None:
        self.losses: list[tuple[str, float, float]] = []
        self.kept: dict[str, str] = {}
        self.short: dict[str, int] = {}  # layer -> calibration samples it needs
        self.bias_changed: dict[str, np.ndarray | None] = {}
        self.pinned: list[Layer] = []
        self.through: dict[str, int] = {}  # activation op type -> layers whose loss ran through one
        self.last = ""

    def line(self, total: int, refused: Mapping[str, str], samples: int, supplied: int) -> str:
        """The report; `samples`: those the statistics came from, `supplied`: the
        calibration samples given (the model-level check's held-out batches included)."""
        improved = [(n, b, a) for n, b, a in self.losses if a < b]
        text = f"{len(improved)} of {_count(total, 'layer')} improved on nearest rounding"
        fitted = sum(n in self.short for n, _, _ in improved)
        if fitted:
            text += f" ({fitted} of them by their scale and bias alone)"
        measured = [(b, a) for _, b, a in self.losses if math.isfinite(b)]
        if measured:
            before = float(np.median([b for b, _ in measured]))
            after = float(np.median([a for _, a in measured]))
            text += f" (median relative output error {before:.3g} -> {after:.3g})"
        if self.through:
            text += "; error measured after the activation on " + ", ".join(
                f"{_count(n, 'layer')} ({op})" for op, n in self.through.items())
        text += _listed("kept nearest", self.kept) + _listed("not optimised", refused)
        if self.short:
            need = math.ceil(max(self.short.values()) * supplied / max(samples, 1))
            text += (f"; warning: {_count(len(self.short), 'layer')} rounded to nearest (only their scale and bias "
                     f"fitted), too few calibration rows for their weights ({', '.join(list(self.short)[:3])}): "
                     f"calibrate on at least {need} samples (now {supplied}) to optimise them")
        return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _listed(what: str, reasons: Mapping[str, str]) -> str:
    if not reasons:
        return ""
    items = [f"{n} ({r})" for n, r in list(reasons.items())[:3]]
    return f"; {what}: {len(reasons)}: " + ", ".join(items) + (" ..." if len(reasons) > 3 else "")
