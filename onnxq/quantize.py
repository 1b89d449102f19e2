"""`quantize()`: the whole pipeline, top to bottom — load, calibrate, optimise, emit, save."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.data import CalibrationSource, model_inputs
from onnxq.calibrate.ranges_io import load_ranges, save_ranges
from onnxq.calibrate.rescale import calibrate_deferred
from onnxq.calibrate.runner import CalibrationResult, observe
from onnxq.calibrate.shards import (
    count_batches,
    fingerprint,
    load_stats,
    model_digest,
    parse_shard,
    save_stats,
    shard_window,
)
from onnxq.calibrate.statistics import Statistic
from onnxq.config import Config, as_config, validate_node_configs
from onnxq.config.spec import EDGE_FIELDS, TENSOR_CLASSES, DType, QScheme, QuantFormat
from onnxq.emit import EmitResult, emit_model
from onnxq.emit.fidelity import check_outputs, samples_to_check
from onnxq.emit.float8_center import centering_requests
from onnxq.emit.loadcheck import UNLOADABLE, Trial, find_culprits, model_loads, open_deployed
from onnxq.errors import CalibrationDataError, ConfigError, UnsupportedModelError
from onnxq.graph.load import check_runnable, load_model
from onnxq.graph.quantized import describe, quantized_ops
from onnxq.graph.save import check_output_path, check_output_paths, save_model, weight_bytes
from onnxq.numerics.qmath import FLOAT_TARGETS, qdq_opset
from onnxq.optimize import (
    Deferred,
    PassContext,
    Rescale,
    algorithm_requests,
    check_config_entries,
    equalizing_algorithm,
    finish_deferred,
    run_algorithms,
    run_passes,
    without_another_read,
)
from onnxq.plan import Kind, QuantPlan, plan_quantization, provider_notes
from onnxq.plan.edges import apply_edges, with_edges
from onnxq.plan.params import WeightCache
from onnxq.report import Summary
from onnxq.target import TargetProfile, resolve_target

ModelSource = str | os.PathLike | onnx.ModelProto | ir.Model
DEFAULT_PRESET = "U8S8"


@dataclass
class PipelineState:
    """What emission started from, kept when asked (`keep_state`): the float model after
    the passes and calibration, and everything needed to emit it again under another
    config with the same ranges (a mixed-precision trial) or to analyse against it."""

    float_model: ir.Model
    ranges: dict[str, tuple[float, float]]
    statistics: dict[Statistic, Any]
    ctx: PassContext
    target: TargetProfile
    algorithms: list[dict[str, Any]]
    edges: list[str] = dataclasses.field(default_factory=list)  # the run's edge layers (`plan/edges.py`)

    def emit(self, config: Config) -> ir.Model:
        """The model emitted under `config` (node overrides of the original one) with the
        calibrated ranges: tensors the new plan needs but nobody calibrated stay float."""
        model = self.float_model.clone()
        # The run's edge layers, not recomputed: a trial's promotions to float would move them.
        config, _ = with_edges(config, model, self.edges)
        ctx = dataclasses.replace(self.ctx, statistics=dict(self.statistics),
                                  emission_statistics=dict(self.statistics), weights=WeightCache(),
                                  fitted_biases={})
        plan = plan_quantization(model, config, ctx.keep_float, self.target)
        missing = {n: spec for n, spec in plan.calibrated_tensors().items() if n not in self.ranges}
        if missing and ctx.data is not None and ctx.data.source is not None:
            # A tensor no plan calibrated before (the input of a node whose producer was
            # raised to float): calibrate it as a run of this config would.
            self.ranges.update(observe(model, missing, ctx.data, ctx.calibration, False).result().ranges)
        plan = _within_ranges(plan, self.ranges)
        plan, _ = run_algorithms(model, plan, self.ranges, self.algorithms, ctx)
        model, _, _ = _emit_loadable(model, plan, self.ranges, config, ctx, self.target, self.statistics)
        return model


@dataclass
class QuantizationResult:
    """The quantized model, the summary, and the calibrated range of every tensor."""

    ir_model: ir.Model
    summary: Summary
    ranges: dict[str, tuple[float, float]]
    plan: QuantPlan
    state: PipelineState | None = None

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        return ir.to_proto(self.ir_model)


def _size(source: Any, model: ir.Model) -> int:
    if isinstance(source, str | os.PathLike) and Path(source).is_file():
        return Path(source).stat().st_size
    return weight_bytes(model)


def required_opset(config: Config) -> int:
    """The ai.onnx opset the configured Q/DQ types need (13 with contrib Q/DQ allowed)."""
    if config.qdq_domain == "com.microsoft":
        return 13
    levels = [config.global_quant_config, *config.layer_type_quant_config.values(),
              *config.layer_quant_config.values()]
    specs = [getattr(level, tc) for level in levels for tc in TENSOR_CLASSES] + [getattr(config, key) for key in EDGE_FIELDS]
    opsets = [qdq_opset(s.dtype) for s in specs if s is not None and s.dtype is not None
              and DType(s.dtype) not in FLOAT_TARGETS | {DType.FLOAT32}]
    opsets += [21 for s in specs if s is not None and s.qscheme == QScheme.PER_GROUP]
    return max([*opsets, config.opset or 13])


def _load(source: ModelSource, config: Config, target: TargetProfile) -> tuple[ir.Model, Any]:
    """The model at the lowest opset its output needs. A whole-model opset conversion costs
    time and doubles peak memory (MiniLM: 1.0 s and 350 MB of a 3.5 s run), so the model
    is loaded as it is (at least opset 13, or `config.opset`) and loaded again, upgraded,
    only when the Q/DQ the plan writes need a newer opset: int4/int16/float8 tensors and
    blocks, but not the nodes lowered to contrib kernels (MatMulNBits,
    GatherBlockQuantized), whose weights W4_GROUP128 configures as int4 blocks."""
    model, report = load_model(source, config.opset or 13)
    already = quantized_ops(model)
    if already:
        raise UnsupportedModelError(
            f"{report.source} is already quantized ({describe(already)}); pass the float model "
            "(`onnxq convert --to float` gives a float one back from Q/DQ and QLinear models)")
    if required_opset(config) <= report.opset:
        return model, report
    need = plan_quantization(model, with_edges(config, model)[0], {}, target).required_opset()
    return (model, report) if need <= report.opset else load_model(source, need)


# Ranges beyond this come from masking sentinels (float min, -1e38): no integer grid can
# hold both them and the ordinary values, so such tensors stay float.
MAX_QUANTIZABLE_RANGE = 1e30


def _drop_unquantizable(plan: QuantPlan, ranges: dict[str, tuple[float, float]]) -> tuple[QuantPlan, list[str]]:
    """The plan without tensors whose range no integer grid can hold, and a note on them."""
    huge = {n for n, (lo, hi) in ranges.items() if max(abs(lo), abs(hi)) > MAX_QUANTIZABLE_RANGE}
    if not huge:
        return plan, []
    plan, dropped = plan.without(huge, f"calibrated range beyond +-{MAX_QUANTIZABLE_RANGE:g}")
    names = ", ".join(sorted(huge)[:3]) + (", ..." if len(huge) > 3 else "")
    return plan, [f"{len(dropped)} tensors kept in float: range beyond +-{MAX_QUANTIZABLE_RANGE:g} "
                  f"(masking constants such as float min): {names}"]


def _within_ranges(plan: QuantPlan, ranges: dict[str, tuple[float, float]]) -> QuantPlan:
    """A re-made plan without what `ranges` cannot quantize: unquantizable ranges and
    tensors nobody calibrated."""
    plan, _ = _drop_unquantizable(plan, ranges)
    missing = set(plan.calibrated_tensors()) - set(ranges)
    return plan.without(missing, "not calibrated")[0] if missing else plan


def _requests(model: ir.Model, plan: QuantPlan, algorithms: list[dict[str, Any]]) -> list[Statistic]:
    """Statistics the calibration pass collects besides ranges: the first algorithm's and
    the channel means that centre float8 activations at emission."""
    return list(dict.fromkeys([*algorithm_requests(model, plan, algorithms), *centering_requests(model, plan)]))


def _file_requests(model: ir.Model, plan: QuantPlan, algorithms: list[dict[str, Any]]) -> list[Statistic]:
    """The statistics that statistics files hold (`calibrate_shard`, `calibration.stats`):
    those of the first algorithm a run without data can run (`without_another_read`),
    whether or not the run reading the files also has data, so the two agree."""
    return _requests(model, plan, without_another_read(algorithms, "")[0])


def _calibrate_or_load(
    model: ir.Model, plan: QuantPlan, data: CalibrationSource, config: Config, progress: bool | None,
    algorithms: list[dict[str, Any]], deferred: Deferred | None, notes: list[str],
) -> CalibrationResult:
    """Calibrate (collecting in the same pass the statistics the first algorithm and a
    deferred pass ask for, then finishing that pass), or take ranges from
    `calibration.load_ranges`; save them if asked."""
    tensors = plan.calibrated_tensors()
    options = config.calibration
    digest = model_digest(model) if options.load_ranges or options.save_ranges else None
    if options.load_ranges:
        ranges, samples = load_ranges(options.load_ranges, list(tensors), digest)
        result = CalibrationResult(ranges, samples, 0, 0)
    elif options.stats:
        requests = _file_requests(model, plan, algorithms)
        if tensors or requests:
            result = load_stats(options.stats, model, tensors, requests, options).result()
        else:  # nothing left to calibrate (an accuracy target's all-float candidate)
            result = CalibrationResult({}, 0, 0, 0)
    elif deferred is not None:
        def finish(found: Mapping[Statistic, Any]) -> dict[str, Rescale]:
            note, rescaled = finish_deferred(model, deferred, found)
            notes.append(note)
            return rescaled

        requests = [*_requests(model, plan, algorithms), *deferred.statistics]
        result = calibrate_deferred(model, tensors, data, options, progress, requests, deferred.rescalable, finish)
    else:
        requests = _requests(model, plan, algorithms) if data.source is not None else []
        result = observe(model, tensors, data, options, progress, requests).result()
    if options.save_ranges:
        save_ranges(options.save_ranges, result.ranges, tensors, result.num_samples, digest)
    return result


def _algorithms(
    config: Config, target: TargetProfile, plan: QuantPlan, data: CalibrationSource, summary: Summary
) -> list[dict[str, Any]]:
    """The configured algorithms plus those the target adds for a static plan with
    quantized Conv/Gemm layers (bias correction), when the data can be read again."""
    algorithms = _correction_last(list(config.algo_config), summary)
    if data.source is not None and not data.replayable or data.source is None and config.calibration.stats:
        why = ("the calibration data can be read only once; pass a path, a dict of arrays, a list of feeds or a "
               "reader with rewind()" if data.source is not None else
               "it reads the calibration data itself, which statistics files do not hold; pass --calib-data "
               "as well (the same files still serve)")
        algorithms, notes = without_another_read(algorithms, why)
        summary.notes.extend(notes)
    wanted = config.target_algorithms and plan.calibrated_tensors()
    ops = set(plan.quantized_nodes.values())
    added = [a for a in (target.algorithms(algorithms) if wanted else []) if ops & set(a["op_types"])]
    # Alone (first), bias correction takes its statistics from the calibration pass; after
    # other algorithms it must read the data again.
    if added and not config.calibration.stats and (data.source is None or (algorithms and not data.replayable)):
        why = ("the calibration data can be read only once and other algorithms run first: pass a path, a "
               "dict of arrays, a list of feeds or a reader with rewind()" if data.source is not None else
               "there is no calibration data to measure it on (ranges loaded from a file): pass --calib-data")
        summary.notes.append(f"target {target.name} would add bias correction of the rounded weights' mean "
                             f"error, but {why}")
        return algorithms
    summary.notes.extend(f"target {target.name} adds {a['name']} ({', '.join(a['op_types'])}) to remove "
                         "the rounded weights' mean error per channel; target_algorithms: false turns it off"
                         for a in added)
    return algorithms + added


def _correction_last(algorithms: list[dict[str, Any]], summary: Summary) -> list[dict[str, Any]]:
    """The algorithms with bias correction after the others: it writes its correction into
    the float model's biases, so an algorithm after it (AdaRound, GPTQ, ...) would fit the
    quantized layers to a float model shifted by the nearest rounding's error."""
    enabled = [a for a in algorithms if a.get("enabled", True)]
    first = next((i for i, a in enumerate(enabled) if a.get("name") == "bias_correction"), None)
    later = [a["name"] for a in enabled[first + 1:] if a.get("name") != "bias_correction"] if first is not None else []
    if not later:
        return algorithms
    names = list(dict.fromkeys(later))
    they, s = ("it", "s") if len(names) == 1 else ("they", "")
    summary.notes.append(f"bias_correction runs after {', '.join(names)}: it removes the error {they} leave{s}, "
                         f"and its corrected biases would shift the float model {they} fit{s} to")
    return ([a for a in algorithms if a.get("name") != "bias_correction"]
            + [a for a in algorithms if a.get("name") == "bias_correction"])


def _with_equalization(
    model: ir.Model, config: Config, ctx: PassContext, target: TargetProfile, summary: Summary
) -> list[dict[str, Any]]:
    """The configured passes, plus cross-layer equalization where a layer-wise algorithm
    wants it (its `equalize` option) and no `cle` entry decides it already."""
    passes = list(config.pre_quant_opt_config)
    if any(p.get("name") == "cle" for p in passes) or equalizing_algorithm(config.algo_config, True) is None:
        return passes  # nothing would ask for it: no planning pass spent finding out
    plan = plan_quantization(model, config, ctx.keep_float, target)
    per_tensor = any(t.kind is Kind.WEIGHT and t.axis is None and not t.block_size
                     and any(plan.quantized_nodes.get(n) in ("Conv", "Gemm") for n, _ in t.consumers)
                     for t in plan.tensors.values())
    name = equalizing_algorithm(config.algo_config, per_tensor)
    if name is None:
        return passes
    summary.notes.append(f"{name} adds cle before calibration (per-tensor Conv/Gemm weights); "
                         "equalize: never, or a cle entry with enabled: false, turns it off")
    return [*passes, {"name": "cle"}]


def _emit_loadable(
    model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]], config: Config,
    ctx: PassContext, target: TargetProfile, statistics: Mapping[Statistic, Any],
) -> tuple[ir.Model, EmitResult, ort.InferenceSession | None]:
    """Emit, then open the result as a deployment would; if onnxruntime refuses it, keep
    the nodes responsible float (found by re-emitting from a copy) instead of writing it.
    Also returns the session that opened it (for the output check). `statistics`: the
    calibration pass's, measured before any algorithm ran (float8 centring)."""
    pristine = model.clone()
    emitted = emit_model(model, plan, ranges, config, ctx.weights, target.runs_on_cpu(), statistics)
    providers = config.calibration.providers
    session = open_deployed(model, providers)
    if session is not None:
        return model, emitted, session
    order = [node.name for node in pristine.graph if node.name in plan.quantized_nodes]

    def trial(kept: set[str]) -> Trial:
        copy = pristine.clone()
        keep = {**ctx.keep_float, **{name: UNLOADABLE for name in kept}}
        new_plan = _within_ranges(plan_quantization(copy, config, keep, target), ranges)
        result = emit_model(copy, new_plan, ranges, config, cpu=target.runs_on_cpu(), statistics=statistics)
        return Trial(copy, model_loads(copy, providers), result)

    final, culprits = find_culprits(order, trial)
    result = final.payload
    result.notes.append(f"{len(culprits)} nodes kept float because onnxruntime could not load them quantized: "
                        + ", ".join(culprits[:5]) + (", ..." if len(culprits) > 5 else ""))
    return final.model, result, open_deployed(final.model, providers)


def quantize(
    model: ModelSource,
    output: str | os.PathLike | None = None,
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    calibration_data: Any = None,
    *,
    progress: bool | None = None,
    evaluate: Any = None,
    report: str | os.PathLike | None = None,
) -> QuantizationResult:
    """Quantize `model` and, when `output` is given, save it there atomically.

    `calibration_data` is a path (.npz, .npy or a folder of them), a dict of arrays with
    samples on axis 0, an iterable of feed dicts, or a `CalibrationDataReader`.
    With `config.mixed_precision.target` set, the most sensitive layers are raised in
    precision until the model meets it (`onnxq.search`); `evaluate(session) -> float`
    scores a model for a `custom` target. `report`: write an HTML report there (per-layer
    error measured on the evaluation data, else the calibration data).
    """
    config = as_config(config)
    check_output_paths(model if isinstance(model, str | os.PathLike) else None, report,
                       config.calibration.save_ranges)
    keep = report is not None
    if config.mixed_precision.target is not None:
        from onnxq.search import quantize_to_target

        result = quantize_to_target(model, output, config, calibration_data, progress, evaluate, keep)
    elif evaluate is not None:
        raise ConfigError("evaluate= scores models for an accuracy target; set "
                          "mixed_precision.target too, e.g. 'custom>=float-0.5'")
    else:
        result = run_pipeline(model, output, config, calibration_data, progress, keep_state=keep)
    if report is not None:
        from onnxq.analyze.quantized import report_quantization

        data = config.mixed_precision.eval_data or calibration_data
        report_quantization(report, result, config, data, progress)
    return result


@dataclass
class Prepared:
    """The model after load and the pre-quantization passes, with its plan: what
    calibration starts from (one run, or each calibration shard)."""

    model: ir.Model
    plan: QuantPlan
    algorithms: list[dict[str, Any]]
    target: TargetProfile
    ctx: PassContext
    data: CalibrationSource
    summary: Summary
    config: Config  # the config as this model resolves it (edge layers' specs applied)
    edges: list[str]  # the layers `edge_weight` and `edge_input` apply to


def prepare(source: ModelSource, config: Config, calibration_data: Any, progress: bool | None,
            deferrable: bool) -> Prepared:
    """Stage 1 (load) and the passes of stage 3 that run before calibration."""
    check_config_entries(config.pre_quant_opt_config, config.algo_config)
    data = CalibrationSource(calibration_data)
    ctx = PassContext(data, config.calibration, progress, deferrable=deferrable, qdq_domain=config.qdq_domain,
                      extended=config.quant_format == QuantFormat.QDQ_EXT)
    summary = Summary()
    target = resolve_target(config)
    summary.target = target.describe()
    with summary.stage("load"):
        ir_model, loaded = _load(source, config, target)
    summary.source, summary.opset = loaded.source, (loaded.original_opset, loaded.opset)
    summary.notes.extend(loaded.notes)
    summary.size_before = _size(source, ir_model)
    check_runnable(ir_model, loaded.source)
    validate_node_configs(config, [(n.name, n.op_type) for n in ir.traversal.RecursiveGraphIterator(ir_model.graph)])
    config, edges, note = apply_edges(config, ir_model)
    summary.notes.extend([note] if note else [])

    with summary.stage("optimise"):
        passes = _with_equalization(ir_model, config, ctx, target, summary)
        summary.notes.extend(run_passes(ir_model, passes, ctx))
        plan = plan_quantization(ir_model, config, ctx.keep_float, target)
        algorithms = _algorithms(config, target, plan, data, summary)
    return Prepared(ir_model, plan, algorithms, target, ctx, data, summary, config, edges)


def run_pipeline(
    model: ModelSource,
    output: str | os.PathLike | None,
    config: Config,
    calibration_data: Any,
    progress: bool | None = None,
    keep_state: bool = False,
) -> QuantizationResult:
    """Load, optimise, calibrate, emit and save: the pipeline for one config.

    `keep_state`: also return what emission started from (`PipelineState`).
    """
    if output is not None:
        check_output_path(output, model if isinstance(model, str | os.PathLike) else None)
    options = config.calibration
    ready = prepare(model, config, calibration_data, progress,
                    deferrable=not options.load_ranges and not options.stats)
    config = ready.config
    ir_model, plan, algorithms, target, ctx, data, summary = (
        ready.model, ready.plan, ready.algorithms, ready.target, ready.ctx, ready.data, ready.summary)
    float_bytes = max(weight_bytes(ir_model), summary.size_before)  # external data included

    with summary.stage("calibrate"):
        calibration = _calibrate_or_load(ir_model, plan, data, config, progress, algorithms, ctx.deferred,
                                         summary.notes)
    ctx.statistics = calibration.statistics
    ctx.emission_statistics = calibration.statistics
    summary.calibration_samples = calibration.num_samples
    summary.calibrated_tensors = len(calibration.ranges)
    summary.calibration_passes = calibration.num_passes
    if data.ignored:
        summary.notes.append(f"calibration data: left out {', '.join(sorted(data.ignored))} (no model input)")
    plan, notes = _drop_unquantizable(plan, calibration.ranges)
    summary.notes.extend(notes)
    summary.notes.extend(provider_notes(config.calibration.providers, plan))

    state = None
    if keep_state:
        state = PipelineState(ir_model.clone(), dict(calibration.ranges), dict(calibration.statistics),
                              dataclasses.replace(ctx), target, algorithms, ready.edges)
    with summary.stage("optimise"):
        plan, notes = run_algorithms(ir_model, plan, calibration.ranges, algorithms, ctx)
    summary.notes.extend(notes)

    with summary.stage("emit"):
        ir_model, emitted, session = _emit_loadable(ir_model, plan, calibration.ranges, config, ctx, target,
                                                    calibration.statistics)
    samples, note = samples_to_check(options.check_samples, float_bytes, data)
    summary.notes.extend([note] if note else [])
    if session is not None and samples:
        with summary.stage("check"):
            checked = check_outputs(model, model_inputs(ir_model), session, data, samples, options.providers)
        if isinstance(checked, str):
            summary.notes.append(checked)
        elif checked is not None:
            summary.fidelity = checked
    del session
    plan = emitted.plan
    summary.quantized_by_op = dict(sorted(Counter(plan.quantized_nodes.values()).items()))
    summary.float_nodes = plan.float_nodes
    summary.fused_activations = len(emitted.qdq.removed_activations)
    summary.kept_activations = emitted.qdq.kept_activations
    summary.float_biases = emitted.qdq.float_biases
    summary.notes.extend(emitted.notes)

    if output is not None:
        with summary.stage("save"):
            summary.output = str(save_model(ir_model, output))
    summary.size_after = _size(output, ir_model) if output is not None else weight_bytes(ir_model)
    if not summary.quantized_by_op and summary.size_after > 0.95 * summary.size_before:
        summary.notes.append("warning: nothing was quantized: every node stayed float (see 'left in float'); "
                             "pick a recipe that covers this model's ops (U8S8 for convolutions; W8_DYNAMIC "
                             "and W4_GROUP128 quantize MatMul/Gemm only)")
    return QuantizationResult(ir_model, summary, calibration.ranges, plan, state)


def _calibration_requests(ready: Prepared) -> tuple[dict[str, Any], list[Statistic]]:
    """The tensors to observe and the statistics to collect, as a run of this config does
    (without a deferred pass: shards and `--stats` runs finish every pass up front), for
    the algorithms a run from the files can run (`without_another_read`: it has no data)."""
    tensors, statistics = ready.plan.calibrated_tensors(), _file_requests(ready.model, ready.plan, ready.algorithms)
    if not tensors and not statistics:
        raise ConfigError("this config takes nothing from the data in the calibration pass (weight-only, or "
                          "algorithms that read the data themselves such as gptq with true_sequential), so "
                          "shards would be empty: quantize with --calib-data instead")
    return tensors, statistics


@dataclass
class ShardResult:
    """What `calibrate_shard` wrote."""

    path: Path
    window: tuple[int, int]
    total_batches: int
    num_samples: int


def calibrate_shard(
    model: ModelSource,
    stats: str | os.PathLike,
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    calibration_data: Any = None,
    shard: tuple[int, int] | str = (0, 1),
    *,
    progress: bool | None = None,
) -> ShardResult:
    """Calibrate shard `shard` = (index, count) (or 'i/n', 1-based) of the data: its
    contiguous stretch of the calibration batches. Writes the observers' and statistics'
    state to `stats` (.npz); `quantize` with `calibration.stats` = every shard's file gives
    the model a single run over all the data gives, byte for byte
    (`onnxq.calibrate.shards`)."""
    config = _calibration_config(as_config(config))
    index, count = parse_shard(shard) if isinstance(shard, str) else shard
    if not 0 <= index < count:
        raise ConfigError(f"shard index {index} is outside 0..{count - 1}")
    if config.calibration.stats or config.calibration.load_ranges:
        raise ConfigError("calibrating a shard computes statistics; drop calibration.stats / load_ranges")
    if calibration_data is None:
        raise CalibrationDataError("calibrating a shard needs calibration data; pass --calib-data PATH")
    ready = prepare(model, config, calibration_data, progress, deferrable=False)
    tensors, statistics = _calibration_requests(ready)
    total = count_batches(ready.model, ready.data, config.calibration)
    window = shard_window(index, count, total)
    state = observe(ready.model, tensors, ready.data, config.calibration, progress, statistics, window)
    path = save_stats(stats, state, fingerprint(ready.model, tensors, statistics, config.calibration), window, total)
    return ShardResult(path, window, total, state.num_samples)


def _calibration_config(config: Config) -> Config:
    """With an accuracy target, the statistics are those of the search's first model
    (`search.driver.search_base_config`: its opset), so `quantize --stats` finds them."""
    if config.mixed_precision.target is None:
        return config
    from onnxq.search.driver import search_base_config

    return search_base_config(config)


class ModelQuantizer:
    """Quark-style entry point: `ModelQuantizer(config).quantize_model(in, out, reader)`."""

    def __init__(self, config: Config | Mapping[str, Any] | str | None = None) -> None:
        self.config = as_config(config)

    def quantize_model(
        self, model_input: ModelSource, model_output: str | os.PathLike | None = None,
        calibration_data_reader: Any = None,
    ) -> QuantizationResult:
        return quantize(model_input, model_output, self.config, calibration_data_reader)


def _absolute(source: Any) -> Any:
    """Paths made absolute, so a worker with another working directory finds them."""
    return str(Path(source).resolve()) if isinstance(source, str | os.PathLike) else source


def calibrate_sharded(
    model: ModelSource,
    stats: str | os.PathLike,
    config: Config | Mapping[str, Any] | str | os.PathLike | None = None,
    calibration_data: Any = None,
    shards: int = 2,
    executor: str = "process",
    address: str | None = None,
    *,
    progress: bool | None = None,
) -> ShardResult:
    """Calibrate `shards` shards in parallel on `executor` ('process': local processes;
    'ray': Ray tasks, on the cluster at `address` or a local instance) and write their
    merged statistics to `stats`, for `quantize` with `calibration.stats`."""
    import tempfile

    from onnxq.calibrate.executors import run_shards, write_all

    config = _calibration_config(as_config(config))
    if calibration_data is None:
        raise CalibrationDataError("calibration needs data; pass --calib-data PATH")
    model, calibration_data = _absolute(model), _absolute(calibration_data)
    ready = prepare(model, config, calibration_data, progress, deferrable=False)
    tensors, statistics = _calibration_requests(ready)
    parts = run_shards(executor, model if not isinstance(model, ir.Model) else ir.to_proto(model), config,
                       calibration_data, shards, address)
    with tempfile.TemporaryDirectory(prefix="onnxq-shards-") as folder:
        state = load_stats(write_all(parts, folder), ready.model, tensors, statistics, config.calibration)
    total = state.num_batches
    path = save_stats(stats, state, fingerprint(ready.model, tensors, statistics, config.calibration), (0, total),
                      total)
    return ShardResult(path, (0, total), total, state.num_samples)
