"""Convert between plain data (as parsed from YAML/JSON) and the config dataclasses.

Conversion is strict and generic: it walks `dataclasses.fields` and the type hints of
`onnxq.config.spec`, so a new field needs no code here. Unknown keys, bad enum values
and wrong value types are `ConfigError`s that name where they are and what would fit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from enum import Enum
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from onnxq.config.ort_options import ORT_KEYS
from onnxq.config.spec import DTYPE_AMBIGUOUS, Config, DType, QuantizationSpec, enum_text
from onnxq.errors import ConfigError, closest_name

# Wording for type errors, by expected Python type.
_EXPECTED = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}



# ---------------------------------------------------------------------------------------
# plain data -> dataclasses


def spec_from_dict(d: Mapping[str, Any], where: str = "spec") -> QuantizationSpec:
    """Build one `QuantizationSpec` from plain data; `where` names it in error messages."""
    return convert(d, QuantizationSpec, "", where)


def bare_dtype(value: Any) -> Any:
    """A layer-class key's value as a file may write it: a dtype name means a spec of that
    dtype, `none` no spec; anything else as it is."""
    if isinstance(value, str):
        return None if value.lower() == "none" else {"dtype": value}
    return value


def check_types(config: Config) -> None:
    """Raise `ConfigError` if a `Config` built in code holds values of the wrong type; set
    the enum fields it holds as strings to their members, as a file's are read (in any
    case: `quant_format = "QOperator"` compared equal to no member and wrote plain QDQ)."""
    canonical_enums(config, convert(config_to_dict(config), Config, "", ""))


def canonical_enums(target: Any, checked: Any) -> None:
    """The enum members of `checked` (the converted copy of `target`) set in `target` where
    it holds them as plain strings, through dataclasses, dicts and lists."""
    if is_dataclass(target) and not isinstance(target, type) and is_dataclass(checked):
        for f in fields(target):
            mine, theirs = getattr(target, f.name), getattr(checked, f.name, None)
            if isinstance(theirs, Enum) and isinstance(mine, str) and not isinstance(mine, Enum):
                setattr(target, f.name, theirs)
            else:
                canonical_enums(mine, theirs)
    elif isinstance(target, dict) and isinstance(checked, Mapping):
        for key, value in target.items():
            if key in checked:
                canonical_enums(value, checked[key])
    elif isinstance(target, list) and isinstance(checked, list) and len(target) == len(checked):
        for mine, theirs in zip(target, checked):
            canonical_enums(mine, theirs)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _join(parent: str, name: str) -> str:
    """Path of `name` inside `parent`: `a.b`, `a['key']` or `a[0]`."""
    if name.startswith("["):
        return parent + name
    return f"{parent}.{name}" if parent else name


def convert(value: Any, tp: Any, parent: str, name: str) -> Any:
    """Convert `value` to type `tp`; `parent` and `name` locate it for error messages."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_optional(value, tp, parent, name)
    if tp is Any:
        return copy.deepcopy(value)
    if origin is list:
        return _convert_list(value, get_args(tp)[0], parent, name)
    if origin is dict:
        return _convert_dict(value, get_args(tp)[1], parent, name)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _convert_enum(value, tp, parent, name)
    if is_dataclass(tp):
        return _convert_dataclass(value, tp, parent, name)
    return _convert_scalar(value, tp, parent, name)


def _convert_optional(value: Any, tp: Any, parent: str, name: str) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    if value is None and len(args) < len(get_args(tp)):
        return None
    if len(args) == 2 and args[1] is str and isinstance(args[0], type) and issubclass(args[0], Enum):
        return _convert_open_enum(value, args[0], parent, name)
    if len(args) != 1:
        raise TypeError(f"onnxq.config.io cannot convert union type {tp}")
    return convert(value, args[0], parent, name)


def type_error(value: Any, expected: type, parent: str, name: str) -> ConfigError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    path = _join(parent, name) or "config"
    wanted = _EXPECTED.get(expected, f"a {expected.__name__}")
    return ConfigError(f"{path} must be {wanted}, got {type(value).__name__} {shown}")


def _convert_scalar(value: Any, tp: type, parent: str, name: str) -> Any:
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise type_error(value, tp, parent, name)


def _convert_list(value: Any, item_tp: Any, parent: str, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise type_error(value, list, parent, name)
    path = _join(parent, name)
    return [convert(item, item_tp, path, f"[{i}]") for i, item in enumerate(value)]


def _convert_dict(value: Any, value_tp: Any, parent: str, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise type_error(value, dict, parent, name)
    path = _join(parent, name)
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} in {path} must be a string; quote it in the file")
        out[key] = convert(item, value_tp, path, f"[{key!r}]")
    return out


def _convert_open_enum(value: Any, tp: type[Enum], parent: str, name: str) -> Enum | str:
    """`Enum | str`: a member when `value` names one, else the string itself (a name from
    an open registry, checked by `validate` against that registry)."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, str):
        raise type_error(value, str, parent, name)
    for member in tp:
        if enum_text(member.value) == enum_text(value):
            return member
    return value


def _convert_enum(value: Any, tp: type[Enum], parent: str, name: str) -> Enum:
    if isinstance(value, tp):
        return value
    valid = [m.value for m in tp]
    if isinstance(value, str):
        for member in tp:
            if enum_text(member.value) == enum_text(value):
                return member
        with contextlib.suppress(ValueError):
            return tp(value)  # an alias the enum takes (`DType._missing_`: fp16, bf16)
    where = parent or "config"
    # Stricter than for keys: enum values are short, and 'int9' is no typo of 'int8'.
    hint = closest_name(value, valid, cutoff=0.8) if isinstance(value, str) else None
    if tp is DType and isinstance(value, str):
        hint = DTYPE_AMBIGUOUS.get(enum_text(value), hint)
    did_you_mean = f"did you mean '{hint}'? " if hint else ""
    raise ConfigError(
        f"invalid {name} {value!r} in {where}; {did_you_mean}valid values: {', '.join(valid)}"
    )


def _convert_dataclass(value: Any, cls: type, parent: str, name: str) -> Any:
    if isinstance(value, cls):
        value = config_to_dict(value)
    if not isinstance(value, Mapping):
        raise type_error(value, dict, parent, name)
    path = _join(parent, name)
    valid = [f.name for f in fields(cls)]
    for key in value:
        if key not in valid:
            raise _unknown_key(key, valid, path)
    hints = _hints(cls)
    return cls(**{key: convert(item, hints[key], path, key) for key, item in value.items()})


def _unknown_key(key: Any, valid: list[str], path: str) -> ConfigError:
    where = path or "config"
    candidates = valid if path else [*valid, "preset"]  # a file's `preset` is read before its fields
    if not path and key in ORT_KEYS:
        return ConfigError(f"unknown key {key!r} in config: that is onnxruntime.quantization's name; in onnxq it is "
                           f"{ORT_KEYS[key]} (onnxq.ort_compat.quantize_static takes onnxruntime's arguments as they "
                           "are)")
    hint = closest_name(key, candidates) if isinstance(key, str) else None
    if hint:
        return ConfigError(f"unknown key {key!r} in {where}; did you mean '{hint}'?")
    return ConfigError(f"unknown key {key!r} in {where}; valid keys: {', '.join(candidates)}")


# ---------------------------------------------------------------------------------------
# dataclasses -> plain data


def config_to_dict(config: Any) -> Any:
    """Plain YAML/JSON-safe data for a `Config` (or any part of one).

    Enums become their string values; fields that are `None` and default to `None` are
    left out, so specs stay short. `config_from_dict(config_to_dict(c)) == c`.
    """
    if is_dataclass(config) and not isinstance(config, type):
        if getattr(type(config), "ALGORITHM", None):  # a typed pass/algorithm entry: named
            return config_to_dict(entry_dict(config))
        return {
            f.name: config_to_dict(getattr(config, f.name))
            for f in fields(config)
            if not (getattr(config, f.name) is None and _defaults_to_none(f))
        }
    if isinstance(config, Enum):
        return config.value
    if isinstance(config, Mapping):
        return {key: config_to_dict(item) for key, item in config.items()}
    if isinstance(config, (list, tuple)):
        return [config_to_dict(item) for item in config]
    return config


def _defaults_to_none(f: Any) -> bool:
    return f.default is None or (f.default is MISSING and f.default_factory is MISSING)


def entry_dict(entry: Any) -> Any:
    """A typed pass or algorithm config (a dataclass naming its algorithm in the class
    attribute `ALGORITHM`, e.g. `AdaRoundConfig(num_iteration=500)`) as its dict entry;
    anything else unchanged."""
    name = getattr(type(entry), "ALGORITHM", None)
    if not name or not dataclasses.is_dataclass(entry) or isinstance(entry, type):
        return entry
    values = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    return {"name": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}
