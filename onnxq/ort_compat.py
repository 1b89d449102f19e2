"""onnxruntime.quantization's entry points, run by onnxq: a script written for
onnxruntime's quantizer changes one import line.

    from onnxq.ort_compat import quantize_static   # was: from onnxruntime.quantization import ...
    quantize_static("model.onnx", "model.int8.onnx", reader, per_channel=True)

`quantize(model_input, model_output, quant_config)` takes onnxruntime's StaticQuantConfig or
DynamicQuantConfig as its own `quantize` does.

The arguments keep onnxruntime's names, defaults and enums (or the enums' names as
strings); what each means in onnxq is `config/ort_options.py`'s table, and `ort_config`
returns the `Config` they resolve to (to save as YAML for the CLI, or to extend with
onnxq's own settings). Where onnxq differs it says so: a name in nodes_to_exclude that is
no node of the model is an error (onnxruntime ignores it), options without a counterpart
are one-line errors naming what to use, and options onnxq needs no counterpart for are
named in the summary's notes. The model is onnxq's: bias correction, exact or pair-safe
int8 scales for the CPU at hand, the output check against float.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import onnx

from onnxq.config import Config, compose_config
from onnxq.config.ort_options import NO_EFFECT, OrtArguments, ort_overrides
from onnxq.errors import ConfigError, OnnxqError, renamed
from onnxq.graph.load import graph_structure
from onnxq.notes import Note, Topic, renamed_notes
from onnxq.quantize import READER_NAMES, QuantizationResult
from onnxq.quantize import quantize as onnxq_quantize

ModelInput = str | os.PathLike | onnx.ModelProto


def _index(model: ModelInput) -> tuple[list[tuple[str, str]], set[str]]:
    """Every node's (name, op type) (main graph; unnamed ones with ""), and the MatMuls
    whose B is a constant."""
    graph = graph_structure(model)
    constants = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                        for o in n.output}
    ops = [(n.name, n.op_type) for n in graph.node]
    const_b = {n.name for n in graph.node if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in constants}
    return ops, const_b


def ort_config(model_input: ModelInput, *, dynamic: bool = False, **arguments: Any) -> Config:
    """The onnxq `Config` that onnxruntime's quantize_static (or, `dynamic`, quantize_dynamic)
    arguments mean for `model_input` (op_types_to_quantize and nodes_to_quantize are read
    against its nodes)."""
    return _config(model_input, dynamic, arguments)[0]


def _config(model_input: ModelInput, dynamic: bool, arguments: Mapping[str, Any]) -> tuple[Config, list[str]]:
    ops, const_b = _index(model_input)
    overrides, no_effect = ort_overrides(OrtArguments(**arguments), dynamic=dynamic, model_ops=ops,
                                         const_b_matmuls=const_b)
    return compose_config(None, None, overrides), no_effect


def _run(model_input: ModelInput, model_output: str | os.PathLike, config: Config, data: Any,
         no_effect: list[str], use_external_data_format: bool) -> QuantizationResult:
    model = str(model_input) if isinstance(model_input, Path) else model_input
    try:
        result = onnxq_quantize(model, model_output, config, data)
    except OnnxqError as exc:  # its errors name onnxruntime's parameters, as the caller wrote them
        raise renamed(exc, {"exclude entry": "nodes_to_exclude entry", **READER_NAMES}) from None
    result.summary.notes[:] = renamed_notes(result.summary.notes, READER_NAMES)
    for key in no_effect:
        result.summary.notes.append(Note(Topic.CALIBRATION, f"extra_options {key}: no onnxq setting needed "
                                         f"({NO_EFFECT[key]})"))
    if use_external_data_format:
        result.summary.notes.append(Note(Topic.OUTPUT, "use_external_data_format: onnxq writes weights to an "
                                         "external data file where the model needs one (past 2 GB)"))
    return result


def quantize_static(
    model_input: ModelInput,
    model_output: str | os.PathLike,
    calibration_data_reader: Any = None,
    quant_format: Any = "QDQ",
    op_types_to_quantize: Iterable[str] | None = None,
    per_channel: bool = False,
    reduce_range: bool = False,
    activation_type: Any = "QInt8",
    weight_type: Any = "QInt8",
    nodes_to_quantize: Iterable[str] | None = None,
    nodes_to_exclude: Iterable[str] | None = None,
    use_external_data_format: bool = False,
    calibrate_method: Any = "MinMax",
    calibration_providers: list[str] | None = None,
    extra_options: Mapping[str, Any] | None = None,
    calibration_cache_path: str | os.PathLike | None = None,
) -> QuantizationResult:
    """onnxruntime.quantization.quantize_static's arguments, quantized by onnxq (module doc).
    `calibration_data_reader`: a CalibrationDataReader, or any calibration data onnxq takes."""
    if calibration_cache_path is not None:
        raise ConfigError("calibration_cache_path is onnxruntime's ranges cache; onnxq's are ranges files: "
                          "ort_config(...) then config.calibration.save_ranges / load_ranges")
    config, no_effect = _config(model_input, False, {
        "quant_format": quant_format, "op_types_to_quantize": op_types_to_quantize, "per_channel": per_channel,
        "reduce_range": reduce_range, "activation_type": activation_type, "weight_type": weight_type,
        "nodes_to_quantize": nodes_to_quantize, "nodes_to_exclude": nodes_to_exclude,
        "calibrate_method": calibrate_method, "calibration_providers": calibration_providers,
        "extra_options": extra_options})
    return _run(model_input, model_output, config, calibration_data_reader, no_effect, use_external_data_format)


def quantize_dynamic(
    model_input: ModelInput,
    model_output: str | os.PathLike,
    op_types_to_quantize: Iterable[str] | None = None,
    per_channel: bool = False,
    reduce_range: bool = False,
    weight_type: Any = "QInt8",
    nodes_to_quantize: Iterable[str] | None = None,
    nodes_to_exclude: Iterable[str] | None = None,
    use_external_data_format: bool = False,
    extra_options: Mapping[str, Any] | None = None,
) -> QuantizationResult:
    """onnxruntime.quantization.quantize_dynamic's arguments, quantized by onnxq (module doc;
    Conv stays float unless op_types_to_quantize lists it)."""
    config, no_effect = _config(model_input, True, {
        "op_types_to_quantize": op_types_to_quantize, "per_channel": per_channel, "reduce_range": reduce_range,
        "weight_type": weight_type, "nodes_to_quantize": nodes_to_quantize, "nodes_to_exclude": nodes_to_exclude,
        "extra_options": extra_options})
    return _run(model_input, model_output, config, None, no_effect, use_external_data_format)


# StaticQuantConfig's and DynamicQuantConfig's fields that quantize_static / quantize_dynamic take.
STATIC_FIELDS = tuple(inspect.signature(quantize_static).parameters)[2:]
DYNAMIC_FIELDS = tuple(inspect.signature(quantize_dynamic).parameters)[2:]


def quantize(model_input: ModelInput, model_output: str | os.PathLike, quant_config: Any) -> QuantizationResult:
    """onnxruntime.quantization.quantize: `quant_config` a StaticQuantConfig (it holds a
    calibration_data_reader) or a DynamicQuantConfig, read by their fields."""
    fields = getattr(quant_config, "__dict__", None)
    if not isinstance(fields, dict) or "weight_type" not in fields:
        weight_only = " (weight-only blocks are onnxq's W4_GROUP128 / W8_GROUP128 presets: onnxq.quantize)" \
            if "WeightOnly" in type(quant_config).__name__ else ""
        raise ConfigError(f"quant_config must be onnxruntime's StaticQuantConfig or DynamicQuantConfig, got "
                          f"{type(quant_config).__name__}{weight_only}")
    if "calibration_data_reader" in fields:
        return quantize_static(model_input, model_output, **{k: fields[k] for k in STATIC_FIELDS if k in fields})
    return quantize_dynamic(model_input, model_output, **{k: fields[k] for k in DYNAMIC_FIELDS if k in fields})
