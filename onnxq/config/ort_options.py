"""onnxruntime.quantization's arguments read into onnxq's config shape: a dict laid over a
preset like any config file (`ort_overrides`), so `onnxq.ort_compat.quantize_static` takes
a script written for onnxruntime's quantizer as it is, and `ort_config` shows or saves the
recipe it means (docs/configuration.md, "From onnxruntime.quantization").

What each argument means here:
- quant_format QDQ / QOperator -> quant_format qdq / qoperator; activation_type and
  weight_type (QInt8, QUInt8, QInt16, QUInt16, QInt4, QUInt4, QFLOAT8E4M3FN) -> the dtypes,
  with onnxruntime's default symmetry (activations asymmetric, signed weights symmetric;
  `ActivationSymmetric`, `WeightSymmetric`, `CalibTensorRangeSymmetric` change it).
- per_channel -> weight qscheme per_channel (else per_tensor); reduce_range True -> 7-bit
  weights; False -> the target decides, as in onnxq (full 8 bits where the CPU's int8
  kernels are exact, pair-safe scales where they saturate: onnxruntime's own quantizer
  writes 8-bit pairs that AVX2 CPUs without VNNI saturate).
- calibrate_method MinMax / Entropy / Percentile -> calib_method minmax / entropy /
  percentile (`CalibPercentile`); Distribution (onnxruntime's float8 method) -> minmax on
  float8 types, refused on integer types as onnxruntime refuses it.
- quantize_dynamic: W8_DYNAMIC, its embedding tables uint8 with zero points as onnxruntime
  quantizes them (as activations); Conv float unless listed (`DYNAMIC_DEFAULT_TYPES`).
- op_types_to_quantize -> every other op type of the model kept float (`float_op_types`);
  nodes_to_quantize -> every other node excluded; nodes_to_exclude -> exclude (a name that
  is no node of the model is an error here, where onnxruntime ignores it).
- extra_options: the table `EXTRA_OPTIONS` (mapped), `NO_EFFECT` (onnxruntime's layout or
  memory choices, whose result onnxq reaches its own way: accepted, and said in a note), and
  `UNSUPPORTED` (no counterpart: a one-line error naming the option and what to use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxq.config.spec import ACTIVATION_CLASSES, Config
from onnxq.errors import ConfigError, closest_name, named_fields_only
from onnxq.graph.schema_types import onnx_op_types

# onnxruntime's QuantType -> onnxq dtype
QUANT_TYPES = {"qint8": "int8", "quint8": "uint8", "qint16": "int16", "quint16": "uint16", "qint4": "int4",
               "quint4": "uint4", "qfloat8e4m3fn": "float8_e4m3fn"}
SIGNED = {"int8", "int16", "int4", "float8_e4m3fn"}
FORMATS = {"qdq": "qdq", "qoperator": "qoperator"}
CALIB_METHODS = {"minmax": "minmax", "entropy": "entropy", "percentile": "percentile", "distribution": "minmax"}
# onnxruntime's IntegerOpsRegistry: what quantize_dynamic quantizes when op_types_to_quantize is empty.
# onnxq's dynamic recipe (W8_DYNAMIC) keeps Conv float: ConvInteger is slower than float Conv
# on onnxruntime's CPU; listing Conv quantizes it dynamically as onnxruntime would.
DYNAMIC_DEFAULT_TYPES = ("MatMul", "Gemm", "Attention", "LSTM", "Gather", "EmbedLayerNormalization")


def _activation_symmetric(value: Any, spec: dict[str, Any]) -> None:
    """ActivationSymmetric or CalibTensorRangeSymmetric: None keeps the type's default (as in
    onnxruntime, whose get_qdq_config writes None); either one true makes them symmetric."""
    if value is None:
        return
    for key in ACTIVATION_CLASSES:
        tensors = spec["global_quant_config"].setdefault(key, {})
        tensors["symmetric"] = bool(value) or tensors.get("_symmetric_set", False)
        tensors["_symmetric_set"] = tensors["symmetric"]


def _weight_symmetric(value: Any, spec: dict[str, Any]) -> None:
    """None keeps the type's default: signed weights symmetric (onnxruntime's rule)."""
    if value is not None:
        spec["global_quant_config"].setdefault("weight", {})["symmetric"] = bool(value)


def _float_bias(value: Any, spec: dict[str, Any]) -> None:
    if value is not None and not value:  # False, 0 or numpy's False (`_switch`)
        spec["global_quant_config"]["bias"] = {"dtype": "float32"}


def _percentile(value: Any, spec: dict[str, Any]) -> None:
    for key in ACTIVATION_CLASSES:
        spec["global_quant_config"].setdefault(key, {})["percentile"] = value


def _no_output_quantization(value: Any, spec: dict[str, Any]) -> None:
    for op_type in _names(value, "OpTypesToExcludeOutputQuantization"):
        spec["layer_type_quant_config"].setdefault(op_type, {})["output_tensors"] = {"dtype": "float32"}


def _channel_axes(value: Any, spec: dict[str, Any]) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"QDQOpTypePerChannelSupportToAxis must map op types to axes, e.g. {{'MatMul': 1}}; "
                          f"got {value!r}")
    for op_type, axis in value.items():
        spec["layer_type_quant_config"].setdefault(op_type, {}).setdefault("weight", {})["ch_axis"] = axis


def _smoothquant(value: Any, spec: dict[str, Any]) -> None:
    if value:
        spec["pre_quant_opt_config"].append({"name": "smoothquant", "alpha": spec.pop("_smoothquant_alpha", 0.5)})


def _contrib_ops(value: Any, spec: dict[str, Any]) -> None:
    spec["qdq_domain"] = "com.microsoft" if value else "ai.onnx"


def _keep_activations(value: Any, spec: dict[str, Any]) -> None:
    spec["fuse_activations"] = not value


def _const_b_only(value: Any, spec: dict[str, Any]) -> None:
    spec["_const_b_only"] = bool(value)


# extra_options key -> how it sets the overrides. SmoothQuantAlpha is read with SmoothQuant.
EXTRA_OPTIONS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "ActivationSymmetric": _activation_symmetric,
    "CalibTensorRangeSymmetric": _activation_symmetric,
    "WeightSymmetric": _weight_symmetric,
    "CalibPercentile": _percentile,
    "OpTypesToExcludeOutputQuantization": _no_output_quantization,
    "QDQOpTypePerChannelSupportToAxis": _channel_axes,
    "SmoothQuant": _smoothquant,
    "SmoothQuantAlpha": lambda value, spec: None,
    "UseQDQContribOps": _contrib_ops,
    "QDQKeepRemovableActivations": _keep_activations,
    "MatMulConstBOnly": _const_b_only,
    "QuantizeBias": _float_bias,
}
# extra_options that are switches: a value of another type is refused.
SWITCHES = ("ActivationSymmetric", "CalibTensorRangeSymmetric", "WeightSymmetric", "SmoothQuant", "UseQDQContribOps",
            "QDQKeepRemovableActivations", "MatMulConstBOnly", "QuantizeBias", "EnableSubgraph",
            "ForceQuantizeNoInputCheck", "DedicatedQDQPair", "CalibMovingAverage", "AddQDQPairToWeight")
# extra_options whose effect onnxq has anyway, or that change only how onnxruntime's
# quantizer works (memory, layout of the graph): accepted, and named in the summary.
NO_EFFECT = {
    "CalibMaxIntermediateOutputs": "onnxq streams calibration batches into its observers: memory does not grow "
                                   "with the samples",
    "CalibStridedMinMax": "onnxq streams calibration batches into its observers: memory does not grow with the "
                          "samples",
    "ForceQuantizeNoInputCheck": "onnxq quantizes data-movement ops (MaxPool, Transpose, ...) where their "
                                 "neighbours are quantized",
    "DedicatedQDQPair": "onnxq writes one DequantizeLinear per tensor, which onnxruntime's fusions take either way",
    "QDQDisableWeightAdjustForInt32Bias": "onnxq keeps a bias float where its int32 scale would be too fine",
    "SmoothQuantFolding": "onnxq folds SmoothQuant's scales into the op before where it can",
    "DefaultTensorType": "onnxq infers every tensor's type itself",
}
# extra_options with no counterpart, when set to something other than onnxruntime's
# default: what to use instead.
UNSUPPORTED = {
    "CalibMovingAverage": (False, "onnxq has no moving-average MinMax; calibrate_method Percentile, or onnxq's "
                                  "calib_method minmse, gives ranges robust to outlier batches"),
    "CalibMovingAverageConstant": (None, "onnxq has no moving-average MinMax (CalibMovingAverage)"),
    "ActivationRestrictedAsymmetric": (False, "onnxq has no restricted zero points; set ActivationSymmetric"),
    "AddQDQPairToWeight": (False, "onnxq stores weights quantized, read by a DequantizeLinear"),
    "EnableSubgraph": (False, "onnxq quantizes the main graph; nodes inside If/Loop/Scan bodies stay float"),
    "MinimumRealRange": (None, "onnxq has no minimum range; set the tensor's range with layer_quant_config or a "
                               "ranges file (calibration.load_ranges)"),
    "TensorQuantOverrides": ({}, "per-tensor overrides are onnxq's layer_quant_config (per node) and ranges files "
                                 "(calibration.load_ranges); build the Config with onnxq.ort_compat.ort_config and "
                                 "add them there"),
    "extra.Sigmoid.nnapi": (False, "onnxq has no NNAPI Sigmoid mode"),
    "BlockSize": (None, "onnxq's blocked weights are per_group (global_quant_config.weight: {qscheme: per_group, "
                        "group_size: N}; MatMul weight-only: the W4_GROUP128 / W8_GROUP128 presets)"),
}
KNOWN = [*EXTRA_OPTIONS, *NO_EFFECT, *UNSUPPORTED]


def enum_name(value: Any, what: str, table: Mapping[str, str]) -> str:
    """onnxq's name for onnxruntime's enum member `value` (the enum, or its name as a string)."""
    name = str(getattr(value, "name", value)).lower()
    if name not in table:
        raise ConfigError(f"{what} {value!r} is not one of onnxruntime's: "
                          f"{', '.join(sorted(table))} (case-insensitive)")
    return name


def _named_only(names: list[str], what: str) -> None:
    """Nodes to exclude by name must have one (onnxq names unnamed nodes at load, so a
    model's own empty name would leave such a node quantized)."""
    if "" in names:
        raise ConfigError(f"{what}, and {names.count('')} of those nodes have no name; give the model's nodes "
                          "names (as exporters do), or use op_types_to_quantize")


def _names(value: Any, what: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError(f"{what} must be a list of names, got {value!r}")
    return [str(v) for v in value]


def _switch(value: Any) -> bool:
    """Whether `value` reads as a switch as onnxruntime reads it: None, a bool (numpy's too)
    or 0/1; a string or anything else is refused."""
    return value is None or isinstance(value, bool | np.bool_) or (isinstance(value, int | np.integer)
                                                                   and value in (0, 1))


def _op_types(value: Any, model_ops: Iterable[tuple[str, str]]) -> list[str]:
    """op_types_to_quantize as names; one that is no op type of the model, of onnx or of
    onnxruntime's quantization registries is a typo, refused with the nearest name (it had
    left every node float, `Convv`); a real op type the model lacks is accepted, as scripts
    pass one list to many models."""
    names = _names(value, "op_types_to_quantize")
    from onnxruntime.quantization.registry import (
        IntegerOpsRegistry,
        QDQRegistry,
        QLinearOpsRegistry,
    )

    known = {op for _, op in model_ops} | onnx_op_types()
    known |= set(IntegerOpsRegistry) | set(QDQRegistry) | set(QLinearOpsRegistry)
    for name in names:
        if name not in known:
            hint = closest_name(name, sorted({op for _, op in model_ops})) or closest_name(name, sorted(known))
            raise ConfigError(f"op_types_to_quantize names {name!r}, which is no op type of the model, of onnx or of "
                              "onnxruntime's quantizer" + (f"; did you mean {hint!r}?" if hint else ""))
    return names


@named_fields_only
@dataclass(frozen=True)
class OrtArguments:
    """quantize_static's and quantize_dynamic's arguments, onnxruntime's defaults (enums or
    their names); a misspelt one is refused with the nearest name."""

    quant_format: Any = "QDQ"
    op_types_to_quantize: Iterable[str] | None = None
    per_channel: bool = False
    reduce_range: bool = False
    activation_type: Any = "QInt8"
    weight_type: Any = "QInt8"
    nodes_to_quantize: Iterable[str] | None = None
    nodes_to_exclude: Iterable[str] | None = None
    calibrate_method: Any = "MinMax"
    calibration_providers: list[str] | None = None
    extra_options: Mapping[str, Any] | None = None


def ort_overrides(arguments: OrtArguments, *, dynamic: bool, model_ops: list[tuple[str, str]],
                  const_b_matmuls: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """The overrides (with their `preset`) that onnxruntime's arguments mean, and the
    `NO_EFFECT` options given (for the summary). `model_ops`: every node's (name, op type),
    unnamed ones with ""; `const_b_matmuls`: the MatMuls whose second input is a constant
    (MatMulConstBOnly)."""
    a = arguments
    extra = dict(a.extra_options or {})
    present = {op for _, op in model_ops}
    for key in extra:
        if key not in KNOWN:
            near = closest_name(key, KNOWN)
            raise ConfigError(f"extra_options {key!r} is not an onnxruntime.quantization option onnxq knows"
                              + (f"; did you mean {near!r}?" if near else f"; known: {', '.join(sorted(KNOWN))}"))
    for key, (default, instead) in UNSUPPORTED.items():
        if key in extra and extra[key] is not None and extra[key] != default:
            raise ConfigError(f"extra_options {key}={extra[key]!r} has no onnxq counterpart: {instead}")
    weight = QUANT_TYPES[enum_name(a.weight_type, "weight_type", QUANT_TYPES)]
    activation = QUANT_TYPES[enum_name(a.activation_type, "activation_type", QUANT_TYPES)]
    method = enum_name(a.calibrate_method, "calibrate_method", CALIB_METHODS)
    if method == "distribution" and not activation.startswith("float8") and not weight.startswith("float8"):
        raise ConfigError("calibrate_method Distribution is onnxruntime's float8 method; with integer types use "
                          "MinMax, Entropy or Percentile (as onnxruntime requires)")
    if "CalibPercentile" in extra and method != "percentile":
        raise ConfigError(f"extra_options CalibPercentile is read by calibrate_method Percentile only (onnxruntime "
                          f"ignores it with {getattr(a.calibrate_method, 'name', a.calibrate_method)}); remove it, or set "
                          "calibrate_method Percentile")
    spec: dict[str, Any] = {"global_quant_config": {}, "layer_type_quant_config": {}, "layer_quant_config": {},
                            "pre_quant_opt_config": [], "exclude": []}
    gqc = spec["global_quant_config"]
    gqc["weight"] = {"dtype": weight, "symmetric": weight in SIGNED,
                     "qscheme": "per_channel" if a.per_channel else "per_tensor"}
    if dynamic:
        spec["preset"] = "W8_DYNAMIC"
        if weight not in ("int8", "uint8"):
            raise ConfigError(f"quantize_dynamic takes weight_type QInt8 or QUInt8 (int8 weights read by "
                              f"MatMulInteger), got {a.weight_type!r}")
        # onnxruntime quantizes an embedding table as it would an activation: uint8 with a zero
        # point (all-MiniLM-L6, per-tensor, Gather alone: 29.8 dB against 25.6 as a weight)
        spec["layer_type_quant_config"]["Gather"] = {"weight": {"dtype": "uint8", "symmetric": False}}
    else:
        spec["preset"] = "U8S8"
        spec["quant_format"] = FORMATS[enum_name(a.quant_format, "quant_format", FORMATS)]
        for key in ACTIVATION_CLASSES:
            gqc[key] = {"dtype": activation, "symmetric": activation.startswith("float8"),
                        "calib_method": CALIB_METHODS[method]}
    spec["reduce_range"] = True if a.reduce_range else None
    if "SmoothQuantAlpha" in extra:
        spec["_smoothquant_alpha"] = extra["SmoothQuantAlpha"]
    for key, value in extra.items():
        if key in SWITCHES and not _switch(value):
            raise ConfigError(f"extra_options {key} must be True or False, got {value!r} (a string such as 'false' "
                              "would read as true)")
        if key in EXTRA_OPTIONS:
            EXTRA_OPTIONS[key](value, spec)
    spec.pop("_smoothquant_alpha", None)
    for tensors in gqc.values():
        tensors.pop("_symmetric_set", None)
    wanted_types = _op_types(a.op_types_to_quantize, model_ops) if a.op_types_to_quantize else (
        list(DYNAMIC_DEFAULT_TYPES) if dynamic else None)
    if wanted_types is not None:
        others = sorted({t for _, t in model_ops if t not in wanted_types})
        if others:
            spec["float_op_types"] = others
        for op_type in set(wanted_types) & set(Config().float_op_types) & present:  # out of the preset's float list
            spec["layer_type_quant_config"].setdefault(op_type, {})
        if dynamic and "Conv" in wanted_types:
            spec["layer_type_quant_config"]["Conv"] = {"input_tensors": {"dtype": "uint8", "is_dynamic": True},
                                                       "weight": {"dtype": weight}}
    excluded = set(_names(a.nodes_to_exclude, "nodes_to_exclude")) if a.nodes_to_exclude else set()
    names = [name for name, _ in model_ops]
    if a.nodes_to_quantize:
        wanted = set(_names(a.nodes_to_quantize, "nodes_to_quantize"))
        _named_only(names, "nodes_to_quantize leaves the other nodes float by name")
        missing = sorted(wanted - set(names))
        if missing:
            near = closest_name(missing[0], [n for n in names if n])
            raise ConfigError(f"nodes_to_quantize names {missing[0]!r}, no node of the model"
                              + (f"; did you mean {near!r}?" if near else "") + " (`onnxq inspect MODEL --nodes` "
                              "lists them)")
        excluded |= {name for name in names if name not in wanted}
    # quantize_dynamic's default: onnxq's dynamic recipe quantizes no MatMul of two activations anyway
    if spec.pop("_const_b_only", False):
        const = set(const_b_matmuls)
        loose = [name for name, op in model_ops if op == "MatMul" and name not in const]
        _named_only(loose, "MatMulConstBOnly leaves the MatMuls of two activations float by name")
        excluded |= set(loose)
    spec["exclude"] = sorted(excluded)
    if a.calibration_providers:
        spec["calibration"] = {"providers": list(a.calibration_providers)}
    # the caller's op-type lists name op types the model may lack (one script, many models):
    # their settings would only be said to have no effect, in words the caller never wrote
    listed = set(extra.get("OpTypesToExcludeOutputQuantization") or ()) | set(
        extra.get("QDQOpTypePerChannelSupportToAxis") or ())
    for op in listed - present:
        spec["layer_type_quant_config"].pop(op, None)
    return spec, [key for key in extra if key in NO_EFFECT]


# onnxruntime.quantization's argument names, met as keys of an onnxq config (a file written
# from an onnxruntime script): what each is in onnxq, for the unknown-key error.
ORT_KEYS = {
    "activation_type": "global_quant_config.input_tensors.dtype and output_tensors.dtype",
    "weight_type": "global_quant_config.weight.dtype",
    "per_channel": "global_quant_config.weight.qscheme: per_channel",
    "calibrate_method": "global_quant_config.input_tensors.calib_method (and output_tensors)",
    "nodes_to_exclude": "exclude",
    "nodes_to_quantize": "exclude (the other nodes)",
    "op_types_to_quantize": "float_op_types (the op types to keep float)",
    "extra_options": "the keys of docs/configuration.md's 'From onnxruntime.quantization' table",
    "calibration_providers": "calibration.providers",
    "calibration_data_reader": "the calibration data (--calib-data; in Python, quantize's calibration_data)",
    "use_external_data_format": "nothing: onnxq writes external data where the model needs it",
}
