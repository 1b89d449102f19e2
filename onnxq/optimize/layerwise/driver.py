"""Walk the layers in graph order: statistics, optimise, keep the better rounding, pin it.

`reconstruct` is the whole of an algorithm but its per-layer optimiser: AdaRound and
AdaQuant each register a function `optimise(problem, options) -> Solution` and call it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from onnxq.calibrate.access import refusal
from onnxq.calibrate.data import iter_batches, model_inputs
from onnxq.calibrate.session import external_folder
from onnxq.errors import CalibrationDataError
from onnxq.graph.edit import set_constant
from onnxq.notes import counted
from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize.context import AlgorithmContext, AlgorithmResult
from onnxq.optimize.layerwise.activation import following
from onnxq.optimize.layerwise.block_driver import block_line, run_block
from onnxq.optimize.layerwise.block_fit import Rounding
from onnxq.optimize.layerwise.blocks import Block, find_blocks
from onnxq.optimize.layerwise.clip import search_scale
from onnxq.optimize.layerwise.emitted import (
    WEIGHT_PREFIX,
    bias_fits,
    bias_floor,
    bias_slot,
    dequantized,
    emitted_nearest,
    replay_bias,
    store_solution,
)
from onnxq.optimize.layerwise.guard import keep_learned
from onnxq.optimize.layerwise.layers import (
    Layer,
    find_layers,
    from_matrices,
    to_channels,
    to_matrices,
)
from onnxq.optimize.layerwise.problem import (
    Optimiser,
    Problem,
    Solution,
    build_problem,
    layer_statistics,
)
from onnxq.optimize.layerwise.replay import Replay, ReplayError
from onnxq.parallel import serial_blas
from onnxq.plan import QuantPlan
from onnxq.plan.params import (
    WeightCache,
)
from onnxq.progress import bar as progress_bar
from onnxq.target.pairs import enforce_pairs

# Bytes of the positions a layer keeps for a loss through its activation (`sampled.py`).
SAMPLE_BYTES = 64 << 20


def _quantized_graph(model: ir.Model, plan: QuantPlan, ranges, ctx: AlgorithmContext, inputs: str) -> ir.Model:
    """The graph the layers' inputs come from: the model as emitted (`quantized`), or the
    float model whose layers get their quantized weights (`weights`, `float`: see the
    options of AdaRound)."""
    qmodel = model.clone()
    if inputs == "quantized":
        ctx.emit_trial(qmodel, plan, ranges, ctx.weights)
    return qmodel


def reconstruct(
    name: str, optimise: Optimiser, model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
    options, ctx: AlgorithmContext, blocks: Rounding | None = None,
) -> str | AlgorithmResult:
    """Optimise every layer `options` selects with `optimise`, in graph order (module doc);
    then, with `blocks`, each block's rounding again against its output (`block_driver.py`)."""
    layers, refused = find_layers(model.graph, plan, options.op_types, options.skip_layers, options.layers)
    if not layers:
        return AlgorithmResult(f"no quantized {'/'.join(options.op_types) or 'named'} layer to optimise"
                               + _listed("skipped", refused), idle=True)
    access = ctx.settings.access
    if not access.readable:
        raise CalibrationDataError(f"{name} needs calibration data; pass calibration_data")
    if not access.rereadable:
        return AlgorithmResult(f"skipped: {refusal(access)}", idle=True)
    original = model.clone() if options.validation_every else None
    qmodel = _quantized_graph(model, plan, ranges, ctx, options.inputs)
    qnodes = {n.name: n for n in qmodel.graph}
    for layer in [x for x in layers if x.name not in qnodes]:
        refused[layer.name] = "not found in the emitted graph"
        layers.remove(layer)
    slots = {layer.name: bias_slot(qnodes[layer.name], layer) for layer in layers if layer.bias is not None}
    for layer in [x for x in layers if x.name in slots and slots[x.name] is None]:
        refused[layer.name] = "its bias is neither an input nor an Add after it in the emitted graph"
        layers.remove(layer)
    nearest = {layer.name: emitted_nearest(model, plan, ranges, ctx, layer) for layer in layers}
    split = _Split(options.validation_every, options.hold_out)
    batches = split.training(_batches(ctx, model, name))
    float_proto = ir.to_proto(model)
    replay = Replay(float_proto, ir.to_proto(qmodel), batches, ctx.settings.calibration.providers,
                    int(options.cache_budget_mb) << 20, folder=external_folder(model.graph))
    for layer in layers:
        qt = nearest[layer.name]
        replay.set_initializer(WEIGHT_PREFIX + layer.name, dequantized(qt))
        replay.set_input(layer.name, 1, WEIGHT_PREFIX + layer.name)
    report = _Report()
    fitted: dict[str, str] = {}  # layers whose bias was fitted here, handed back with the result

    def settle(layer: Layer, result: QuantizedTensor) -> None:
        ctx.weights.pin(layer.weight, layer.node.inputs[1], result)
        report.pinned[layer.name] = (layer, result)
        replay.set_initializer(WEIGHT_PREFIX + layer.name, dequantized(result))

    def one(layer: Layer, source, names: tuple[str, str]) -> None:
        result = _one_layer(optimise, model, plan, ranges, options, layer, nearest[layer.name], source, names, report)
        bar.set_postfix_str(report.last)
        if result is not None:
            settle(layer, result)
            if report.bias_changed.get(layer.name) is not None:
                fitted[layer.name] = name
                replay_bias(replay, layer, slots[layer.name], report.bias_changed[layer.name])

    found, not_blocked = find_blocks(qmodel.graph, layers, qnodes, model.graph.outputs[0].name,
                                     options.block_layers) if blocks is not None else ([], {})
    outcomes = []

    def current(layer: Layer) -> QuantizedTensor:
        return report.pinned[layer.name][1] if layer.name in report.pinned else nearest[layer.name]

    bar = progress_bar(_units(layers, found), name, "layer", ctx.settings.progress)
    try:
        for unit in bar:
            first = unit.layers[0] if isinstance(unit, Block) else unit
            try:
                if isinstance(unit, Block):
                    outcomes.append(run_block(unit, replay, qnodes, slots, current, one, settle, options, blocks))
                    continue
                xf = replay.float_name(unit.node.inputs[0].name)
                xq = xf if options.inputs == "float" else qnodes[unit.name].inputs[0].name
                one(unit, replay, (xq, xf))
            except ReplayError as exc:
                report.kept[first.name] = str(exc)
                break
    finally:
        bar.close()
        replay.close()
    line = report.line(len(layers), refused)
    warnings = report.warnings(replay.samples, replay.samples + split.held_out_samples)
    if blocks is not None:
        line += block_line(len(found), outcomes, not_blocked)
    del qmodel
    if original is not None and report.pinned:
        if split.checked:
            line += _guard(name, model, original, float_proto, plan, ranges, ctx, split, report, fitted)
        else:
            line += (f"; no model-level check: fewer than {options.validation_every} calibration batches "
                     f"to {'hold one out' if options.hold_out else 'check on'}")
    return AlgorithmResult(line, fitted_biases=fitted, warnings=warnings, idle=not report.pinned)


def _units(layers: list[Layer], blocks: list[Block]) -> list[Layer | Block]:
    """The walk's steps in graph order: each block in place of its layers, other layers alone."""
    starting = {block.layers[0].name: block for block in blocks}
    inside = {layer.name for block in blocks for layer in block.layers}
    return [starting.get(layer.name, layer) for layer in layers
            if layer.name in starting or layer.name not in inside]


def _batches(ctx: AlgorithmContext, model: ir.Model, name: str) -> Iterator[Mapping[str, np.ndarray]]:
    calibration = ctx.settings.calibration
    return iter_batches(ctx.settings.data, model_inputs(model), calibration.batch_size, calibration.max_samples,
                        f"{name} data", calibration.max_batches)


class _Split:
    """Every n-th calibration batch checks the model; held out from the statistics when
    `hold_out`."""

    def __init__(self, every: int, hold_out: bool) -> None:
        self.every, self.hold_out = every, hold_out
        self.checked = 0  # the batches the model-level check reads
        self.held_out_samples = 0

    def _validation(self, index: int) -> bool:
        return bool(self.every) and index % self.every == self.every - 1

    def training(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
        for i, batch in enumerate(batches):
            if self._validation(i):
                self.checked += 1
                if self.hold_out:
                    self.held_out_samples += len(next(iter(batch.values()))) if batch else 0
                    continue
            yield batch

    def validation(self, batches: Iterable[Mapping[str, np.ndarray]]) -> Iterator[Mapping[str, np.ndarray]]:
        return (batch for i, batch in enumerate(batches) if self._validation(i))


def _guard(name: str, model: ir.Model, original: ir.Model, float_proto, plan: QuantPlan, ranges,
           ctx: AlgorithmContext, split: _Split, report: _Report, fitted: dict[str, str]) -> str:
    """Check the whole model (`guard.py`); undo everything when nearest rounding is closer."""
    def emitted(source: ir.Model, weights: WeightCache) -> onnx.ModelProto:
        copy = source.clone()
        ctx.emit_trial(copy, plan, ranges, weights)
        return ir.to_proto(copy)

    keep, learned_db, near_db = keep_learned(
        emitted(original, WeightCache()), emitted(model, ctx.weights), float_proto,
        split.validation(_batches(ctx, model, name)), ctx.settings.calibration.providers)
    where = f"{split.checked} {'held-out ' if split.hold_out else ''}calibration batches"
    digits = 1 if round(learned_db, 1) != round(near_db, 1) else 3  # "fell to 15.7 from 15.7" said nothing
    if keep:
        return (f"; model output SQNR (each sample's mean removed) on {where} {learned_db:.{digits}f} dB "
                f"(nearest rounding {near_db:.{digits}f} dB)")
    per_tensor = any(qt.axis is None for _, qt in report.pinned.values())
    hint = "; with per-tensor weights try cross-layer equalization first: --cle" if per_tensor else ""
    for layer, _ in report.pinned.values():
        ctx.weights.unpin(layer.weight)
        fitted.pop(layer.name, None)
        for holder, index in [layer.bias] if layer.bias is not None else []:
            value = holder.inputs[index]
            before = original.graph.initializers.get(value.name) if value is not None else None
            if before is not None and before.const_value is not value.const_value:
                set_constant(model.graph, holder, index, before.const_value.numpy(), value.name)
    return (f"; undone: the model's output SQNR (each sample's mean removed) on {where} fell to "
            f"{learned_db:.{digits}f} dB from nearest rounding's {near_db:.{digits}f} dB (errors of many layers add "
            f"up differently{hint})")


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
    # One BLAS thread: for the gram's products between the replay's onnxruntime runs, and for
    # the fit, since BLAS splits its sums by the thread count and the codes AdaRound and
    # AdaQuant learn moved with the last bits (ResNet-20 AdaRound: 38 of 200 tensors differed
    # between 1 and 2 threads, determinism trial).
    with serial_blas():
        gram = layer_statistics(layer, replay, wbar, kernel, *names, options.max_positions, sample_cap)
        return _fit_layer(optimise, model, plan, ranges, options, layer, qt, gram, wbar, activation, replay.samples,
                          report)


def _fit_layer(optimise: Optimiser, model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
               options, layer: Layer, qt: QuantizedTensor, gram, wbar: np.ndarray, activation, samples: int,
               report: _Report) -> QuantizedTensor | None:
    """The layer's rounding, bias and scale from its statistics (`_one_layer`)."""
    g, m, k = wbar.shape
    k -= 1  # the bias column
    short = gram.positions < options.min_rows * (k + 1)
    if short:  # too few rows to learn K codes per output: fit only its scale and bias
        report.short[layer.name] = math.ceil(options.min_rows * (k + 1) / max(gram.positions / samples, 1e-9))
    problem = build_problem(layer, qt, gram, options.damping, wbar, activation, options.batch_positions)
    if problem.through is not None:
        report.through[activation.op_type] = report.through.get(activation.op_type, 0) + 1
    before = problem.loss(problem.nearest * problem.scale, problem.bias)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if options.search_scale and layer.weight.spec.pairs is None:
            floor = bias_floor(model, plan, ranges, layer, problem.bias.reshape(-1), np.size(qt.scale))
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
    if solution.bias is not None and not bias_fits(model, plan, ranges, layer, solution.bias, scale):
        solution = Solution(solution.codes, solution.weights, None, solution.scale)
        after = problem.loss(solution.codes * scale, problem.bias)
        if after >= before:
            report.losses.append((layer.name, before, before))
            return None
    report.losses.append((layer.name, before, after))
    result = store_solution(model, layer, solution, problem, qt)
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
        self.pinned: dict[str, tuple[Layer, QuantizedTensor]] = {}  # layer -> its pinned weight
        self.through: dict[str, int] = {}  # activation op type -> layers whose loss ran through one
        self.last = ""

    def line(self, total: int, refused: Mapping[str, str]) -> str:
        """The report."""
        improved = [(n, b, a) for n, b, a in self.losses if a < b]
        text = f"{len(improved)} of {counted(total, 'layer')} improved on nearest rounding"
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
                f"{counted(n, 'layer')} ({op})" for op, n in self.through.items())
        return text + _listed("kept nearest", self.kept) + _listed("not optimised", refused)

    def warnings(self, samples: int, supplied: int) -> tuple[str, ...]:
        """The layers too short of calibration rows to learn their rounding; `samples`:
        those the statistics came from, `supplied`: the calibration samples given (the
        model-level check's held-out batches included)."""
        if not self.short:
            return ()
        need = math.ceil(max(self.short.values()) * supplied / max(samples, 1))
        layers = ", ".join(list(self.short)[:3]) + (" ..." if len(self.short) > 3 else "")
        one = len(self.short) == 1
        return (f"{counted(len(self.short), 'layer')} ({layers}) {'has' if one else 'have'} too few calibration rows "
                f"for {'its' if one else 'their'} weights and kept nearest rounding ({'its' if one else 'their'} "
                f"scale and bias fitted): calibrate on at least {need} samples (now {supplied}) to optimise "
                f"{'it' if one else 'them'}",)




def _listed(what: str, reasons: Mapping[str, str]) -> str:
    if not reasons:
        return ""
    items = [f"{n} ({r})" for n, r in list(reasons.items())[:3]]
    return f"; {what}: {len(reasons)}: " + ", ".join(items) + (" ..." if len(reasons) > 3 else "")
