"""Run the configured passes and algorithms in order, each on a context frozen for its
call, and merge what each hands back into one returned outcome (`optimize/context.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from onnxq.calibrate.statistics import Statistic
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


def run_passes(model: ir.Model, entries: list[Mapping[str, Any]] | tuple[Entry, ...], settings: RunSettings,
               deferrable: bool = False) -> PassesOutcome:
    """Apply the configured pre-quantization passes in order (the default passes first,
    unless named). `deferrable`: calibration follows, so the last pass may defer."""
    entries = entries if all(isinstance(e, Entry) for e in entries) else parse_passes(list(entries))
    named = {entry.name for entry in entries}
    enabled = [e for e in (*parse_passes([{"name": d} for d in DEFAULT_PASSES if d not in named]), *entries)
               if e.enabled]
    notes: list[Note] = []
    keep_float: dict[str, str] = {}
    deferred = None
    for i, entry in enumerate(enabled):
        ctx = PassContext(settings, MappingProxyType(dict(keep_float)), deferrable and i == len(enabled) - 1)
        result = PASSES[entry.name](model, entry.options, ctx)
        result = result if isinstance(result, PassResult) else PassResult(result)
        keep_float.update(result.keep_float)
        deferred = result.deferred or deferred
        if result.note is not None:
            notes.append(Note(Topic.PASS, f"{entry.name}: {result.note}", source=entry.name))
    ir_passes.RemoveUnusedNodesPass()(model)  # drops initializers the passes replaced
    return PassesOutcome(notes, MappingProxyType(keep_float), deferred)


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
    the quantized weights emission uses, and the layers whose biases they fitted."""

    plan: QuantPlan
    notes: list[Note]
    weights: WeightCache
    fitted_biases: Mapping[str, str] = field(default_factory=dict)


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
    for entry in (e for e in entries if e.enabled):
        ctx = AlgorithmContext(settings, emit_trial, weights.copy(), MappingProxyType(dict(statistics)),
                               MappingProxyType(dict(fitted)))
        result = ALGORITHMS[entry.name](model, plan, ranges, entry.options, ctx)
        if isinstance(result, tuple):
            result = AlgorithmResult(result[0], result[1])
        elif not isinstance(result, AlgorithmResult):
            result = AlgorithmResult(result)
        weights = ctx.weights  # the algorithm's copy, with what it pinned
        fitted.update(result.fitted_biases)
        plan = result.plan if result.plan is not None else plan
        notes.append(Note(Topic.ALGORITHM, f"{entry.name}: {result.note}", source=entry.name))
        statistics = {}  # collected on the model before this algorithm changed it
    return AlgorithmsOutcome(plan, notes, weights, MappingProxyType(fitted))


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
        if not e.enabled or e.name not in ALGORITHMS:
            continue
        mode = getattr(e.options, "equalize", None)
        if mode == "always" or (mode == "auto" and per_tensor):
            return e.name
    return None
