"""`quantize_for_latency`: the latency-aware plan (`optimize_for: latency`).

Whether int8 runs faster than float depends on the CPU (VNNI or not), the onnxruntime
build and the shapes: depthwise and small convolutions are memory-bound, every Q/DQ
boundary costs a pass over its tensor, and Q/DQ around Gelu, Add or LayerNorm stop
onnxruntime from fusing them. So the plan is measured here, not assumed:

1. Quantize with the config as given, keeping the calibrated state (`PipelineState`).
2. Time the float model and that one in default sessions on this CPU at batch 1 and 8
   (`emit/latency.py`: the first calibration sample repeated, the models taking turns).
3. Try each change of `CHANGES` in turn on the best model so far; each re-emits the
   calibrated state (no new calibration pass) and is timed against it. A change is kept
   when the model gets faster by `GAIN` at the largest batch and no slower than `SLACK`
   at batch 1, while its output SQNR against float on the check samples stays within
   `SQNR_LOSS` dB of the first model's: accuracy first, latency second.
4. The result is an ordinary config (float op types, excluded nodes, op-type overrides):
   the final model is quantized from it as any run is. The choice is cached per model,
   config, CPU and onnxruntime version (`search/latency_cache.py`), so running the same
   command again on the same machine gives the same bytes, and in seconds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.access import data_access, refusal
from onnxq.calibrate.data import CalibrationSource, model_inputs
from onnxq.config.spec import Config, DType, OptimizeFor, QuantizationConfig, QuantizationSpec
from onnxq.emit.fidelity import Reference, float_reference, measure
from onnxq.emit.latency import Latency, Timing, latency_feeds, median_ms, rounds_ms
from onnxq.errors import ConfigError
from onnxq.evaluate import deployed_options, imports_extended, open_any
from onnxq.notes import Note, Topic
from onnxq.pipeline.prepare import ModelSource
from onnxq.pipeline.result import PipelineState, QuantizationResult
from onnxq.pipeline.run import run_pipeline
from onnxq.plan import plan_quantization
from onnxq.progress import bar
from onnxq.search import latency_cache
from onnxq.search.base import with_calibration
from onnxq.target.profile import cpu_isa

# A change is kept when the model gets at least this much faster at the largest batch
# (the median ratio over rounds; the same model against itself, below, is within 7%, so
# a change must pass two comparisons) ...
GAIN = 1.05
# ... and is no slower than this at batch 1.
SLACK = 1.03
# Output SQNR (dB, the worst output against float on the check samples) a change may
# cost against the first model. Dynamic int8 MatMuls cost MiniLM 0.5 dB and no
# Spearman point; a change that costs more trades accuracy for speed.
SQNR_LOSS = 1.0
# Runs per model and batch in a comparison of a change with the best so far, cut short
# by the budget (a change is one comparison among about ten): ResNet-20 at batch 8 gets
# about 50 rounds, and itself against itself 0.93-1.01; MobileNet-v1 10 rounds, 0.97-1.00.
RUNS, BUDGET_S = 300, 1.5
CHECK_SAMPLES = 8
# Ops with integer kernels: the work int8 is for. The other quantized ops (Add, Mul,
# pooling, Concat...) only carry int8 between them, and may cost more than they save.
KERNEL_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


@dataclass(frozen=True)
class Change:
    """One change to try: its description and the config it makes of the best so far
    (None: it does not apply to this model)."""

    name: str
    make: Callable[[Config, PipelineState, dict[str, str]], Config | None]


def _float_types(config: Config, types: list[str]) -> Config | None:
    added = [t for t in types if t not in config.float_op_types and t not in config.layer_type_quant_config]
    return dataclasses.replace(config, float_op_types=[*config.float_op_types, *added]) if added else None


def _links(config: Config, state: PipelineState, quantized: dict[str, str]) -> Config | None:
    """Every quantized op without an integer kernel kept float: int8 only inside the
    kernels, and onnxruntime's float fusions (Gelu, SkipLayerNorm, Add+Relu) back."""
    return _float_types(config, sorted(set(quantized.values()) - KERNEL_OPS))


def _one_link(op_type: str) -> Change:
    return Change(f"{op_type} kept float", lambda c, s, q: _float_types(c, [op_type]) if op_type in q.values()
                  else None)


def _dynamic_matmul(config: Config, state: PipelineState, quantized: dict[str, str]) -> Config | None:
    """MatMul/Gemm with activations quantized at run time (MatMulInteger: onnxruntime's
    DynamicQuantizeMatMul): no Q/DQ between them and the float ops around."""
    types = sorted({"MatMul", "Gemm"} & set(quantized.values()))
    if not types:
        return None
    dynamic = QuantizationConfig(input_tensors=QuantizationSpec(dtype=DType.UINT8, symmetric=False, is_dynamic=True),
                                 output_tensors=QuantizationSpec(dtype=DType.FLOAT32))
    overrides = {t: dynamic for t in types if t not in config.layer_type_quant_config}
    return dataclasses.replace(config, layer_type_quant_config={**config.layer_type_quant_config, **overrides}) \
        if overrides else None


def _depthwise(node: ir.Node) -> bool:
    group = node.attributes.get("group")
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    return (group is not None and group.as_int() > 1 and weight is not None and weight.shape is not None
            and len(weight.shape) > 1 and weight.shape[1] == 1)


def _kernels_float(which: Callable[[ir.Node], bool]) -> Callable[[Config, PipelineState, dict[str, str]],
                                                                  Config | None]:
    def make(config: Config, state: PipelineState, quantized: dict[str, str]) -> Config | None:
        names = [n.name for n in state.float_model.graph if n.name in quantized and which(n)
                 and n.name not in config.exclude]
        return dataclasses.replace(config, exclude=[*config.exclude, *names]) if names else None
    return make


# The changes, in the order they are tried: the float fusions first (they cost no
# accuracy), then dynamic MatMuls, then whole kernel classes int8 does not speed up here.
CHANGES: tuple[Change, ...] = (
    Change("int8 only in Conv/MatMul/Gemm (the ops between them float)", _links),
    *(_one_link(op) for op in ("Add", "Mul", "Concat", "MaxPool", "AveragePool", "GlobalAveragePool",
                               "Sigmoid", "Transpose", "Reshape", "Div", "Sub")),
    Change("MatMul/Gemm dynamic int8", _dynamic_matmul),
    Change("depthwise Conv kept float", _kernels_float(lambda n: n.op_type == "Conv" and _depthwise(n))),
    Change("other Conv kept float", _kernels_float(lambda n: n.op_type in ("Conv", "ConvTranspose")
                                                 and not _depthwise(n))),
    Change("MatMul/Gemm kept float", _kernels_float(lambda n: n.op_type in ("MatMul", "Gemm"))),
)


@dataclass
class _Timed:
    config: Config
    model: ir.Model  # emitted from the calibrated state under `config`
    ms: dict[int, float]  # batch -> median ms
    sqnr: float | None
    kept: list[str]  # the changes this config carries


class _Bench:
    """The float model's session, the feeds and the float reference outputs: what every
    candidate is timed and checked against."""

    def __init__(self, source: ModelSource, quantized: ir.Model, result: QuantizationResult) -> None:
        state = result.state
        assert state is not None
        self.providers = state.settings.calibration.providers
        inputs = model_inputs(quantized)
        self.float = _session(source, self.providers)
        self.feeds, self.skipped = latency_feeds(inputs, state.settings.data, _session(quantized, self.providers))
        self.reference: Reference | None = float_reference(_bytes(source), inputs, state.settings.data,
                                                           CHECK_SAMPLES, self.providers)

    def time(self, *models: ir.Model) -> list[dict[int, float]]:
        """Median ms per batch of the float model and each of `models`, taking turns."""
        sessions = [self.float, *(_session(m, self.providers) for m in models)]
        out: list[dict[int, float]] = [{} for _ in sessions]
        for batch, feed in self.feeds.items():
            for ms, row in zip(median_ms(sessions, feed, RUNS, BUDGET_S), out):
                row[batch] = ms
        return out

    def ratios(self, best: ir.Model, model: ir.Model) -> dict[int, float]:
        """Per batch, the median over rounds of `model`'s time over `best`'s, each round's
        blocks back to back (`rounds_ms`): drift and other jobs hit both alike."""
        sessions = [_session(best, self.providers), _session(model, self.providers)]
        out = {}
        for batch, feed in self.feeds.items():
            before, after = rounds_ms(sessions, feed, RUNS, BUDGET_S)
            out[batch] = float(np.median(np.asarray(after) / np.asarray(before)))
        return out

    def sqnr(self, model: ir.Model) -> float | None:
        if self.reference is None:
            return None
        found = measure(_session(model, self.providers), self.reference)
        return found.sqnr_db if found is not None and not isinstance(found, str) else None


def _session(model: ModelSource, providers: list[str]) -> ort.InferenceSession:
    source = _bytes(model)
    return open_any(source, deployed_options(extended=imports_extended(source)), providers)


def _bytes(model: ModelSource) -> str | os.PathLike | bytes | ir.Model:
    return model.SerializeToString() if hasattr(model, "SerializeToString") else model


def _faster(ratios: dict[int, float]) -> bool:
    """Faster by GAIN at the largest batch, and no slower than SLACK at batch 1 (`ratios`:
    the change's time over the best's, per batch)."""
    top = max(ratios)
    return ratios[top] * GAIN <= 1 and (top == 1 or 1 not in ratios or ratios[1] <= SLACK)


def _candidates(best: _Timed, state: PipelineState, quantized: dict[str, str]) -> Iterator[tuple[str, Config]]:
    for change in CHANGES:
        made = change.make(best.config, state, quantized)
        if made is not None:
            yield change.name, made


@dataclass(frozen=True)
class Trial:
    """One change tried: its output SQNR and its time against the best model so far, from
    the timing that decided."""

    name: str
    sqnr: float | None
    ratios: dict[int, float]  # batch -> time over the best's (paired runs); empty: not timed
    kept: bool

    def line(self) -> str:
        if not self.ratios:
            sqnr = "none" if self.sqnr is None else f"{self.sqnr:.1f} dB"
            return f"{self.name}: output SQNR {sqnr}, more than {SQNR_LOSS:g} dB under the first model's, not kept"
        times = ", ".join(f"batch {b} {r:.2f}x the time" for b, r in sorted(self.ratios.items()))
        return f"{self.name}: {times}{'' if self.kept else ', not kept'}"


def search(source: ModelSource, config: Config, base: QuantizationResult, progress: bool | None,
           ) -> tuple[_Timed, _Timed, dict[int, float], list[Trial]]:
    """The first and the best timed model (module doc), the float model's medians, and
    every change tried."""
    state = base.state
    assert state is not None
    bench = _Bench(source, base.ir_model, base)
    first = best = _Timed(config, base.ir_model, {}, bench.sqnr(base.ir_model), [])
    floor = None if first.sqnr is None else first.sqnr - SQNR_LOSS
    trials: list[Trial] = []
    quantized = dict(base.plan.quantized_nodes)
    with bar(desc="latency plan", unit="change", enabled=progress) as shown:
        while True:
            tried = {t.name for t in trials}
            found = next(((n, c) for n, c in _candidates(best, state, quantized) if n not in tried), None)
            if found is None:
                break
            name, candidate = found
            shown.update()
            model = state.emit(candidate)
            sqnr = bench.sqnr(model)
            if floor is not None and (sqnr is None or sqnr < floor):
                trials.append(Trial(name, sqnr, {}, False))
                continue
            ratios = bench.ratios(best.model, model)
            if _faster(ratios):  # confirmed by a second timing: one can be a lucky draw
                ratios = bench.ratios(best.model, model)
            trials.append(Trial(name, sqnr, ratios, _faster(ratios)))
            if trials[-1].kept:  # the changes not yet tried go on from the new best
                best = _Timed(candidate, model, {}, sqnr, [*best.kept, name])
                quantized = _quantized(state, candidate)
    models = [first.model] if best is first else [first.model, best.model]
    float_ms, *timed = bench.time(*models)
    first.ms, best.ms = timed[0], timed[-1]
    return first, best, float_ms, trials


def _quantized(state: PipelineState, config: Config) -> dict[str, str]:
    return dict(plan_quantization(state.float_model.clone(), config, state.keep_float, state.target).quantized_nodes)


def quantize_for_latency(source: ModelSource, output: str | os.PathLike | None, config: Config,
                         calibration_data: Any, progress: bool | None) -> QuantizationResult:
    """Quantize `source` under `config`, changed where that makes it faster on this CPU
    (module doc); `output` gets the final model."""
    if config.mixed_precision.target is not None:
        raise ConfigError("optimize_for latency and an accuracy target cannot be combined yet: drop "
                          "--optimize-for latency, or --accuracy-target")
    plain = dataclasses.replace(config, optimize_for=OptimizeFor.ACCURACY)
    name = latency_cache.key(source, plain)
    entry = latency_cache.load(name)
    lines: list[str] = []
    access = data_access(CalibrationSource(calibration_data))
    if entry is None and not access.rereadable:
        result = run_pipeline(source, output, plain, calibration_data, progress)
        result.summary.notes.append(Note(Topic.SEARCH, "latency plan not searched: it times the model on the "
                                         "calibration data, which must be readable more than once: "
                                         f"{refusal(access)}"))
        return result
    if entry is None:
        untimed = with_calibration(plain, measure_latency=False)
        base = run_pipeline(source, None, untimed, calibration_data, progress, keep_state=True)
        first, best, float_ms, trials = search(source, untimed, base, progress)
        entry = latency_cache.Entry(dataclasses.replace(best.config, calibration=plain.calibration), best.kept,
                                    float_ms, first.ms, best.ms)
        latency_cache.store(name, entry)
        lines = [t.line() for t in trials]
        cached = ""
    else:
        cached = f" (cached for this model, config, CPU and onnxruntime in {latency_cache.where()})"
    result = run_pipeline(source, output, entry.config, calibration_data, progress)
    result.summary.notes.append(Note(Topic.SEARCH, f"latency plan: {entry.describe()}{cached}"))
    result.summary.notes.extend(Note(Topic.SEARCH, f"latency plan tried: {line}") for line in lines)
    if result.summary.latency is None:
        result.summary.latency = Latency([Timing(b, entry.float_ms[b], entry.best_ms[b]) for b in sorted(entry.best_ms)],
                                         cpu_isa())
    return result
