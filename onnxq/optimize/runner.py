"""Run the configured passes and algorithms in order, each on a context frozen for its
call, and merge what each hands back into one returned outcome (`optimize/context.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from onnxq.calibrate.statistics import Statistic
from onnxq.errors import OnnxqError
from onnxq.notes import Note, Topic
from onnxq.optimize.context import (
    AlgorithmContext,
    AlgorithmResult,
    Deferred,
    PassContext,
    PassResult,
    Rescale,
    RunSettings,
    Statistics,
    TrialEmitter,
)
from onnxq.optimize.registry import (
    ALGORITHMS,
    DEFAULT_PASSES,
    PASSES,
    REQUESTS,
    Entry,
    parse_passes,
)
from onnxq.plan import QuantPlan
from onnxq.plan.params import WeightCache


@dataclass(frozen=True)
class PassesOutcome:
    """What the passes left: one report line per pass that did not defer, the nodes they
    keep float (node -> reason), the deferred half of the last pass if it deferred."""

    notes: list[Note]
    keep_float: Mapping[str, str]
    deferred: Deferred | None = None


def run_passes(model: ir.Model, entries: tuple[Entry, ...], settings: RunSettings,
               deferrable: bool = False) -> PassesOutcome:
    """Apply the configured pre-quantization passes (`registry.parse_passes`) in order (the
    default passes first, unless named). `deferrable`: calibration follows, so the last
    pass may defer."""
    named = {entry.name for entry in entries}
    enabled = [e for e in (*parse_passes([{"name": d} for d in DEFAULT_PASSES if d not in named]), *entries)
               if e.enabled]
    notes: list[Note] = []
    keep_float: dict[str, str] = {}
    deferred = None
    for i, entry in enumerate(enabled):
        ctx = PassContext(settings, MappingProxyType(dict(keep_float)), deferrable and i == len(enabled) - 1)
        result = PASSES[entry.name](model, entry.options, ctx)
        result = _pass_result(entry.name, result, ctx)
        keep_float.update(result.keep_float)
        deferred = result.deferred or deferred
        if result.note is not None and not (result.idle and entry.name not in named):
            notes.append(Note(Topic.PASS, f"{entry.name}: {result.note}", source=entry.name))
    ir_passes.RemoveUnusedNodesPass()(model)  # drops initializers the passes replaced
    return PassesOutcome(notes, MappingProxyType(keep_float), deferred)


def _pass_result(name: str, result: Any, ctx: PassContext) -> PassResult:
    """A pass's return value as a `PassResult`; a plugin's wrong one is a one-line error."""
    result = PassResult(result) if isinstance(result, str) else result
    if not isinstance(result, PassResult):
        raise OnnxqError(f"pass {name} returned {type(result).__name__}; a pass returns its report line (str) or "
                         "a PassResult (onnxq.optimize.context)")
    if result.deferred is not None and not ctx.may_defer:
        raise OnnxqError(f"pass {name} deferred its second half where it may not (PassContext.may_defer is "
                         "false: it is not the last pass, or no calibration pass follows); run it in full then")
    return result


def _algorithm_result(name: str, result: Any) -> AlgorithmResult:
    """An algorithm's return value as an `AlgorithmResult`; a plugin's wrong one is a
    one-line error."""
    if isinstance(result, str):
        return AlgorithmResult(result)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str):
        return AlgorithmResult(result[0], result[1])
    if not isinstance(result, AlgorithmResult):
        raise OnnxqError(f"algorithm {name} returned {type(result).__name__}; an algorithm returns its report "
                         "line (str), (line, plan) or an AlgorithmResult (onnxq.optimize.context)")
    return result


def finish_deferred(
    model: ir.Model, deferred: Deferred, statistics: Mapping[Statistic, Any]
) -> tuple[Note, dict[str, Rescale]]:
    """Run a deferred pass's second half on the statistics the calibration pass collected:
    its report line and the tensors it scaled."""
    report, rescaled = deferred.finish(statistics)
    ir_passes.RemoveUnusedNodesPass()(model)
    return Note(Topic.PASS, f"{deferred.name}: {report}", source=deferred.name), rescaled


@dataclass(frozen=True)
class AlgorithmsOutcome:
    """What the algorithms left: the plan as the last one left it, one report line each,
    and the quantized weights emission uses."""

    plan: QuantPlan
    notes: list[Note]
    weights: WeightCache
    idle: frozenset[str] = frozenset()  # those that found nothing to change


def run_algorithms(
    model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], entries: tuple[Entry, ...],
    settings: RunSettings, emit_trial: TrialEmitter, statistics: Statistics,
) -> AlgorithmsOutcome:
    """Apply the configured post-calibration algorithms in order. `statistics`: what the
    calibration pass collected, on the model before any algorithm changed it (the first
    algorithm's requests)."""
    notes: list[Note] = []
    weights = WeightCache()
    fitted: dict[str, str] = {}
    idle: set[str] = set()
    for entry in (e for e in entries if e.enabled):
        ctx = AlgorithmContext(settings, emit_trial, weights.copy(), MappingProxyType(dict(statistics)),
                               MappingProxyType(dict(fitted)))
        result = _algorithm_result(entry.name, ALGORITHMS[entry.name](model, plan, ranges, entry.options, ctx))
        weights = ctx.weights  # the algorithm's copy, with what it pinned
        fitted.update(result.fitted_biases)
        if result.idle:
            idle.add(entry.name)
        plan = result.plan if result.plan is not None else plan
        notes.append(Note(Topic.ALGORITHM, f"{entry.name}: {result.note}", source=entry.name))
        notes.extend(Note(Topic.ALGORITHM, f"warning: {entry.name}: {w}", source=entry.name) for w in result.warnings)
        statistics = {}  # collected on the model before this algorithm changed it
    return AlgorithmsOutcome(plan, notes, weights, frozenset(idle))


def algorithm_requests(model: ir.Model, plan: QuantPlan, entries: tuple[Entry, ...]) -> list[Statistic]:
    """What the first enabled algorithm will need from the data, for the calibration pass to
    collect. Only the first: each algorithm rewrites the model the next one observes."""
    enabled = [e for e in entries if e.enabled]
    if not enabled or enabled[0].name not in REQUESTS:
        return []
    return REQUESTS[enabled[0].name](model, plan, enabled[0].options)


def without_another_read(entries: tuple[Entry, ...], why: str) -> tuple[tuple[Entry, ...], list[Note]]:
    """The algorithms that can run when the calibration data cannot be read again (a
    generator, or none: statistics loaded from files), and a note per one skipped, `why`
    naming the fix. Only the first enabled algorithm gets its statistics from the
    calibration pass (`algorithm_requests`); one that reads the data itself (AdaRound,
    AdaQuant) or comes later would need another read, so it is skipped, and the next one
    becomes first (a preset's AdaRound skipped leaves its bias correction working)."""
    kept, notes, first = [], [], True
    for entry in entries:
        if not entry.enabled or entry.contract.data != "required":
            kept.append(entry)
        elif first and entry.name in REQUESTS:
            kept.append(entry)
            first = False
        else:
            notes.append(Note(Topic.SKIPPED, f"{entry.name}: skipped: {why}", source=entry.name))
    return tuple(kept), notes


def in_contract_order(entries: tuple[Entry, ...]) -> tuple[tuple[Entry, ...], list[str]]:
    """The algorithms with those whose contract says `runs_last` after the others, and the
    names of the enabled ones that moved ahead of them (for a note)."""
    enabled = [e for e in entries if e.enabled]
    first = next((i for i, e in enumerate(enabled) if e.contract.runs_last), None)
    if first is None:
        return entries, []
    later = [e.name for e in enabled[first + 1:] if not e.contract.runs_last]
    if not later:
        return entries, []
    return (tuple(e for e in entries if not e.contract.runs_last)
            + tuple(e for e in entries if e.contract.runs_last)), list(dict.fromkeys(later))


def equalizing_algorithm(entries: tuple[Entry, ...], per_tensor: bool) -> str | None:
    """The first enabled algorithm that wants cross-layer equalization before calibration
    (option `equalize`: "always", or "auto" when some Conv/Gemm weight is per tensor)."""
    for e in entries:
        if not e.enabled:
            continue
        mode = getattr(e.options, "equalize", None)
        if mode == "always" or (mode == "auto" and per_tensor):
            return e.name
    return None
