"""Read and write configs as plain dicts, YAML and JSON.

Conversion is strict and generic: it walks `dataclasses.fields` and the type hints of
`onnxq.config.spec`, so a new field needs no code here. Unknown keys, bad enum values
and wrong value types are `ConfigError`s that name where they are and what would fit.
"""

from __future__ import annotations

import copy
import json
import os
import types
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from onnxq.config.spec import EDGE_FIELDS, Config, QuantizationSpec
from onnxq.errors import ConfigError, closest_name  # noqa: F401 (closest_name: this module's, for its importers)

YAML_SUFFIXES = (".yaml", ".yml")
# The `preset:` value of a complete config: nothing comes from a preset.
NO_PRESET = "none"
JSON_SUFFIXES = (".json",)

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
# dict -> dataclasses


def config_from_dict(d: Mapping[str, Any]) -> Config:
    """Build a `Config` from plain data (as parsed from YAML/JSON) and validate it.

    The data is the whole config (fields it leaves out take `Config`'s defaults); a
    `preset: none` key, which documents onnxq writes, says just that. To lay data over a
    preset, use `onnxq.config.compose_config` or `as_config`.
    """
    from onnxq.config.validate import validate_config

    if not isinstance(d, Mapping):
        raise _type_error(d, dict, "", "")
    d = dict(d)
    base = d.pop("preset", NO_PRESET)
    if not isinstance(base, str) or base.lower() != NO_PRESET:
        raise ConfigError(f"preset {base!r} in a whole config; read it with onnxq.config.as_config "
                          "or compose_config, which lay it over its preset")
    bare_edge_dtypes(d)
    config = _convert(d, Config, "", "")
    validate_config(config)
    return config


def bare_edge_dtypes(source: dict[str, Any]) -> None:
    """`edge_weight: uint8` (a dtype alone, as --edge-weight-type takes it) means its dtype
    field, merged over the lower sources' spec like the flag; `none` means null. In place."""
    for key in EDGE_FIELDS:
        if isinstance(source.get(key), str):
            source[key] = None if source[key].lower() == "none" else {"dtype": source[key]}


def spec_from_dict(d: Mapping[str, Any], where: str = "spec") -> QuantizationSpec:
    """Build one `QuantizationSpec` from plain data; `where` names it in error messages."""
    return _convert(d, QuantizationSpec, "", where)


def check_types(config: Config) -> None:
    """Raise `ConfigError` if a `Config` built in code holds values of the wrong type."""
    _convert(config_to_dict(config), Config, "", "")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _join(parent: str, name: str) -> str:
    """Path of `name` inside `parent`: `a.b`, `a['key']` or `a[0]`."""
    if name.startswith("["):
        return parent + name
    return f"{parent}.{name}" if parent else name


def _convert(value: Any, tp: Any, parent: str, name: str) -> Any:
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
    return _convert(value, args[0], parent, name)


def _type_error(value: Any, expected: type, parent: str, name: str) -> ConfigError:
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
    raise _type_error(value, tp, parent, name)


def _convert_list(value: Any, item_tp: Any, parent: str, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _type_error(value, list, parent, name)
    path = _join(parent, name)
    return [_convert(item, item_tp, path, f"[{i}]") for i, item in enumerate(value)]


def _convert_dict(value: Any, value_tp: Any, parent: str, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _type_error(value, dict, parent, name)
    path = _join(parent, name)
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} in {path} must be a string; quote it in the file")
        out[key] = _convert(item, value_tp, path, f"[{key!r}]")
    return out


def _convert_open_enum(value: Any, tp: type[Enum], parent: str, name: str) -> Enum | str:
    """`Enum | str`: a member when `value` names one, else the string itself (a name from
    an open registry, checked by `validate` against that registry)."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, str):
        raise _type_error(value, str, parent, name)
    for member in tp:
        if member.value.lower() == value.strip().lower():
            return member
    return value


def _convert_enum(value: Any, tp: type[Enum], parent: str, name: str) -> Enum:
    if isinstance(value, tp):
        return value
    valid = [m.value for m in tp]
    if isinstance(value, str):
        for member in tp:
            if member.value.lower() == value.strip().lower():
                return member
    where = parent or "config"
    # Stricter than for keys: enum values are short, and 'int9' is no typo of 'int8'.
    hint = closest_name(value, valid, cutoff=0.8) if isinstance(value, str) else None
    did_you_mean = f"did you mean '{hint}'? " if hint else ""
    raise ConfigError(
        f"invalid {name} {value!r} in {where}; {did_you_mean}valid values: {', '.join(valid)}"
    )


def _convert_dataclass(value: Any, cls: type, parent: str, name: str) -> Any:
    if isinstance(value, cls):
        value = config_to_dict(value)
    if not isinstance(value, Mapping):
        raise _type_error(value, dict, parent, name)
    path = _join(parent, name)
    valid = [f.name for f in fields(cls)]
    for key in value:
        if key not in valid:
            raise _unknown_key(key, valid, path)
    hints = _hints(cls)
    return cls(**{key: _convert(item, hints[key], path, key) for key, item in value.items()})


def _unknown_key(key: Any, valid: list[str], path: str) -> ConfigError:
    where = path or "config"
    hint = closest_name(key, valid) if isinstance(key, str) else None
    if hint:
        return ConfigError(f"unknown key {key!r} in {where}; did you mean '{hint}'?")
    return ConfigError(f"unknown key {key!r} in {where}; valid keys: {', '.join(valid)}")


# ---------------------------------------------------------------------------------------
# dataclasses -> dict


def config_to_dict(config: Any) -> Any:
    """Plain YAML/JSON-safe data for a `Config` (or any part of one).

    Enums become their string values; fields that are `None` and default to `None` are
    left out, so specs stay short. `config_from_dict(config_to_dict(c)) == c`.
    """
    if is_dataclass(config) and not isinstance(config, type):
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


def config_document(config: Config) -> dict[str, Any]:
    """`config_to_dict` headed by `preset: none`: the document is the whole config, so
    reading it back (over no preset) gives `config` exactly."""
    return {"preset": NO_PRESET, **config_to_dict(config)}


def config_to_yaml(config: Config) -> str:
    """The config as a complete YAML document (`config_document`), in field order."""
    try:
        return yaml.safe_dump(config_document(config), sort_keys=False, default_flow_style=False)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot write config as YAML: {_one_line(e)}") from None


def config_to_json(config: Config) -> str:
    """The config as a complete, indented JSON document (`config_document`), in field order."""
    try:
        return json.dumps(config_document(config), indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot write config as JSON: {e}") from None


# ---------------------------------------------------------------------------------------
# files


def read_config_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a `.yaml`, `.yml` or `.json` config file, or an AMCT simplified config
    (`.cfg`, or any suffix with AMCT's fields: `onnxq.config.amct`), into a plain dict (not
    yet checked)."""
    p = Path(path)
    text = _read_text(p)
    if _format_of(p, text) == "amct":
        from onnxq.config.amct import read_amct

        return read_amct(text, p)
    data = _parse(text, p)
    if data is None:
        raise ConfigError(f"{p}: the config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: config must be a mapping, got {type(data).__name__}")
    return data


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write `config` as YAML or JSON, chosen by the suffix of `path`."""
    p = Path(path)
    text = config_to_json(config) if _format_of(p) == "json" else config_to_yaml(config)
    from onnxq.graph.save import write_text_atomic

    try:
        write_text_atomic(p, text)
    except OSError as e:
        raise ConfigError(f"cannot write config file {p}: {e.strerror or e}") from None


def _format_of(p: Path, text: str | None = None) -> str:
    """yaml, json or (reading, given the `text`) amct: by suffix, else by content."""
    from onnxq.config.amct import AMCT_SUFFIXES, looks_like_amct

    suffix = p.suffix.lower()
    if suffix in YAML_SUFFIXES:
        return "yaml"
    if suffix in JSON_SUFFIXES:
        return "json"
    if text is not None and (suffix in AMCT_SUFFIXES or looks_like_amct(text)):
        return "amct"
    if text is None:
        raise ConfigError(f"cannot write config file {p}: unsupported suffix '{p.suffix}'; "
                          "use .yaml, .yml or .json")
    raise ConfigError(
        f"config file {p} has unsupported suffix '{p.suffix}'; use .yaml, .yml, .json "
        "or an AMCT simplified config (.cfg)"
    )


def _read_text(p: Path) -> str:
    if not p.exists():
        raise ConfigError(f"config file {p} not found")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config file {p}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None


def _parse(text: str, p: Path) -> Any:
    try:
        if _format_of(p) == "json":
            return json.loads(text, object_pairs_hook=_json_object) if text.strip() else None
        return yaml.load(text, Loader=_StrictYamlLoader)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"cannot parse config file {p}: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except (yaml.YAMLError, ValueError) as e:
        raise ConfigError(f"cannot parse config file {p}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    """A parse error in one line, with its 1-based position where known."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{e.problem}{where}"
    return " ".join(str(e).split())


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


class _StrictYamlLoader(yaml.SafeLoader):
    """A `SafeLoader` that rejects duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Mapping | list):
                continue  # unhashable; the config walk rejects it with a clearer message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
