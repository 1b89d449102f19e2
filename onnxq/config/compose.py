"""One precedence rule for every config source: preset < config file or dict < explicit
flags or arguments; within each source, node > op type > global.

All three are dicts of the config-file shape, so a CLI flag, a YAML key and a Python
dict mean exactly the same thing. Nested mappings merge key by key; other values
(lists included) replace, except `exclude` and `float_op_types`, which accumulate, and
the pass lists (`pre_quant_opt_config`, `algo_config`), whose entries merge by `name`
(key by key); an
algorithm a higher source enables replaces those of its exclusive kind below it
(`registry.EXCLUSIVE`: AdaQuant over W4A8's AdaRound), and two of one kind in one source
are refused.

A spec field a higher source sets globally also replaces that field in the lower
sources' op-type and node overrides: `--per-group 32` over W4_GROUP128 (whose MatMul
override says 128) means 32 for MatMul too, not a flag silently outvoted by the preset.
Overrides that keep a tensor class float (dtype float32) stay as they are: a flag that
changes how tensors are quantized does not change which are. A higher source's
`calib_method` takes the lower sources' settings the new method does not read
(`percentile`, `num_bins`, unknown `calib_options`) with the method it replaces. Likewise a
higher source's `matmul_nbits: false` takes the lower sources' `accuracy_level` with it (the kernel's
attribute means nothing without the kernel).
A file or dict may name its base preset with a top-level `preset:` key (`none`: it is
the whole config, as the documents onnxq writes are); an explicit preset argument wins.
Where no source names one, the base is the default preset: U8S8, or the one the model's
kind picks (`config/defaults.py`), given as `default`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxq.calibrate.observers import OBSERVERS
from onnxq.config.convert import config_to_dict, entry_dict
from onnxq.config.io import NO_PRESET, bare_layer_class_dtypes, config_from_dict, read_config_dict
from onnxq.config.presets import PRESETS, get_preset
from onnxq.config.spec import ACTIVATION_CLASSES, SPEC_DEFAULTS, Config, DType
from onnxq.config.validate import validate_config
from onnxq.errors import ConfigError, closest_name, duplicate_entry

NAMED_LISTS = ("pre_quant_opt_config", "algo_config")
# Lists a higher source adds to: a file's `float_op_types: [Erf]` had replaced the preset's
# list, putting Softmax and LayerNormalization back into quantization without a word (an
# op-type override is what brings one of them back). A whole config (`preset: none`, as
# --save-config writes) gives its own list.
UNION_LISTS = ("exclude", "float_op_types")
OVERRIDE_LEVELS = ("layer_type_quant_config", "layer_quant_config")
METHOD_FIELDS = ("percentile", "num_bins")  # spec fields only some calibration methods read
DEFAULT_PRESET = "U8S8"  # where no source names a preset and the model's kind picks none (`defaults.py`)

# A default preset: its name, or a function that picks one, called only where no source
# names a preset (the model's kind is read only then).
Default = str | Callable[[], str]


def _name(default: Default) -> str:
    """The default preset's name (the function called, where it is one)."""
    return default if isinstance(default, str) else default()


def _merge_by_name(base: list[Any], override: list[Any], key: str = "algo_config") -> list[Any]:
    """Entries of `override` merge into same-named entries of `base` (their keys win, in
    place) or append. Two algorithms of one name in `override` are refused: merged, the
    second had silently replaced the first's options, where the Python API refused them."""
    once = [e.get("name") for e in override if isinstance(e, Mapping) and e.get("name") is not None]
    twice = next((name for i, name in enumerate(once) if name in once[:i]), None)
    if twice is not None and key == "algo_config":  # a pass may run twice (Python lists run as given)
        raise ConfigError(duplicate_entry(key, twice))
    merged = list(base)
    names = [e.get("name") if isinstance(e, Mapping) else None for e in merged]
    for entry in override:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if name is not None and name in names:
            at = names.index(name)
            merged[at] = {**merged[at], **entry} if isinstance(merged[at], Mapping) else entry
        else:
            merged.append(entry)
            names.append(name)
    return merged


# How an error of the overrides' layer is prefixed (`cli.flags.in_flag_terms` reads it).
OVERRIDES_SOURCE = "options"


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `override` merged into `base` recursively."""
    merged = dict(base)
    for key, value in override.items():
        if key in UNION_LISTS and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = merged[key] + [v for v in value if v not in merged[key]]
        elif key in NAMED_LISTS and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = _merge_by_name(merged[key], value, key)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _leaves_per_group(spec: Mapping[str, Any]) -> bool:
    """A spec that sets a scheme other than per_group (a group size then means nothing)."""
    scheme = spec.get("qscheme")
    return scheme is not None and str(getattr(scheme, "value", scheme)).lower() != "per_group"


def _replaced_algorithms(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` without the algorithms that those `override` enables exclude (one rounding
    learner, one block rounder: `registry.EXCLUSIVE`): AdaQuant over W4A8's AdaRound
    replaces it, as any higher setting replaces a lower one."""
    # imported here: the optimize modules import the config package
    from onnxq.optimize.registry import exclusive_with

    entries = override.get("algo_config")
    if not isinstance(entries, list) or not isinstance(base.get("algo_config"), list):
        return base
    named = {e.get("name") for e in entries if isinstance(e, Mapping)}
    gone = set().union(*(exclusive_with(e["name"]) for e in entries if isinstance(e, Mapping)
                         and isinstance(e.get("name"), str) and e.get("enabled", True))) - named
    kept = [e for e in base["algo_config"] if not (isinstance(e, Mapping) and e.get("name") in gone)]
    return base if len(kept) == len(base["algo_config"]) else {**base, "algo_config": kept}


def _yield_to(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` without the op-type and node settings of the spec fields that `override`
    sets globally (module doc): a higher source's global setting beats them."""
    base = _replaced_algorithms(base, override)
    if override.get("matmul_nbits") is False and "accuracy_level" in base:  # the level goes with the kernel
        base = {key: value for key, value in base.items() if key != "accuracy_level"}
    top = override.get("global_quant_config")
    if not isinstance(top, Mapping):
        return base
    base = copy.deepcopy(base)
    below = base.get("global_quant_config")
    below = below if isinstance(below, dict) else {}
    was = {tensor_class: _method(spec) for tensor_class, spec in below.items()}  # before any change
    for attr in OVERRIDE_LEVELS:
        for level in (base.get(attr) or {}).values():
            if not isinstance(level, dict):
                continue
            for tensor_class, spec in top.items():
                lower = level.get(tensor_class)
                keeps_float = isinstance(lower, dict) and _names_float32(lower.get("dtype"))
                if isinstance(spec, Mapping) and isinstance(lower, dict) and not keeps_float:
                    inherited = _method(lower) or was.get(tensor_class)
                    for key in spec:
                        lower.pop(key, None)
                    if _leaves_per_group(spec):  # its blocks go with it
                        lower.pop("group_size", None)
                    _drop_unread(lower, spec, inherited)
    for tensor_class, spec in top.items():  # globally too: blocks go with per_group, settings with a method
        lower = below.get(tensor_class)
        if isinstance(spec, Mapping) and isinstance(lower, dict):
            if _leaves_per_group(spec):
                lower.pop("group_size", None)
            _drop_unread(lower, spec, was.get(tensor_class))
    return base


def _method(spec: Any) -> str:
    """A source's spec's calibration method as its registered name ('' where it sets none)."""
    method = spec.get("calib_method") if isinstance(spec, Mapping) else None
    return "" if method is None else str(getattr(method, "value", method)).strip().lower()


def _drop_unread(lower: dict[str, Any], spec: Mapping[str, Any], was: str | None) -> None:
    """A lower source's settings that only its calibration method read, dropped where a
    higher source's `spec` sets another (`was`: the method the lower level had, its own or
    inherited; none: the default): the user asked for that method, so the old one's
    percentile, bins and options go with it, as a flag's value beats a file's."""
    method = _method(spec)
    observer = OBSERVERS.get(method)
    if observer is None or method == (was or _method(SPEC_DEFAULTS)):
        return  # no method set (or an unknown one, which the validation names), or the same one
    for key in METHOD_FIELDS:
        if key not in observer.spec_fields:
            lower.pop(key, None)
    options = lower.get("calib_options")
    if isinstance(options, Mapping):
        known = {f.name for f in dataclasses.fields(observer.options_class)} if observer.options_class else set()
        lower["calib_options"] = {key: value for key, value in options.items() if key in known}
        if not lower["calib_options"]:
            del lower["calib_options"]


def _names_float32(dtype: Any) -> bool:
    """Whether a source's dtype value is float32 by any of its names (`fp32`: `DType`)."""
    try:
        return dtype is not None and DType(str(dtype).strip().lower()) is DType.FLOAT32
    except ValueError:  # not a type at all: the conversion names it
        return False


def overlay(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` (a higher-precedence source) over `base`, by the module's rule."""
    return deep_merge(_yield_to(dict(base), override), override)


def compose_config(
    preset: str | None = None,
    config_file: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    default: Default = DEFAULT_PRESET,
    *,
    label: str = "overrides",
) -> Config:
    """The config made of a preset, a file over it, and overrides over both.

    The preset is `preset`, else the file's or the overrides' `preset:` key, else `default`;
    `none` means no preset: the sources are the whole config (as onnxq writes configs).
    `default` (a name, or a function that picks one) is called only where no source names
    the preset. `label`: what an error in the overrides calls them, as the caller named
    them (`quantize`'s dict is its `config`; the command line's flags are `OVERRIDES_SOURCE`).
    """
    if isinstance(config_file, Mapping):  # compose_config("S8S8", {...}): overrides in the file's place
        raise ConfigError("compose_config's second argument is a config file path, and a dict was given; pass "
                          "the overrides third or by name: compose_config(preset, None, overrides) or "
                          "compose_config(preset, overrides=...)")
    sources = []
    if config_file is not None:
        sources.append((str(config_file), read_config_dict(config_file)))
    if overrides:
        overrides = {key: [entry_dict(e) for e in value] if key in NAMED_LISTS and isinstance(value, list)
                     else value for key, value in overrides.items()}
        sources.append((label, overrides))
    for _, source in sources:
        bare_layer_class_dtypes(source)
    named = [(where, source.pop("preset")) for where, source in sources if "preset" in source]
    whole = [where for where, name in named if isinstance(name, str) and name.lower() == NO_PRESET]
    if preset is not None and preset.lower() != NO_PRESET and whole:
        raise ConfigError(f"{whole[0]} is a whole config (preset: {NO_PRESET}, as --save-config writes), so preset "
                          f"{preset} would change nothing; leave the preset out, or edit the file")
    base = preset or (named[-1][1] if named else None) or _name(default)
    if not isinstance(base, str):
        raise ConfigError(f"preset must be a preset name such as {DEFAULT_PRESET}, got {base!r}")
    stack = [config_to_dict(Config() if base.lower() == NO_PRESET else get_preset(base))]
    no_preset = base.lower() == NO_PRESET and preset is not None  # `--preset none`: no list to add to
    if any((where in whole or no_preset) and "float_op_types" in source for where, source in sources):
        stack[0]["float_op_types"] = []  # a whole config's list is the list (`UNION_LISTS` add to a preset's)
    for where, source in sources:
        if source.get("float_op_types") == [] and where not in whole and not no_preset and stack[0]["float_op_types"]:
            kept = stack[0]["float_op_types"]
            raise ConfigError(f"{where}: float_op_types [] adds nothing to the preset's list ({', '.join(kept)}): "
                              f"to quantize one of them, give it an op-type override (layer_type_quant_config: "
                              f"{{{kept[0]}: {{}}}})")
        _no_activations_created(stack[-1], source, base, where)
        try:
            stack.append(overlay(stack[-1], source))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    try:
        return config_from_dict(stack[-1])
    except ConfigError as exc:
        raise ConfigError(f"{_blame(stack, sources)}: {exc}") from None


def _no_activations_created(base: Mapping[str, Any], source: dict[str, Any], preset: str, where: str) -> None:
    """Refuse a source that gives activation fields but no dtype where the config so far
    quantizes no activations: merged, they would make a spec of the default dtype and turn
    a weight-only recipe static (`--calib-method percentile` over W4_GROUP128 lost its
    MatMulNBits). A `scale_type` the source gives the weights too is dropped there instead
    (the flag `--scale-type` writes both)."""
    top = source.get("global_quant_config")
    below = base.get("global_quant_config") or {}
    if not isinstance(top, dict) or preset.lower() == NO_PRESET or any(
            below.get(tensor_class) is not None for tensor_class in ACTIVATION_CLASSES):
        return  # a whole config, or a recipe that quantizes activations: fields merge as given
    weight = top.get("weight") if isinstance(top.get("weight"), Mapping) else {}
    for tensor_class in ACTIVATION_CLASSES:
        spec = top.get(tensor_class)
        if not isinstance(spec, dict) or "dtype" in spec or below.get(tensor_class) is not None:
            continue
        fields = {key: value for key, value in spec.items()
                  if not (key == "scale_type" and weight.get("scale_type") == value)}
        if not fields:  # a new mapping: the caller's dict stays as given
            top = source["global_quant_config"] = {k: v for k, v in top.items() if k != tensor_class}
            continue
        key, value = next(iter(fields.items()))
        raise ConfigError(f"{where}: {key} {value} has no activations to apply to in global_quant_config."
                          f"{tensor_class}; the recipe ({preset}) leaves them float: remove it (for static "
                          "activations start from a static preset such as U8S8)")


def _blame(stack: list[dict[str, Any]], sources: list[tuple[str, dict[str, Any]]]) -> str:
    """The first source whose layer makes the config invalid (for the error's prefix)."""
    for (where, _), layers in zip(sources, stack[1:], strict=True):
        try:
            config_from_dict(layers)
        except ConfigError:
            return where
    return sources[-1][0] if sources else "preset"


def load_config(path: str | os.PathLike[str]) -> Config:
    """A `.yaml`, `.yml` or `.json` config file over its `preset:` (default U8S8), checked.

    Every problem, in the file or in the config it holds, is a one-line `ConfigError`
    that starts with the file name.
    """
    return compose_config(None, path)


@dataclass(frozen=True)
class ConfigSources:
    """The sources `compose_config` lays over each other, as one config argument: what the
    command line passes (--preset, --config, the other flags)."""

    preset: str | None = None
    config_file: str | os.PathLike | None = None
    overrides: Mapping[str, Any] | None = None


ConfigLike = Config | ConfigSources | Mapping[str, Any] | str | os.PathLike | None


def _own_copy(config: Config) -> Config:
    """A copy of `config` that validation may normalise: specs and levels copied deep, the
    pass and algorithm entry lists and dict entries one level deep, their values shared (a
    plugin's option may hold a callback, a lock or the caller's own collector)."""
    memo: dict[int, Any] = {}
    for key in NAMED_LISTS:
        entries = getattr(config, key)
        if isinstance(entries, list | tuple):
            memo[id(entries)] = [dict(e) if isinstance(e, dict) else e for e in entries]
    return copy.deepcopy(config, memo)


def as_config(config: ConfigLike, default: Default = DEFAULT_PRESET) -> Config:
    """What the Python API accepts as a config, read by the module's rule: a `Config`
    (complete as given), `ConfigSources`, a dict (overrides on `default`, or on its
    `preset:`), a preset name (any case) or a YAML/JSON path; None is `default`."""
    if config is None:
        return get_preset(_name(default))
    if isinstance(config, Config):  # validated on a copy: it normalises in place, and the caller's stays theirs
        config = _own_copy(config)
        validate_config(config)
        return config
    if isinstance(config, ConfigSources):
        return compose_config(config.preset, config.config_file, config.overrides, default, label=OVERRIDES_SOURCE)
    if isinstance(config, Mapping):
        return compose_config(None, None, config, default, label="config")
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(f"config must be a Config, a dict, a preset name or a YAML/JSON path; got "
                          f"{type(config).__name__} {config!r:.60}")
    if isinstance(config, str) and config.upper() in {name.upper() for name in PRESETS}:
        return get_preset(config)
    if Path(config).is_file():
        return compose_config(None, config, None, default)
    if Path(config).suffix.lower() in (".yaml", ".yml", ".json", ".prototxt", ".cfg"):
        raise ConfigError(f"config file not found: {config}")
    hint = closest_name(str(config), list(PRESETS)) if isinstance(config, str) else None
    did_you_mean = f"did you mean '{hint}'? " if hint else ""
    raise ConfigError(f"config {str(config)!r} is neither a preset nor a file; {did_you_mean}"
                      f"presets: {', '.join(PRESETS)}")
