"""Everything before calibration: load the model at the opset its output needs (stage 1),
run the pre-quantization passes, plan, and pick the algorithms; the summary starts here.
What calibration starts from, for one run or for each calibration shard."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from onnxq.calibrate.data import CalibrationSource
from onnxq.calibrate.decoder import DECODE_STEPS, DecoderFeeds, decoder_feeds, is_decoder
from onnxq.config import validate_node_configs
from onnxq.config.resolve import written_dtype
from onnxq.config.spec import (
    LAYER_CLASS_FIELDS,
    TENSOR_CLASSES,
    Config,
    DType,
    QScheme,
    QuantFormat,
)
from onnxq.errors import ConfigError, UnsupportedModelError
from onnxq.graph.folder import on_disk_bytes
from onnxq.graph.load import LoadReport, check_runnable, load_model
from onnxq.graph.quantized import describe, quantized_ops
from onnxq.graph.save import weight_bytes
from onnxq.graph.upcast import Upcast
from onnxq.notes import Note, Topic, notes
from onnxq.numerics.qmath import FLOAT_TARGETS, is_float8, qdq_opset
from onnxq.optimize.context import Deferred, RunSettings
from onnxq.optimize.registry import Entry, parse_algorithms, parse_passes
from onnxq.optimize.runner import run_passes
from onnxq.pipeline.algorithms import configured_algorithms, with_equalization
from onnxq.plan import QuantPlan, plan_quantization
from onnxq.plan.edges import apply_edges, with_edges
from onnxq.report import Summary
from onnxq.target import TargetProfile, resolve_target

ModelSource = str | os.PathLike | onnx.ModelProto | ir.Model


def _levels(config: Config) -> list[Any]:
    return [config.global_quant_config, *config.layer_type_quant_config.values(), *config.layer_quant_config.values()]


def _specs(config: Config) -> list[Any]:
    """Every tensor spec the config sets, at any level, layer classes included."""
    specs = [getattr(level, tc) for level in _levels(config) for tc in TENSOR_CLASSES]
    return [s for s in specs + [getattr(config, key) for key in LAYER_CLASS_FIELDS] if s is not None]


def required_opset(config: Config) -> int:
    """The ai.onnx opset the configured Q/DQ types need (13 with contrib Q/DQ allowed)."""
    if config.qdq_domain == "com.microsoft":
        return 13
    specs = _specs(config)
    dtypes = [written_dtype(s) for s in specs]  # by name or by exponent and mantissa bits
    opsets = [qdq_opset(d) for d in dtypes if d is not None and d not in FLOAT_TARGETS | {DType.FLOAT32}]
    opsets += [21 for s in specs if s.qscheme == QScheme.PER_GROUP]
    return max([*opsets, config.opset or 13])


# Kernels that already hold quantized weights and can stay as they are around the float
# ops quantized now (an onnxruntime-genai model whose LM head or embedding the builder left
# in int4): the nodes stay, and the rest of the model is quantized.
KEPT_KERNELS = frozenset({"MatMulNBits", "GatherBlockQuantized"})
ALREADY_QUANTIZED = "already quantized"  # how `keep_float` names the kernels it keeps


def _already_quantized(model: ir.Model, name: str) -> dict[str, str]:
    """The nodes kept as they are (`KEPT_KERNELS`), with their op types; any other sign of
    a quantized model is refused (quantizing it again would quantize twice)."""
    already = quantized_ops(model)
    if already and not set(already) <= KEPT_KERNELS:
        raise UnsupportedModelError(
            f"{name} is already quantized ({describe(already)}); pass the float model "
            "(`onnxq convert --to float` gives a float one back from Q/DQ and QLinear models)")
    return {node.name: node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type in already}


def _load(source: ModelSource, config: Config, target: TargetProfile) -> tuple[ir.Model, LoadReport, dict[str, str]]:
    """The model at the lowest opset its output needs. A whole-model opset conversion costs
    time and doubles peak memory (MiniLM: 1.0 s and 350 MB of a 3.5 s run), so the model
    is loaded as it is (at least opset 13, or `config.opset`) and loaded again, upgraded,
    only when the Q/DQ the plan writes need a newer opset: int4/int16/float8 tensors and
    blocks, but not the nodes lowered to contrib kernels (MatMulNBits,
    GatherBlockQuantized), whose weights W4_GROUP128 configures as int4 blocks.

    A float16/bfloat16 model is made float32 inside where the recipe needs it
    (`wants_float32`)."""
    upcast = functools.partial(wants_float32, config)
    model, report = load_model(source, config.opset or 13, upcast)
    kept = _already_quantized(model, report.source)
    if config.qdq_domain == "com.microsoft":
        _check_contrib(model, config, target, report.opset)
    if required_opset(config) <= report.opset:
        return model, report, kept
    need = plan_quantization(model, with_edges(config, model)[0], {}, target).required_opset()
    if need <= report.opset:
        return model, report, kept
    model, report = load_model(source, need, upcast)
    return model, report, _already_quantized(model, report.source)


# Passes whose rewrite keeps the model's float outputs (to float32 rounding): the
# calibration model's outputs then serve as the output check's float reference.
FUNCTION_PRESERVING = frozenset({"fold_batchnorm", "cle", "smoothquant"})


def preserves_function(entry: Entry) -> bool:
    """Whether the pass `entry` keeps the float outputs: not CLE's `relu6_to_relu` (it
    changes them on purpose), nor any pass a plugin registers."""
    return entry.name in FUNCTION_PRESERVING and not getattr(entry.options, "relu6_to_relu", False)


def wants_float32(config: Config, model: ir.Model) -> bool:
    """Whether a float16/bfloat16 `model` is quantized as float32 inside (`graph/upcast.py`):
    where the recipe writes integer or float8 Q/DQ, whose scales and onnxruntime's int8
    kernels are float32's. Not under float16/bfloat16 recipes alone (the model is half
    already), nor for a KV-cache decoder under a weight-only MatMulNBits recipe: its kernels
    take half activations as they are, and a genai folder built for a GPU runs attention
    kernels there that take float16 only."""
    if not {written_dtype(s) for s in _specs(config)} - FLOAT_TARGETS - {DType.FLOAT32, None}:
        return False
    weight_only = not any(s is not None and s.dtype not in (None, DType.FLOAT32)
                          for level in _levels(config) for s in (level.input_tensors, level.output_tensors))
    return not (config.matmul_nbits and weight_only and is_decoder(v.name for v in model.graph.inputs))


def _check_contrib(model: ir.Model, config: Config, target: TargetProfile, opset: int) -> None:
    """Refuse what onnxruntime's contrib QuantizeLinear/DequantizeLinear cannot write at the
    model's opset: blocks (no block_size attribute) and float8 types (no saturate). Planned
    anyway, such tensors fell back to float, a run with nothing quantized and exit 0."""
    plan = plan_quantization(model, with_edges(config, model)[0], {}, target)
    needs = [("blocks (per_group weights)", 21, "per-channel weights", any(t.block_size for t in plan.tensors.values())),
             ("float8 types", 19, "integer types", any(is_float8(s.dtype) for s in plan.specs()))]
    missing = [(what, need, other) for what, need, other, used in needs if used and need > opset]
    if missing:
        raise ConfigError(f"qdq_domain com.microsoft: onnxruntime's contrib QuantizeLinear/DequantizeLinear have no "
                          f"{' and '.join(m[0] for m in missing)}, and the model is at opset {opset}; use qdq_domain "
                          f"ai.onnx (the model is upgraded to opset {max(m[1] for m in missing)}), or "
                          f"{' and '.join(m[2] for m in missing)}")


def calibrates_activations(config: Config) -> bool:
    """Whether some level of the config quantizes activations statically (not weight-only
    or dynamic)."""
    return any(spec is not None and not spec.is_dynamic and spec.dtype not in (None, DType.FLOAT32)
               for level in _levels(config) for spec in (level.input_tensors, level.output_tensors))


def source_size(source: Any, model: ir.Model) -> int:
    """The size of the model as given: its file with the external data files it names,
    else its weights."""
    if isinstance(source, str | os.PathLike) and Path(source).is_file():
        return on_disk_bytes(source)
    return weight_bytes(model)


WINDOWS_NOTE = "token windows"  # the source of the note describing a decoder's calibration windows


@dataclass(frozen=True)
class Prepared:
    """The model after load and the pre-quantization passes, with its plan: what
    calibration starts from (one run, or each calibration shard)."""

    model: ir.Model
    plan: QuantPlan
    algorithms: tuple[Entry, ...]
    target: TargetProfile
    settings: RunSettings
    keep_float: Mapping[str, str]  # nodes that stay float: kernels already quantized, those the passes made
    deferred: Deferred | None  # the last pass's data-dependent half, for the calibration pass
    summary: Summary
    config: Config  # the config as this model resolves it (edge layers' specs applied)
    edges: list[str]  # the layers `edge_weight` and `edge_input` apply to
    upcast: Upcast | None = None  # a float16/bfloat16 model made float32 inside at load
    same_function: bool = True  # every pass that ran keeps the model's float outputs (`preserves_function`)


def prepare(source: ModelSource, config: Config, calibration_data: Any, progress: bool | None,
            deferrable: bool) -> Prepared:
    """Load, run the passes before calibration, plan and pick the algorithms.
    `deferrable`: calibration follows on the data, so the last pass may defer its
    data-dependent half to it."""
    # The configured passes and algorithms, parsed once (and before the model loads: a
    # misspelt option fails at once).
    passes, configured = parse_passes(config.pre_quant_opt_config), parse_algorithms(config.algo_config)
    # Token windows for a KV-cache decoder become feeds of every input, prefill and decode
    # steps (`calibrate/decoder.py`).
    data = decoder_feeds(source, calibration_data, config.calibration.providers,
                         DECODE_STEPS if calibrates_activations(config) else 0)
    settings = RunSettings(CalibrationSource(data), config.calibration, progress, config.qdq_domain,
                           config.quant_format == QuantFormat.QDQ_EXT)
    summary = Summary()
    target = resolve_target(config)
    summary.target = target.describe()
    with summary.stage("load"):
        model, loaded, kept = _load(source, config, target)
    summary.source, summary.opset = loaded.source, (loaded.original_opset, loaded.opset)
    summary.notes.extend(notes(Topic.LOAD, loaded.notes))
    if config.opset is not None and loaded.opset > max(config.opset, loaded.original_opset):
        summary.notes.append(Note(Topic.LOAD, f"opset {loaded.opset}, not the {config.opset} asked (opset is the "
                                  f"lowest): the quantized types need it (int16, int4 and blocks need 21, float8 19); "
                                  "qdq_domain com.microsoft keeps an older opset where onnxruntime's contrib Q/DQ take "
                                  "the types"))
    if isinstance(data, DecoderFeeds):
        steps = (f"a prefill and {data.decode_steps} decode steps with the KV cache the float model computes"
                 if data.decode_steps else "a prefill (weight-only: decode steps would add time, not accuracy)")
        given, cap = len(data.windows), config.calibration.max_samples
        used = given if cap is None else min(given, -(-cap // (data.decode_steps + 1)))  # a feed is a sample
        count = f"{used} of {given} token windows (max_samples {cap})" if used < given else f"{given} token windows"
        summary.notes.append(Note(Topic.CALIBRATION, f"calibration data: {count} of {data.windows.shape[1]} tokens, "
                                  f"each {steps}", source=WINDOWS_NOTE))
    summary.size_before = source_size(source, model)
    check_runnable(model, loaded.source)
    if kept:
        ops = describe(Counter(kept.values()))
        summary.notes.append(Note(Topic.FLOAT, f"already quantized: {ops}; left as they are, the rest quantized",
                                  tuple(kept)))
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    weighted = {n.name for n in nodes if any(v is not None and v.const_value is not None for v in n.inputs[1:])}
    validate_node_configs(config, [(n.name, n.op_type) for n in nodes], weighted)
    config, edges, said = apply_edges(config, model)
    summary.notes.extend(Note(Topic.CONFIG, text, layers) for text, layers in said)

    with summary.stage("optimise"):
        passes, added = with_equalization(model, config, passes, configured, target)
        summary.notes.extend(added)
        done = run_passes(model, passes, settings, deferrable)
        summary.notes.extend(done.notes)
        keep_float = {**{name: f"{ALREADY_QUANTIZED} ({op}): left as it is" for name, op in kept.items()},
                      **(loaded.upcast.keep_float() if loaded.upcast is not None else {}), **done.keep_float}
        plan = plan_quantization(model, config, keep_float, target)
        algorithms, decided = configured_algorithms(config, configured, target, plan, settings.access)
        summary.notes.extend(decided)
    return Prepared(model, plan, algorithms, target, settings, keep_float, done.deferred, summary, config, edges,
                    loaded.upcast, all(preserves_function(p) for p in passes if p.enabled))
