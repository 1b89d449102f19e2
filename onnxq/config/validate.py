"""Reject invalid combinations of settings when the config is loaded, not deep in a pass.

Each spec is checked as written at its level (where `None` means "inherit", so only the
fields it sets are judged) and again as resolved: the global config alone, and each
op-type or node override merged over it. Errors are one line: what is wrong, where
(`layer_quant_config['conv1'].weight`) and how to fix it.

A node override may also land on an op type with its own override; which one is only
known with the model, so `validate_node_configs` checks those combinations per node.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import fields
from enum import Enum
from typing import Any

import onnx

from onnxq.config.io import closest_name
from onnxq.config.resolve import is_excluded, merge_specs, resolve_node_config
from onnxq.config.spec import LADDER_RUNGS, TENSOR_CLASSES, Config, QuantizationConfig
from onnxq.errors import ConfigError

ACTIVATIONS = ("input_tensors", "output_tensors")
INTEGER_DTYPES = {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "int32": 32, "uint32": 32}
# Rules read this key of a spec's values: True when the config's format is qdq-ext, whose
# extended ops lift the limits of stock QuantizeLinear/DequantizeLinear for activations.
EXTENDED = "_extended"

# A rule gets (spec values as plain data, tensor class, resolved?) and returns None or
# (problem, fix). When `resolved` is False a `None` value means "inherited": not judged.
Rule = Callable[[dict[str, Any], str, bool], tuple[str, str] | None]


def entry_dict(entry: Any) -> Any:
    """A typed pass or algorithm config (a dataclass naming its algorithm in the class
    attribute `ALGORITHM`, e.g. `AdaRoundConfig(num_iteration=500)`) as its dict entry;
    anything else unchanged."""
    name = getattr(type(entry), "ALGORITHM", None)
    if not name or not dataclasses.is_dataclass(entry) or isinstance(entry, type):
        return entry
    values = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return {"name": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}


def validate_config(config: Config) -> None:
    """Raise `ConfigError` for wrong value types or invalid combinations in `config`."""
    from onnxq.config.io import check_types  # io imports this module

    config.pre_quant_opt_config[:] = [entry_dict(e) for e in config.pre_quant_opt_config]
    config.algo_config[:] = [entry_dict(e) for e in config.algo_config]
    check_types(config)
    _check_top_level(config)
    extended = _extended(config)
    for where, level in _levels(config):
        for tensor_class in TENSOR_CLASSES:
            spec = getattr(level, tensor_class)
            if spec is not None:
                check_spec(_plain_values(spec, extended), tensor_class, f"{where}.{tensor_class}")
    for where, stack in _merged_levels(config):
        for tensor_class in TENSOR_CLASSES:
            resolved = merge_specs([getattr(level, tensor_class) for level in stack], tensor_class)
            if resolved is not None:
                path = f"{where}.{tensor_class}" + _merged_note(where)
                check_spec(_plain_values(resolved, extended), tensor_class, path, resolved=True)


def validate_node_configs(config: Config, nodes: Iterable[tuple[str, str]]) -> None:
    """Check the config against a model's `(node name, op type)`s: each exclude entry and
    node override must name a node (a typo would silently quantize the node), and each
    node's resolved config must be valid (a node override can conflict with its op
    type's override, which `validate_config` cannot see without the model).
    """
    nodes = list(nodes)
    names = [name for name, _ in nodes]
    for entry in config.exclude:
        if not any(is_excluded(Config(exclude=[entry]), name) for name in names):
            raise ConfigError(f"exclude entry {entry!r} matches no node of the model{_nearest(entry, names)}")
    for name in config.layer_quant_config:
        if name not in names:
            raise ConfigError(f"layer_quant_config names {name!r}, which is no node of the model"
                              f"{_nearest(name, names)}")
    op_types = {op for _, op in nodes}
    for op in config.layer_type_quant_config:
        if op not in op_types and op not in _onnx_op_types():  # an op type of no model: a typo
            hint = closest_name(op, sorted(op_types)) or closest_name(op, sorted(_onnx_op_types()))
            raise ConfigError(f"layer_type_quant_config names op type {op!r}, which is no ONNX op type nor one "
                              f"of the model's" + (f"; did you mean '{hint}'?" if hint else
                                                   f" ({', '.join(sorted(op_types))})"))
    check_resolved(config, nodes)


def check_resolved(config: Config, nodes: Iterable[tuple[str, str]]) -> None:
    """Each node's resolved config must be valid (its levels can combine into a spec no
    level alone states)."""
    for name, op_type in nodes:
        resolved = resolve_node_config(config, name, op_type)
        if resolved is None:
            continue
        for tensor_class in TENSOR_CLASSES:
            spec = getattr(resolved, tensor_class)
            if spec is not None:
                path = f"node {name!r} ({op_type}).{tensor_class} as resolved"
                check_spec(_plain_values(spec, _extended(config)), tensor_class, path, resolved=True)


@functools.cache
def _onnx_op_types() -> frozenset[str]:
    """Every op type of onnx's registered schemas (standard and other domains)."""
    return frozenset(schema.name for schema in onnx.defs.get_all_schemas_with_history())


def _nearest(word: str, names: list[str]) -> str:
    hint = closest_name(word, names)
    return f"; did you mean '{hint}'?" if hint else "; see the node names with onnxq inspect MODEL --nodes"


def check_spec(
    values: dict[str, Any], tensor_class: str, path: str, resolved: bool = False
) -> None:
    """Raise `ConfigError` for the first rule that one spec's `values` break."""
    for rule in SPEC_RULES:
        found = rule(values, tensor_class, resolved)
        if found is not None:
            problem, fix = found
            raise ConfigError(f"{problem} in {path}; {fix}")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _extended(config: Config) -> bool:
    return _plain(config.quant_format) == "qdq-ext"


def _plain_values(spec: Any, extended: bool = False) -> dict[str, Any]:
    return {**{f.name: _plain(getattr(spec, f.name)) for f in fields(spec)}, EXTENDED: extended}


def _levels(config: Config) -> list[tuple[str, QuantizationConfig]]:
    """Every `QuantizationConfig` in `config`, with its path."""
    levels = [("global_quant_config", config.global_quant_config)]
    for attr in ("layer_type_quant_config", "layer_quant_config"):
        levels += [(f"{attr}[{key!r}]", qc) for key, qc in getattr(config, attr).items()]
    return levels


def _merged_levels(config: Config) -> list[tuple[str, list[QuantizationConfig]]]:
    """The global config alone, and each override over it, highest priority first."""
    base = config.global_quant_config
    return [(where, [base] if level is base else [level, base]) for where, level in _levels(config)]


def _merged_note(where: str) -> str:
    return "" if where == "global_quant_config" else " (merged over global_quant_config)"


def _check_top_level(config: Config) -> None:
    calibration = config.calibration
    if calibration.batch_size < 1:
        raise ConfigError(
            f"invalid batch_size {calibration.batch_size} in calibration; use 1 or more"
        )
    if calibration.max_samples is not None and calibration.max_samples < 1:
        raise ConfigError(
            f"invalid max_samples {calibration.max_samples} in calibration; "
            "use 1 or more, or remove it to use every sample"
        )
    if calibration.max_batches is not None and calibration.max_batches < 1:
        raise ConfigError(
            f"invalid max_batches {calibration.max_batches} in calibration; "
            "use 1 or more, or remove it to use every batch"
        )
    if calibration.check_samples is not None and (not isinstance(calibration.check_samples, int)
                                                  or calibration.check_samples < 0):
        raise ConfigError(
            f"invalid check_samples {calibration.check_samples!r} in calibration; use 0 (no output check) or more"
        )
    if calibration.max_memory_mb is not None and calibration.max_memory_mb < 0:
        raise ConfigError(
            f"invalid max_memory_mb {calibration.max_memory_mb} in calibration; use 0 or more MiB"
        )
    if config.accuracy_level not in (0, 1, 2, 3, 4):
        raise ConfigError(f"invalid accuracy_level {config.accuracy_level}; MatMulNBits takes 0 (unset), 1 (fp32), "
                          "2 (fp16), 3 (bf16) or 4 (int8)")
    if calibration.stats is not None and calibration.load_ranges:
        raise ConfigError("calibration.stats and calibration.load_ranges both replace calibration; give one")
    if config.qdq_domain not in ("ai.onnx", "com.microsoft"):
        raise ConfigError(
            f"invalid qdq_domain {config.qdq_domain!r}; use 'ai.onnx' (upgrade the opset when a "
            "type needs it) or 'com.microsoft' (onnxruntime contrib Q/DQ)"
        )
    for entry in config.exclude:
        try:
            re.compile(entry)
        except re.error as exc:
            raise ConfigError(
                f"exclude entry {entry!r} is neither a node name nor a valid regex ({exc}); "
                "escape special characters, e.g. with re.escape"
            ) from None
    _check_mixed_precision(config)
    if config.opset is not None and not 13 <= config.opset <= 23:
        raise ConfigError(f"invalid opset {config.opset}; use 13..23 or remove it")


def _check_mixed_precision(config: Config) -> None:
    mp = config.mixed_precision
    for rung in mp.ladder:
        if rung not in LADDER_RUNGS:
            hint = closest_name(str(rung), list(LADDER_RUNGS))
            raise ConfigError(f"unknown ladder rung {rung!r} in mixed_precision"
                              + (f"; did you mean {hint!r}?" if hint else f"; use {', '.join(LADDER_RUNGS)}"))
    if mp.target is not None and not mp.ladder:
        raise ConfigError("mixed_precision.ladder is empty; give at least one rung, e.g. [float]")
    if mp.target is not None:
        from onnxq.search.target import parse_target

        parse_target(mp.target)
    if mp.max_samples is not None and mp.max_samples < 1:
        raise ConfigError(f"invalid max_samples {mp.max_samples} in mixed_precision; use 1 or more")


# ---------------------------------------------------------------------------------------
# spec rules


def _group_size_positive(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if v["group_size"] is not None and v["group_size"] <= 0:
        return f"invalid group_size {v['group_size']}", "use a positive integer such as 128"
    return None


def _group_size_needs_per_group(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if v["group_size"] is not None and v["qscheme"] in ("per_tensor", "per_channel"):
        return (
            f"group_size {v['group_size']} with qscheme {v['qscheme']}",
            "group_size only applies to per_group: set qscheme: per_group or remove group_size",
        )
    return None


def _per_group_needs_group_size(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if resolved and v["qscheme"] == "per_group" and v["group_size"] is None:
        return "qscheme per_group without group_size", "set group_size, e.g. 128"
    return None


def _activation_per_channel_needs_axis(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if resolved and tc in ACTIVATIONS and v["qscheme"] == "per_channel" and v["ch_axis"] is None:
        return (
            "qscheme per_channel without ch_axis",
            "set ch_axis (only weights get their axis inferred from the op type)",
        )
    return None


def _activation_rounds_half_even(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if tc in ACTIVATIONS and v["round_method"] not in (None, "half_even") and not v[EXTENDED]:
        return (
            f"round_method {v['round_method']}",
            "QuantizeLinear rounds activations half to even at run time: "
            "use round_method: half_even, or quant_format: qdq-ext (extended ops)",
        )
    return None


def _int32_only_for_bias(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc != "bias" and v["dtype"] in ("int32", "uint32") and not (v[EXTENDED] and tc in ACTIVATIONS):
        return f"dtype {v['dtype']}", (
            "32-bit integers are only for bias (activations and weights have no stock onnxruntime "
            "kernel): use int8/uint8 or int16/uint16, or for activations quant_format: qdq-ext"
        )
    return None


def _bias_dtype(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc == "bias" and v["dtype"] not in (None, "int32", "float32"):
        return (
            f"bias dtype {v['dtype']}",
            "set dtype: int32 (or float32 to keep bias in float)",
        )
    return None


def _percentile_range(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    p = v["percentile"]
    if p is not None and not 0 < p <= 100:
        return f"invalid percentile {p}", "use a value in (0, 100], e.g. 99.999"
    return None


def _num_bins_min(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if v["num_bins"] is not None and v["num_bins"] < 2:
        return f"invalid num_bins {v['num_bins']}", "use 2 or more, e.g. 2048"
    return None


def _weight_static(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc == "weight" and v["is_dynamic"] is True:
        return "is_dynamic true", "weights are always quantized statically: remove is_dynamic"
    return None


def _bits_range(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    bits = v["bits"]
    if bits is None:
        return None
    if tc != "weight" and not (v[EXTENDED] and tc in ACTIVATIONS):
        return f"bits {bits}", ("bits narrows weights only (activations too with quant_format: qdq-ext): "
                                "remove it from activations and bias")
    top = 8 if tc == "weight" else 32
    if not 2 <= bits <= top:
        return f"invalid bits {bits}", f"use a bit width from 2 to {top}"
    if resolved and (v["dtype"] not in INTEGER_DTYPES or bits > INTEGER_DTYPES[v["dtype"]]):
        return (
            f"bits {bits} with dtype {v['dtype']}",
            "bits must not exceed the integer dtype's width: use dtype int8/uint8 for 5..8 bits, "
            "int16/uint16 or int32/uint32 for more",
        )
    return None


WEIGHT_METHODS = ("minmax", "hqq")


def _weight_method(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """Weights are quantized offline: min-max (with the 4-bit clipping search), or HQQ's
    optimised zero points for asymmetric per-group weights."""
    method = v["calib_method"]
    if tc != "weight" or method is None:
        return None
    if method not in WEIGHT_METHODS:
        return (f"weight calib_method {method!r}",
                f"weights are quantized with {' or '.join(WEIGHT_METHODS)} (calibration methods are for activations)")
    if method == "hqq" and resolved and (v["symmetric"] or v["qscheme"] != "per_group"):
        return ("weight calib_method hqq with " + ("symmetric weights" if v["symmetric"] else f"qscheme {v['qscheme']}"),
                "hqq optimises each block's zero point: set symmetric: false and qscheme: per_group")
    return None


def _calib_method_registered(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    method = v["calib_method"]
    if method is None or tc == "weight":
        return None
    from onnxq.calibrate.observers import OBSERVERS  # the registry is open: read it now
    from onnxq.config.io import closest_name

    if method in OBSERVERS:
        return None
    hint = closest_name(str(method), sorted(OBSERVERS), cutoff=0.8)
    did_you_mean = f"did you mean '{hint}'? " if hint else ""
    return (f"invalid calib_method {method!r}",
            f"{did_you_mean}valid values: {', '.join(sorted(OBSERVERS))} "
            "(or register your own with onnxq.calibrate.observers.register_observer; on the command line, "
            "load its file with --plugin FILE.py)")


def _method_reads_its_fields(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """percentile or num_bins set beside a method that ignores it (same level only: a
    preset's value under a user's method is the preset's business)."""
    from onnxq.calibrate.observers import OBSERVERS

    method = v["calib_method"]
    if resolved or method is None or method not in OBSERVERS:
        return None
    for key in ("percentile", "num_bins"):
        if v[key] is not None and key not in OBSERVERS[method].spec_fields:
            users = sorted(name for name, cls in OBSERVERS.items() if key in cls.spec_fields)
            return (f"{key} {v[key]} with calib_method {method}, which does not use it",
                    f"use calib_method {' or '.join(users)}, or remove {key}")
    return None


def _calib_options_known(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """calib_options name options of the resolved method, with valid values (checked here,
    not first at calibration: `config show`/`convert` and `load_config` accept nothing that
    `quantize` would refuse)."""
    method, options = v["calib_method"], v["calib_options"]
    if not resolved or method is None or not options:
        return None
    from onnxq.calibrate.observers import OBSERVERS
    from onnxq.calibrate.observers.options import parse_options

    if tc == "weight":
        if method != "hqq":
            return None
        from onnxq.numerics.hqq import HqqOptions
        cls = HqqOptions
    elif method in OBSERVERS:
        cls = OBSERVERS[method].options_class
    else:
        return None
    try:
        parse_options(cls, method, options)
    except ConfigError as exc:
        problem, _, fix = str(exc).partition("; ")
        return problem, fix or "check the calib_options of this method"
    return None


def _block_formats_where_they_run(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    from onnxq.numerics.qmath import BLOCK_DTYPES

    if v["dtype"] not in {d.value for d in BLOCK_DTYPES}:
        return None
    if not v[EXTENDED]:
        return f"dtype {v['dtype']}", "block formats run through onnxq's extended ops: set quant_format: qdq-ext"
    if tc not in ("input_tensors", "weight"):
        return (f"dtype {v['dtype']} for {tc}",
                "block formats quantize the inputs and weights of Conv/Gemm/MatMul: use them there")
    return None


SPEC_RULES: tuple[Rule, ...] = (
    _block_formats_where_they_run,
    _weight_method,
    _calib_method_registered,
    _method_reads_its_fields,
    _calib_options_known,
    _int32_only_for_bias,
    _bias_dtype,
    _group_size_positive,
    _group_size_needs_per_group,
    _per_group_needs_group_size,
    _activation_per_channel_needs_axis,
    _activation_rounds_half_even,
    _percentile_range,
    _num_bins_min,
    _weight_static,
    _bits_range,
)
