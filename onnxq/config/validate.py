"""Reject invalid combinations of settings when the config is loaded, not deep in a pass.

Each spec is checked as written at its level (where `None` means "inherit", so only the
fields it sets are judged) and again as resolved: the global config alone, and each
op-type or node override merged over it. Errors are one line: what is wrong, where
(`layer_quant_config['conv1'].weight`) and how to fix it.

A node override may also land on an op type with its own override; which one is only
known with the model, so `validate_node_configs` checks those combinations per node.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import fields
from enum import Enum
from typing import Any

from onnxq.config.accuracy import parse_target
from onnxq.config.convert import bare_dtype, check_types, convert, entry_dict
from onnxq.config.resolve import is_excluded, merge_specs, resolve_node_config
from onnxq.config.spec import (
    DTYPE_ALIASES,
    LADDER_RUNGS,
    LAYER_CLASS_FIELDS,
    PRECISION_RUNGS,
    SPEC_DEFAULTS,
    TENSOR_CLASSES,
    Config,
    DType,
    QuantizationConfig,
    QuantizationSpec,
)
from onnxq.config.spec_rules import EXTENDED, INHERITED, check_spec
from onnxq.errors import ConfigError, closest_name
from onnxq.graph.schema_types import is_onnx_op_type, onnx_op_types


def validate_config(config: Config) -> None:
    """Raise `ConfigError` for wrong value types or invalid combinations in `config`."""
    for key in ("pre_quant_opt_config", "algo_config"):
        entries = getattr(config, key)
        if entries is None or isinstance(entries, tuple):
            setattr(config, key, entries := list(entries or ()))
        if not isinstance(entries, list):
            entry = f"{type(entries).__name__}(...)" if hasattr(entries, "ALGORITHM") else "{'name': ...}"
            raise ConfigError(f"{key} must be a list of entries, got {type(entries).__name__}; write {key}=[{entry}] "
                              "(one entry per pass or algorithm)")
    config.pre_quant_opt_config[:] = [entry_dict(e) for e in config.pre_quant_opt_config]
    config.algo_config[:] = [entry_dict(e) for e in config.algo_config]
    _layer_class_specs(config)
    check_types(config)
    _canonical_dtypes(config)
    _check_top_level(config)
    _check_entries(config)
    extended = _extended(config)
    for (where, level), attr in zip(_levels(config), _level_kinds(config), strict=True):
        for tensor_class in TENSOR_CLASSES:
            spec = getattr(level, tensor_class)
            if spec is not None:
                values = {**_plain_values(spec, extended), INHERITED: _inherited_methods(config, attr, tensor_class)}
                check_spec(values, tensor_class, f"{where}.{tensor_class}")
    for where, stack in _merged_levels(config):
        merged = {tc: merge_specs([getattr(level, tc) for level in stack], tc) for tc in TENSOR_CLASSES}
        for tensor_class, resolved in merged.items():
            if resolved is not None:
                path = f"{where}.{tensor_class}" + _merged_note(where)
                check_spec(_plain_values(resolved, extended), tensor_class, path, resolved=True)
    for key, tensor_class in LAYER_CLASS_FIELDS.items():  # as written, and over the global spec
        spec = getattr(config, key)
        if spec is None:
            continue
        check_spec(_plain_values(spec, extended), tensor_class, key)
        merged = merge_specs([spec, getattr(config.global_quant_config, tensor_class)], tensor_class)
        path = f"{key} (merged over global_quant_config.{tensor_class})"
        if merged is not None:  # None: kept float (dtype float32)
            check_spec(_plain_values(merged, extended), tensor_class, path, resolved=True)


def _check_entries(config: Config) -> None:
    """The passes and algorithms as the run would parse them (names, options, one of each
    exclusive kind, block rounding only with MatMulNBits): `config show`, `convert`, a
    file and a dict refuse what `quantize` would."""
    # imported here: the optimize modules import the config package
    from onnxq.optimize.registry import check_config_entries

    check_config_entries(config.pre_quant_opt_config, config.algo_config, config.matmul_nbits)


def _layer_class_specs(config: Config) -> None:
    """Layer-class keys set in code as a file writes them (a dtype name, `none`, a
    mapping) made specs, and override levels and their specs given as mappings made
    `QuantizationConfig`s and `QuantizationSpec`s, in place."""
    if isinstance(config.global_quant_config, Mapping):
        config.global_quant_config = convert(dict(config.global_quant_config), QuantizationConfig, "",
                                             "global_quant_config")
    for attr in ("layer_type_quant_config", "layer_quant_config"):
        levels = getattr(config, attr)
        if isinstance(levels, Mapping):
            setattr(config, attr, {key: convert(dict(level), QuantizationConfig, attr, f"[{key!r}]")
                                   if isinstance(level, Mapping) else level for key, level in levels.items()})
    for where, level in _levels(config):  # a spec given as a mapping (`c.global_quant_config.weight = {...}`)
        for tensor_class in TENSOR_CLASSES:
            spec = getattr(level, tensor_class, None) if isinstance(level, QuantizationConfig) else None
            if isinstance(spec, Mapping):
                setattr(level, tensor_class, convert(dict(spec), QuantizationSpec, where, tensor_class))
    for key in LAYER_CLASS_FIELDS:
        value = bare_dtype(getattr(config, key))
        if isinstance(value, Mapping):
            value = convert(dict(value), QuantizationSpec, "", key)
        setattr(config, key, value)


# Float types an op computes in whole (its weights, inputs and outputs): the float_target
# strategy's, as the FP16 and BF16 presets set them.
_WHOLE_OP_FLOATS = ("float16", "bfloat16")


def _check_float_weight(merged: dict[str, Any], where: str, weighted: bool = True) -> None:
    """float16/bfloat16 weights beside integer activations, or float16/bfloat16
    activations beside integer or float8 weights: no kernel computes that mix (the float
    type runs the whole op, and the weights were stored in it whatever their dtype said).
    Judged per node as resolved (node > op type > global): a level alone cannot tell; the
    second only where the node has a constant weight (`weighted`: a Softmax in float16
    beside int8 Conv weights is a whole float16 op)."""
    weight, inputs = merged.get("weight"), merged.get("input_tensors")
    if weight is None or inputs is None:
        return
    if weighted and _plain(inputs.dtype) in _WHOLE_OP_FLOATS \
            and _plain(weight.dtype) not in (_plain(inputs.dtype), "float32"):
        raise ConfigError(
            f"weight dtype {_plain(weight.dtype)} with {_plain(inputs.dtype)} input_tensors in {where}; "
            f"{_plain(inputs.dtype)} runs a whole op in that type, weights included: give the weights "
            f"{_plain(inputs.dtype)} too (--weight-type {_plain(inputs.dtype)}, as the FP16 and BF16 presets do), "
            f"or integer input_tensors for {_plain(weight.dtype)} weights (U8S8, W4A8), or a weight-only recipe "
            "(W8_DYNAMIC, W4_GROUP128)")
    if _plain(weight.dtype) not in _WHOLE_OP_FLOATS:
        return
    if _plain(inputs.dtype) not in (*_WHOLE_OP_FLOATS, "float32", None):
        raise ConfigError(
            f"weight dtype {_plain(weight.dtype)} with {_plain(inputs.dtype)} input_tensors in {where}; "
            f"{_plain(weight.dtype)} runs a whole op in that type: give its input_tensors and output_tensors "
            f"{_plain(weight.dtype)} too (as the FP16 and BF16 presets do), or weight dtype float32 to keep "
            "the weights float")


# Options of passes and algorithms that list node names (exact names): one the model lacks
# would change nothing, as a misspelt exclude entry would.
NODE_NAME_OPTIONS = ("skip_layers", "skip_fusion_layers", "layers")


def validate_node_configs(config: Config, nodes: Iterable[tuple[str, str]],
                          weighted: Collection[str] | None = None) -> None:
    """Check the config against a model's `(node name, op type)`s: each exclude entry and
    node override must name a node (a typo would silently quantize the node), and each
    node's resolved config must be valid (a node override can conflict with its op
    type's override, which `validate_config` cannot see without the model).
    """
    nodes = list(nodes)
    names = [name for name, _ in nodes]
    op_types = {op for _, op in nodes}
    for entry in config.exclude:
        if not any(is_excluded(Config(exclude=[entry]), name) for name in names):
            if entry in op_types:  # an op type where node names go (`--exclude Conv`)
                raise ConfigError(f"exclude entry {entry!r} matches no node of the model but is one of its op types; "
                                  f"keep every {entry} float with float_op_types: [{entry}] (--float-op-types "
                                  f"{entry}), or give a node-name pattern to exclude")
            raise ConfigError(f"exclude entry '{entry}' matches no node of the model{_nearest(entry, names)}")
    for name in config.layer_quant_config:
        if name in op_types and name not in names:  # an op type where node names go
            raise ConfigError(f"layer_quant_config names {name!r}, which is no node of the model but one of its op "
                              f"types; put it under layer_type_quant_config for every {name}")
        if name not in names:
            raise ConfigError(f"layer_quant_config names {name!r}, which is no node of the model"
                              f"{_nearest(name, names)}")
    for key in ("pre_quant_opt_config", "algo_config"):  # node names in pass and algorithm options
        for entry in getattr(config, key):
            for option in NODE_NAME_OPTIONS:
                listed = entry.get(option) if isinstance(entry, Mapping) else None
                for name in listed if isinstance(listed, list | tuple) else ():
                    if name not in names:
                        raise ConfigError(f"{entry.get('name')}: {option} names {name!r}, which is no node of the "
                                          f"model{_nearest(str(name), names)}")
    named = [("layer_type_quant_config", op) for op in config.layer_type_quant_config]
    named += [("float_op_types", op) for op in config.float_op_types]
    for where, op in named:
        if op not in op_types and not is_onnx_op_type(op):  # an op type of no model: a typo
            hint = closest_name(op, sorted(op_types)) or closest_name(op, sorted(onnx_op_types()))
            raise ConfigError(f"{where} names op type {op!r}, which is no ONNX op type nor one "
                              f"of the model's" + (f"; did you mean '{hint}'?" if hint else
                                                   f" ({', '.join(sorted(op_types))})"))
    check_resolved(config, nodes, weighted)


def check_resolved(config: Config, nodes: Iterable[tuple[str, str]], weighted: Collection[str] | None = None) -> None:
    """Each node's resolved config must be valid (its levels can combine into a spec no
    level alone states). Nodes without their own override resolve as their op type does:
    one of each is checked (ResNet-20's 112 nodes: 15 ms -> 2 ms). `weighted`: the nodes
    with a constant weight (None: all)."""
    checked: set[tuple[str, str, bool]] = set()
    for name, op_type in nodes:
        if is_excluded(config, name):
            continue
        has_weight = weighted is None or name in weighted
        key = (name if name in config.layer_quant_config else "", op_type, has_weight)  # names may repeat
        if key in checked:
            continue
        checked.add(key)
        resolved = resolve_node_config(config, name, op_type)
        if resolved is None:
            continue
        own = config.layer_quant_config.get(name) if key[0] else None
        for tensor_class in TENSOR_CLASSES:
            spec = getattr(resolved, tensor_class)
            if spec is not None:
                path = f"node {name!r} ({op_type}).{tensor_class} as resolved"
                check_spec(_plain_values(spec, _extended(config)), tensor_class, path, resolved=True)
            written = getattr(own, tensor_class) if own is not None else None
            if spec is not None and written is not None:  # its fields, with the method this node inherits
                values = {**_plain_values(written, _extended(config)), INHERITED: (spec.calib_method,)}
                check_spec(values, tensor_class, f"layer_quant_config[{name!r}].{tensor_class} ({op_type})")
        _check_float_weight({tc: getattr(resolved, tc) for tc in TENSOR_CLASSES}, f"node {name!r} ({op_type}) as resolved",
                            has_weight)


def _nearest(word: str, names: list[str]) -> str:
    hint = closest_name(word, names)
    return f"; did you mean '{hint}'?" if hint else "; see the node names with onnxq inspect MODEL --nodes"


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _extended(config: Config) -> bool:
    return _plain(config.quant_format) == "qdq-ext"


def _plain_values(spec: Any, extended: bool = False) -> dict[str, Any]:
    return {**{f.name: _plain(getattr(spec, f.name)) for f in fields(spec)}, EXTENDED: extended}


def _level_kinds(config: Config) -> list[str | None]:
    """The attribute of each level `_levels` lists (None: the global level)."""
    return [None] + [attr for attr in ("layer_type_quant_config", "layer_quant_config")
                     for _ in getattr(config, attr)]


def _inherited_methods(config: Config, attr: str | None, tensor_class: str) -> tuple[str, ...]:
    """The calibration methods a `tensor_class` spec of level `attr` (None: global) may
    inherit where it names none: the global one (else the default), and for a node
    override any op type override's too (which applies is known with the model only:
    `check_resolved` judges each such node)."""
    def method(level: QuantizationConfig | None) -> str | None:
        spec = getattr(level, tensor_class) if level is not None else None
        return None if spec is None or spec.calib_method is None else str(_plain(spec.calib_method))

    below = method(config.global_quant_config) if attr is not None else None
    methods = [below or str(_plain(SPEC_DEFAULTS["calib_method"]))]
    if attr == "layer_quant_config":
        methods += [m for level in config.layer_type_quant_config.values() if (m := method(level)) is not None]
    return tuple(dict.fromkeys(methods))


def _canonical_dtypes(config: Config) -> None:
    """A spec built in code with another tool's dtype name (`fp16`) holds onnxq's own
    (`DType`), as one read from a file does: merges and written configs compare names."""
    specs = [getattr(level, tc) for _, level in _levels(config) for tc in TENSOR_CLASSES]
    specs += [getattr(config, key) for key in LAYER_CLASS_FIELDS]
    for spec in specs:
        if isinstance(spec, QuantizationSpec) and isinstance(spec.dtype, str) \
                and spec.dtype.strip().lower() in DTYPE_ALIASES:
            spec.dtype = DType(spec.dtype)


def _levels(config: Config) -> list[tuple[str, QuantizationConfig]]:
    """Every `QuantizationConfig` in `config`, with its path."""
    levels = [("global_quant_config", config.global_quant_config)]
    for attr in ("layer_type_quant_config", "layer_quant_config"):
        levels += [(f"{attr}[{key!r}]", qc) for key, qc in getattr(config, attr).items()]
    return levels


def _eight_bit_weights(config: Config) -> bool:
    """Whether some level resolves a weight to int8/uint8 (what reduce_range narrows)."""
    specs = [merge_specs([level.weight for level in stack], "weight") for _, stack in _merged_levels(config)]
    specs += [merge_specs([getattr(config, key), config.global_quant_config.weight], "weight")
              for key in ("edge_weight", "depthwise_weight") if getattr(config, key) is not None]
    return any(s is not None and s.dtype in (DType.INT8, DType.UINT8) for s in specs)


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
    if calibration.sequence_length is not None and calibration.sequence_length < 1:
        raise ConfigError(
            f"invalid sequence_length {calibration.sequence_length} in calibration; use 1 or more tokens per "
            "window, or remove it for 256"
        )
    if calibration.max_memory_mb is not None and calibration.max_memory_mb < 0:
        raise ConfigError(
            f"invalid max_memory_mb {calibration.max_memory_mb} in calibration; use 0 or more MiB"
        )
    if config.reduce_range is True and not _eight_bit_weights(config):
        raise ConfigError("reduce_range true narrows int8 weights to 7 bits, and this recipe has no int8 weight (its "
                          "weights are float8, float16 or 4-bit); remove reduce_range")
    if config.accuracy_level not in (0, 1, 2, 3, 4):
        raise ConfigError(f"invalid accuracy_level {config.accuracy_level}; MatMulNBits takes 0 (unset), 1 (fp32), "
                          "2 (fp16), 3 (bf16) or 4 (int8)")
    if config.accuracy_level and not config.matmul_nbits:
        raise ConfigError(f"accuracy_level {config.accuracy_level} applies only to MatMulNBits; set matmul_nbits "
                          "true (as the W4_GROUP128 and W8_GROUP128 presets do) or remove accuracy_level")
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
                f"exclude entry '{entry}' is neither a node name nor a valid regex ({exc}); "
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
    twice = next((r for i, r in enumerate(mp.ladder) if r in mp.ladder[:i]), None)
    if twice is not None:
        raise ConfigError(f"ladder rung {twice!r} is listed twice in mixed_precision; list each rung once")
    # The search takes the first rung that meets the target: one after float (the costliest
    # model, and the most accurate) would be tried only where float itself falls short.
    after = [r for r in mp.ladder[mp.ladder.index("float") + 1:] if r in PRECISION_RUNGS] \
        if "float" in mp.ladder else []
    if after:
        raise ConfigError(f"ladder rung {after[0]!r} comes after 'float' in mixed_precision; rungs go cheapest "
                          "first and float is the costliest: put float last")
    if mp.target is not None:
        parse_target(mp.target)
    if mp.max_samples is not None and mp.max_samples < 1:
        raise ConfigError(f"invalid max_samples {mp.max_samples} in mixed_precision; use 1 or more")
    gain = mp.rung_min_gain  # a bool is an int to Python, not a gain
    if gain is not None and not (isinstance(gain, int | float) and not isinstance(gain, bool) and gain >= 0
                                 and math.isfinite(gain)):
        raise ConfigError(f"invalid rung_min_gain {mp.rung_min_gain!r} in mixed_precision; give a number of 0 "
                          "or more in the metric's units (0: any gain keeps a rung), or leave it out")
