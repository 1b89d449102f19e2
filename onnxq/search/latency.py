"""`quantize_for_latency`: the latency-aware plan (`optimize_for: latency`).

Whether int8 runs faster than float depends on the CPU (VNNI or not), the onnxruntime
build and the shapes: depthwise and small convolutions are memory-bound, every Q/DQ
boundary costs a pass over its tensor, and Q/DQ around Gelu, Add or LayerNorm stop
onnxruntime from fusing them. So the plan is measured here, not assumed:

1. Quantize with the config as given, keeping the calibrated state (`PipelineState`).
2. Try each change of the table (`search/latency_changes.py`) in turn on the best model
   so far. Each re-emits the calibrated state (a calibration pass only for a tensor no
   plan calibrated before) and is timed against the best in default sessions on this CPU
   (or on the GPU provider listed first, where float16 is tried first)
   at batch 1 and 8 (`emit/latency.py`: the first calibration sample repeated, the models
   taking turns). A change is kept when the model gets faster by `GAIN` at the largest
   batch and at most `SLACK` slower at batch 1, while its output SQNR against float on
   the check samples stays within `SQNR_LOSS` dB of the first model's: accuracy first.
3. The float, the first and the chosen model are timed together for the summary.
4. The result is an ordinary config (float op types, excluded nodes, op-type overrides):
   the final model is quantized from it as any run is, and `result.config` holds it
   (`--save-config` writes it). The choice is cached per model, calibration data, config,
   CPU and onnxruntime version (`search/latency_cache.py`), so running the same command
   again on the same machine gives the same bytes, in the time of a plain run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.access import Access, data_access, refusal
from onnxq.calibrate.data import CalibrationSource, model_inputs
from onnxq.config.spec import Config, OptimizeFor
from onnxq.emit.fidelity import CHECK_SAMPLES, Reference, float_reference, measure
from onnxq.emit.latency import (
    Latency,
    Timing,
    latency_feeds,
    median_ms,
    rounds_ms,
    slower_on_gpu,
    timed_on,
)
from onnxq.errors import ConfigError, OnnxqError
from onnxq.notes import Note, Topic
from onnxq.pipeline.prepare import ModelSource, calibrates_activations
from onnxq.pipeline.result import PipelineState, QuantizationResult
from onnxq.pipeline.run import record_latency, run_pipeline
from onnxq.plan import QuantPlan, plan_quantization
from onnxq.progress import bar
from onnxq.search import latency_cache
from onnxq.search.base import with_calibration
from onnxq.search.latency_changes import CHANGES
from onnxq.sessions import deployed_options, imports_extended, open_any

# A change is kept when the model gets at least this much faster at the largest batch
# (the median ratio over rounds; the same model against itself, below, is within 7%, so
# a change must pass two comparisons) ...
GAIN = 1.05
# ... and is no slower than this at batch 1.
SLACK = 1.03
# Output SQNR (dB, the worst output against float on the check samples) a change may
# cost against the first model: MiniLM's int8-only-in-MatMuls plan costs 0.2 dB (and 0.06
# Spearman points), dynamic int8 MatMuls 0.4 dB; a change that costs more trades accuracy
# for speed.
SQNR_LOSS = 1.0
# Runs per model and batch in a comparison of a change with the best so far, cut short
# by the budget (a change is one comparison among about ten): ResNet-20 at batch 8 gets
# about 50 rounds, and itself against itself 0.93-1.01; MobileNet-v1 10 rounds, 0.97-1.00.
RUNS, BUDGET_S = 300, 1.5


@dataclass(frozen=True)
class Opened:
    """A model and its default session, opened once for every check and comparison."""

    model: ir.Model
    session: ort.InferenceSession


@dataclass
class _Timed:
    config: Config
    opened: Opened  # the model emitted from the calibrated state under `config`
    plan: QuantPlan
    sqnr: float
    kept: list[str]  # the changes this config carries


@dataclass(frozen=True)
class Trial:
    """One change tried: its output SQNR and its time against the best model so far, from
    the timing that decided, or why it was not timed."""

    name: str
    sqnr: float | None
    ratios: dict[int, float]  # batch -> time over the best's; empty: not timed
    kept: bool
    failed: str | None = None

    def line(self) -> str:
        if self.failed is not None:
            return f"{self.name}: failed ({self.failed}), not kept"
        if not self.ratios:
            return (f"{self.name}: output SQNR {self.sqnr:.1f} dB, more than {SQNR_LOSS:g} dB under the first "
                    "model's, not kept")
        times = ", ".join(f"batch {b} {r:.2f}x the time" for b, r in sorted(self.ratios.items()))
        return f"{self.name}: {times}{'' if self.kept else ', not kept'}"


@dataclass
class Found:
    """What a search found: the medians (batch -> ms) of the float, the first and the chosen
    model, the batches it could not time, and every change tried."""

    first: _Timed
    best: _Timed
    float_ms: dict[int, float]
    first_ms: dict[int, float]
    best_ms: dict[int, float]
    skipped: list[str] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)


class _Bench:
    """The float model's session, the feeds and the float reference outputs: what every
    candidate is timed and checked against."""

    def __init__(self, source: ModelSource, quantized: ir.Model, state: PipelineState, samples: int) -> None:
        self.providers = state.settings.calibration.providers
        inputs = model_inputs(quantized)
        self.float, self.first = self.open(source), Opened(quantized, self.open(quantized))
        self.feeds, self.skipped = latency_feeds(inputs, state.settings.data, self.first.session)
        self.reference: Reference | None = float_reference(_bytes(source), inputs, state.settings.data,
                                                           samples, self.providers)

    def open(self, model: ModelSource) -> ort.InferenceSession:
        """A default session of `model` (a deployment's options)."""
        source = _bytes(model)
        return open_any(source, deployed_options(extended=imports_extended(source)), self.providers)

    def time(self, *models: Opened) -> list[dict[int, float]]:
        """Median ms per batch of the float model and each of `models`, taking turns."""
        sessions = [self.float, *(m.session for m in models)]
        out: list[dict[int, float]] = [{} for _ in sessions]
        for batch, feed in self.feeds.items():
            for ms, row in zip(median_ms(sessions, feed, RUNS, BUDGET_S), out):
                row[batch] = ms
        return out

    def ratios(self, best: Opened, model: Opened) -> dict[int, float]:
        """Per batch, the median over rounds of `model`'s time over `best`'s, each round's
        blocks back to back (`rounds_ms`): drift and other jobs hit both alike."""
        out = {}
        for batch, feed in self.feeds.items():
            before, after = rounds_ms([best.session, model.session], feed, RUNS, BUDGET_S)
            out[batch] = float(np.median(np.asarray(after) / np.asarray(before)))
        return out

    def sqnr(self, model: Opened) -> float | None:
        if self.reference is None:
            return None
        found = measure(model.session, self.reference)
        return found.sqnr_db if found is not None and not isinstance(found, str) else None


def _bytes(model: ModelSource) -> str | os.PathLike | bytes | ir.Model:
    return model.SerializeToString() if hasattr(model, "SerializeToString") else model


def _faster(ratios: dict[int, float]) -> bool:
    """Faster by GAIN at the largest batch, and no slower than SLACK at batch 1 (`ratios`:
    the change's time over the best's, per batch)."""
    top = max(ratios)
    return ratios[top] * GAIN <= 1 and (top == 1 or 1 not in ratios or ratios[1] <= SLACK)


def _plan(state: PipelineState, config: Config) -> QuantPlan:
    return plan_quantization(state.float_model.clone(), config, state.keep_float, state.target)


def _try(bench: _Bench, state: PipelineState, best: _Timed, name: str, candidate: Config,
         floor: float) -> tuple[Trial, _Timed | None]:
    """Emit, check and time one change against `best`: the trial, and the new best if kept."""
    try:
        emitted = state.emit(candidate)
        model = Opened(emitted, bench.open(emitted))
        sqnr = bench.sqnr(model)
        if sqnr is None:
            return Trial(name, None, {}, False, "its output could not be compared with float"), None
        if sqnr < floor:
            return Trial(name, sqnr, {}, False), None
        ratios = bench.ratios(best.opened, model)
        if _faster(ratios):  # confirmed by a second timing: one can be a lucky draw
            ratios = bench.ratios(best.opened, model)
        if not _faster(ratios):
            return Trial(name, sqnr, ratios, False), None
        plan = _plan(state, candidate)
    except Exception as error:  # noqa: BLE001  the first model ran: a change that does not is not kept
        return Trial(name, None, {}, False, _one_line(error)), None
    return Trial(name, sqnr, ratios, True), _Timed(candidate, model, plan, sqnr, [*best.kept, name])


def search(source: ModelSource, config: Config, base: QuantizationResult, progress: bool | None) -> Found | str:
    """The changes that make `base` faster where it is timed (module doc), or why it cannot be
    searched."""
    state = base.state
    assert state is not None
    samples = config.calibration.check_samples or CHECK_SAMPLES
    try:
        bench = _Bench(source, base.ir_model, state, samples)
        first_sqnr = bench.sqnr(bench.first)
    except OnnxqError:
        raise
    except Exception as error:  # noqa: BLE001  onnxruntime raises several types
        return f"the models could not be timed: {_one_line(error)}"
    if first_sqnr is None:
        return ("the output of the float model could not be compared with the quantized one (no floating-point "
                "output): every change is checked against float first")
    first = best = _Timed(config, bench.first, base.plan, first_sqnr, [])
    trials: list[Trial] = []
    with bar(desc="latency plan", unit="change", enabled=progress) as shown:
        while True:
            tried = {t.name for t in trials}
            made = ((c.name, c.make(best.config, state.float_model.graph, best.plan)) for c in CHANGES
                    if c.name not in tried)
            name, candidate = next(((n, c) for n, c in made if c is not None), (None, None))
            if name is None or candidate is None:
                break
            shown.update()
            trial, better = _try(bench, state, best, name, candidate, first.sqnr - SQNR_LOSS)
            trials.append(trial)
            best = better or best  # the changes not yet tried go on from the new best
    float_ms, *timed = bench.time(*([first.opened] if best is first else [first.opened, best.opened]))
    return Found(first, best, float_ms, timed[0], timed[-1], list(bench.skipped), trials)


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def _unsearchable(config: Config, calibration_data: Any) -> str | None:
    """Why the plan cannot be timed here (None: it can)."""
    if not calibrates_activations(config):
        return ("this recipe quantizes no activations statically (weight-only or dynamic), so there is no "
                "int8 placement to time")
    access = data_access(CalibrationSource(calibration_data))
    if access is Access.NONE:
        return "it times the model on the first calibration sample; pass calibration_data"
    return None if access.rereadable else refusal(access)


def _measure_if_asked(result: QuantizationResult, source: ModelSource, config: Config) -> None:
    """`--latency` on a model the search's first run wrote (which ran without it)."""
    if config.calibration.measure_latency and result.summary.latency is None and result.state is not None:
        record_latency(result.summary, source, result.ir_model, result.state.settings.data,
                       config.calibration.providers)


def check_latency_options(config: Config) -> None:
    """Refuse what the latency plan cannot be combined with, in one line."""
    if config.mixed_precision.target is not None:
        raise ConfigError("optimize_for latency and an accuracy target cannot be combined yet: drop "
                          "--optimize-for latency, or --accuracy-target")
    if config.calibration.load_ranges or config.calibration.stats:
        raise ConfigError("optimize_for latency changes which tensors are calibrated, which saved ranges or "
                          "statistics do not hold: drop --load-ranges/--stats, or --optimize-for latency")


def quantize_for_latency(source: ModelSource, output: str | os.PathLike | None, config: Config,
                         calibration_data: Any, progress: bool | None, keep_state: bool = False,
                         ) -> QuantizationResult:
    """Quantize `source` under `config`, changed where that makes it faster where it runs
    (module doc); `output` gets the final model. The result's `config` is the chosen one."""
    check_latency_options(config)
    start = time.perf_counter()
    plain = dataclasses.replace(config, optimize_for=OptimizeFor.ACCURACY)
    why_not = _unsearchable(plain, calibration_data)
    name = latency_cache.key(source, plain, calibration_data) if why_not is None else None
    entry = latency_cache.load(name) if name is not None else None
    cached = entry is not None
    lines: list[str] = []
    base = None
    if why_not is None and entry is None:
        # The first model is written where asked: kept as it is when no change pays.
        base = run_pipeline(source, output, with_calibration(plain, measure_latency=False), calibration_data,
                            progress, keep_state=True)
        found = search(source, plain, base, progress)
        if isinstance(found, str):
            why_not = found
        else:
            entry = latency_cache.Entry(dataclasses.replace(found.best.config, calibration=plain.calibration),
                                        found.best.kept, found.float_ms, found.first_ms, found.best_ms,
                                        found.skipped)
            if name is not None:
                latency_cache.store(name, entry)
            lines = [t.line() for t in found.trials]
            if name is None:
                lines.append("not cached: the calibration data is a reader, which the cache cannot tell from another")
    if entry is None:
        result = base or run_pipeline(source, output, plain, calibration_data, progress, keep_state=keep_state)
        result.summary.notes.append(Note(Topic.SEARCH, f"latency plan not searched: {why_not}; quantized as "
                                         "configured"))
        _measure_if_asked(result, source, plain)
        if base is not None:  # a search ran and found nothing it could try
            result.summary.rest_as("search", time.perf_counter() - start)
        result.config = plain
        return result
    result = base if base is not None and not entry.kept else \
        run_pipeline(source, output, entry.config, calibration_data, progress, keep_state=keep_state)
    _measure_if_asked(result, source, plain)
    when = " (cached for this model, data, config and its providers, CPU and onnxruntime)" if cached else ""
    result.summary.notes.append(Note(Topic.SEARCH, f"latency plan: {entry.describe()}{when}"))
    result.summary.notes.extend(Note(Topic.SEARCH, f"latency plan tried: {line}") for line in lines)
    if result.summary.latency is None:
        result.summary.latency = Latency([Timing(b, entry.float_ms[b], entry.best_ms[b]) for b in sorted(entry.best_ms)],
                                         timed_on(plain.calibration.providers), skipped=[*entry.skipped, "timed by the latency plan's search"
                                                         + (", when it was cached" if when else "")])
        result.summary.latency.causes = slower_on_gpu(result.summary.latency, result.ir_model)
    if base is not None:  # the search ran (not read from the cache)
        result.summary.rest_as("search", time.perf_counter() - start)
    result.config = entry.config
    return result
