"""`run_pipeline`: one config, stage by stage — prepare (load, passes, plan), calibrate,
the algorithms, emit, check, save — each stage's result handed to the next, and the
summary completed here from those results."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from onnxq.calibrate.data import CalibrationSource, model_inputs
from onnxq.calibrate.inputs import whole_feeds_note
from onnxq.config.spec import Config
from onnxq.emit.fidelity import check_outputs, samples_to_check
from onnxq.emit.latency import measure_latency
from onnxq.emit.loadcheck import prepacks
from onnxq.errors import ConfigError
from onnxq.graph.save import check_output_path, save_model, weight_bytes
from onnxq.graph.selection import selected_outputs
from onnxq.notes import Note, Topic, notes
from onnxq.optimize.registry import fits_data, parse_passes
from onnxq.optimize.runner import run_algorithms
from onnxq.pipeline.calibration import calibrate_or_load, constant_inputs_note, drop_unquantizable
from onnxq.pipeline.emission import emit_loadable, layer_biases, trial_emitter
from onnxq.pipeline.prepare import ALREADY_QUANTIZED, ModelSource, prepare, source_size
from onnxq.pipeline.result import PipelineState, QuantizationResult
from onnxq.plan import provider_notes
from onnxq.plan.kept_clips import clip_safe_ranges
from onnxq.plan.kernel_pairs import float_inputs_note
from onnxq.plan.strategies.matmul_nbits import refused_note
from onnxq.plan.strategies.static import coarser_note
from onnxq.plan.unused_overrides import WEIGHTED_OPS, unused_override_notes
from onnxq.report import Summary
from onnxq.sessions import imports_extended


def run_pipeline(
    source: ModelSource,
    output: str | os.PathLike | None,
    config: Config,
    calibration_data: Any,
    progress: bool | None = None,
    keep_state: bool = False,
) -> QuantizationResult:
    """Load, optimise, calibrate, emit and save: the pipeline for one config.

    `source`: the model as given (path, proto or onnx-ir model), which the output check
    runs in float; `model`, below, is the loaded one the stages rewrite. `keep_state`: also
    return what emission started from (`PipelineState`).
    """
    if output is not None:
        check_output_path(output, source if isinstance(source, str | os.PathLike) else None)
    options = config.calibration
    _passes_read_data(config, calibration_data)
    ready = prepare(source, config, calibration_data, progress,
                    deferrable=not options.load_ranges and not options.stats)
    config, model, plan, settings, summary = ready.config, ready.model, ready.plan, ready.settings, ready.summary
    float_bytes = max(weight_bytes(model), summary.size_before)  # external data included
    files = "statistics files" if options.stats else "a ranges file" if options.load_ranges else None
    samples, note = samples_to_check(options.check_samples, float_bytes, settings.data, files, summary.size_before)

    with summary.stage("calibrate"):
        capture = samples if ready.same_function else 0  # else the check opens the user's model
        calibration, finished = calibrate_or_load(model, plan, settings, ready.algorithms, ready.deferred, capture)
    summary.notes.extend(finished)
    summary.calibration_samples = calibration.num_samples
    summary.calibrated_tensors = len(calibration.ranges)
    summary.calibration_passes = calibration.num_passes
    if settings.data.ignored:
        left_out = tuple(sorted(settings.data.ignored))
        summary.notes.append(Note(Topic.CALIBRATION, f"calibration data: left out {', '.join(left_out)} "
                                  "(no model input)", left_out))
    if settings.data.whole:
        summary.notes.append(Note(Topic.CALIBRATION, whole_feeds_note(model_inputs(model))))
    plan, dropped = drop_unquantizable(plan, calibration.ranges)
    summary.notes.extend(dropped)
    ranges, widened = clip_safe_ranges(model, plan, calibration.ranges)
    calibration = dataclasses.replace(calibration, ranges=ranges)
    summary.notes.extend(widened)
    if (constant := constant_inputs_note(model, calibration.ranges)) is not None:
        summary.notes.append(constant)
    summary.notes.extend(unused_override_notes(model, plan, config))
    summary.notes.extend(notes(Topic.PROVIDER, provider_notes(config.calibration.providers, plan)))
    if (refused := refused_note(plan, config)) is not None:
        summary.notes.append(refused)
    if (coarser := coarser_note(plan)) is not None:
        summary.notes.append(coarser)

    state = None
    if keep_state:
        state = PipelineState(model.clone(), dict(calibration.ranges), dict(calibration.statistics), settings,
                              dict(ready.keep_float), ready.target, ready.algorithms, list(ready.edges))
    biases = layer_biases(model, plan)  # as they were, for a layer that has to stay float after all
    with summary.stage("optimise"):
        done = run_algorithms(model, plan, calibration.ranges, ready.algorithms, settings,
                              trial_emitter(settings, calibration.statistics), calibration.statistics)
    summary.notes.extend(done.notes)
    summary.fitted_by = tuple(e.name for e in ready.algorithms if e.enabled and fits_data(e.name)
                              and e.name not in done.idle)

    with summary.stage("emit"):
        model, emitted, session, kept = emit_loadable(model, done.plan, calibration.ranges, config, done.weights,
                                                   ready.keep_float, ready.target, calibration.statistics,
                                                   prepacks(float_bytes, samples > 0), biases, ready.upcast)
    summary.notes.extend(notes(Topic.CHECK, [note] if note else []))
    if session is not None and samples:
        with summary.stage("check"):
            checked = check_outputs(source, model_inputs(model), session, settings.data, samples,
                                    options.providers, imports_extended(model), calibration.outputs,
                                    selected_outputs(model.graph))
        if isinstance(checked, str):
            summary.notes.append(Note(Topic.CHECK, checked))
        elif checked is not None:
            summary.fidelity = dataclasses.replace(checked, fitted_by=summary.fitted_by)
    serialized = getattr(session, "_onnxq_message", None)  # the bytes the load check opened: saved as they are
    del session
    plan = emitted.plan
    summary.quantized_by_op = dict(sorted(Counter(plan.integer_nodes().values()).items()))
    summary.float_weight_nodes = plan.float_weight_nodes()
    summary.float_nodes = plan.float_nodes
    summary.fused_activations = len(emitted.qdq.removed_activations)
    summary.kept_activations = emitted.qdq.kept_activations
    summary.float_biases = emitted.qdq.float_biases
    if (relaxed := float_inputs_note(plan)) is not None:
        summary.notes.append(relaxed)
    summary.notes.extend(notes(Topic.EMISSION, emitted.notes))
    summary.notes.extend(kept)

    write_output(summary, source, model, output, data=settings.data, providers=options.providers,
                 measure_latency=options.measure_latency, serialized=serialized)
    already = sum(why.startswith(ALREADY_QUANTIZED) for why in ready.keep_float.values())
    # no node quantized and no weight cast to a smaller float type (FP16 halves them): a
    # rewritten graph alone moves a small model's size by a few percent (digits: 95%)
    unchanged = not summary.quantized_by_op and summary.size_after > 0.9 * summary.size_before
    if unchanged and already:
        summary.notes.append(Note(Topic.WARNING, f"warning: nothing more was quantized: the model is already "
                                  f"quantized ({already} quantized kernels left as they are); quantize the float "
                                  "model instead"))
    elif unchanged and plan.nodes_for("float_target"):  # a float cast (FP16, BF16) of a model without float32 ops
        summary.notes.append(Note(Topic.WARNING, "warning: nothing was converted: no op of the model computes in "
                                  "float32 (see the float cast note)"))
    elif unchanged:
        summary.notes.append(Note(Topic.WARNING, nothing_quantized(model, summary.float_nodes)))
    return QuantizationResult(model, summary, calibration.ranges, plan, state)


def nothing_quantized(model: ir.Model, float_nodes: Mapping[str, tuple[str, str]]) -> str:
    """The warning for a run that quantized nothing, with what would: another recipe where
    the model has a layer one quantizes, float32 weights where its layers' are double,
    nothing where it has no such layer (a tree ensemble, a linear classifier)."""
    see = " (see 'left in float')" if float_nodes else ""
    said = f"warning: nothing was quantized: every node stayed float{see}; "
    if not any(node.domain in ("", "ai.onnx") and node.op_type in WEIGHTED_OPS for node in model.graph):
        return said + (f"the model has no layer onnxq quantizes ({', '.join(sorted(WEIGHTED_OPS))}), so no recipe "
                       "makes it smaller or faster")
    if any("is double" in why for _, why in float_nodes.values()):
        return said + "its layers' weights are double: export the model in float32"
    return said + ("pick a recipe that covers this model's ops (U8S8, the default, for convolutions; W8_DYNAMIC "
                   "quantizes MatMul, Gemm and LSTM only)")


def _passes_read_data(config: Config, calibration_data: Any) -> None:
    """A pass that picks its scales from the data (SmoothQuant) with statistics files and
    no data: refused with the fix, where the pass had been skipped and the files then
    refused as "calibrated for another model" (determinism trial)."""
    if not config.calibration.stats or calibration_data is not None:
        return
    reading = [e.name for e in parse_passes(config.pre_quant_opt_config) if e.enabled and e.contract.data == "required"]
    if reading:
        raise ConfigError(f"{', '.join(reading)} picks its scales from the calibration data, which the statistics "
                          "files do not hold: pass calibration_data beside the statistics files")


def write_output(summary: Summary, source: ModelSource, model: Any, output: str | os.PathLike | None, *,
                 data: CalibrationSource, providers: list[str], measure_latency: bool,
                 serialized: bytes | None = None) -> None:
    """Save `model` to `output` (none: kept in memory; `serialized`: its bytes, where the
    load check's session serialized it whole), time it against `source` where asked, and
    record its size (external data included): how a run ends, a search that keeps its
    first model included."""
    if output is not None:
        with summary.stage("save"):
            summary.output = str(save_model(model, output, serialized))
    if measure_latency:
        with summary.stage("latency"):
            record_latency(summary, source, model, data, providers)
    summary.size_after = source_size(output, model) if output is not None else weight_bytes(model)


def record_latency(summary: Summary, source: ModelSource, model: Any, data: CalibrationSource,
                   providers: list[str]) -> None:
    """Time `source` against the quantized `model` (`emit/latency.py`) into the summary,
    or a note saying why it could not be timed."""
    timed = measure_latency(source, model, model_inputs(model), data, providers)
    if isinstance(timed, str):
        summary.notes.append(Note(Topic.CHECK, timed))
    else:
        summary.latency = timed
