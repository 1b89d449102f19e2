"""Read and write configs as plain dicts, YAML and JSON (and read AMCT's simplified
configs): the files and documents around the typed conversion of `config.convert`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from onnxq.config.amct import AMCT_SUFFIXES, looks_like_amct, read_amct
from onnxq.config.convert import bare_dtype, config_to_dict, convert, type_error
from onnxq.config.paths import read_from, written_to
from onnxq.config.spec import LAYER_CLASS_FIELDS, Config
from onnxq.config.validate import validate_config
from onnxq.errors import ConfigError
from onnxq.graph.save import write_text_atomic

YAML_SUFFIXES = (".yaml", ".yml")
# The `preset:` value of a complete config: nothing comes from a preset.
NO_PRESET = "none"
JSON_SUFFIXES = (".json",)


# ---------------------------------------------------------------------------------------
# plain data -> Config


def config_from_dict(d: Mapping[str, Any]) -> Config:
    """Build a `Config` from plain data (as parsed from YAML/JSON) and validate it.

    The data is the whole config (fields it leaves out take `Config`'s defaults); a
    `preset: none` key, which documents onnxq writes, says just that. To lay data over a
    preset, use `onnxq.config.compose_config` or `as_config`.
    """
    if not isinstance(d, Mapping):
        raise type_error(d, dict, "", "")
    d = dict(d)
    base = d.pop("preset", NO_PRESET)
    if not isinstance(base, str) or base.lower() != NO_PRESET:
        raise ConfigError(f"preset {base!r} in a whole config; read it with onnxq.config.as_config "
                          "or compose_config, which lay it over its preset")
    bare_layer_class_dtypes(d)
    config = convert(d, Config, "", "")
    validate_config(config)
    return config


def bare_layer_class_dtypes(source: dict[str, Any]) -> None:
    """`edge_weight: uint8` (a dtype alone, as --edge-weight-type takes it) means its dtype
    field, merged over the lower sources' spec like the flag; `none` means null. In place.
    The same for every layer-class key (`LAYER_CLASS_FIELDS`)."""
    for key in LAYER_CLASS_FIELDS:
        if key in source:
            source[key] = bare_dtype(source[key])


# ---------------------------------------------------------------------------------------
# documents


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
        if not any(line.strip() and not line.lstrip().startswith("#") for line in text.splitlines()):
            raise ConfigError(f"{p}: the config file is empty (only comments); give AMCT's fields, or leave --config "
                              "out")  # read, it would switch the activations to AMCT's default IFMR
        return read_amct(text, p)
    data = _parse(text, p)
    if data is None:
        raise ConfigError(f"{p}: the config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: config must be a mapping, got {type(data).__name__}")
    return read_from(data, p.parent)


def save_config(config: Config, path: str | os.PathLike[str]) -> None:
    """Write `config` as YAML or JSON, chosen by the suffix of `path`; its relative file
    paths relative to the file's folder, against which reading it takes them (`paths`)."""
    if not isinstance(config, Config):
        raise ConfigError(f"save_config takes a Config, got {type(config).__name__} {config!r:.60}; "
                          "onnxq.get_preset(NAME) or onnxq.as_config(...) gives one")
    p = Path(path)
    config = written_to(config, p.parent)  # read back against its folder: the same files
    text = config_to_json(config) if _format_of(p) == "json" else config_to_yaml(config)
    try:
        write_text_atomic(p, text)
    except OSError as e:
        raise ConfigError(f"cannot write config file {p}: {e.strerror or e}") from None


def _format_of(p: Path, text: str | None = None) -> str:
    """yaml, json or (reading, given the `text`) amct: by suffix, else by content."""
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
        return p.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not JSON
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


# YAML 1.1 (PyYAML) reads a number in exponent form without a dot ("1e-2", "5E3") as a
# string, which a number option then refuses (`search_step: 1e-2`: "must be a number, got
# '1e-2'"). YAML 1.2 and JSON read it as a number; so does onnxq.
_STRICT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
_StrictYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _STRICT_FLOAT, list("-+0123456789"))


def yaml_value(text: str) -> Any:
    """A YAML scalar or document as the config files read it (`--calib-option k=1e-2`)."""
    return yaml.load(text, Loader=_StrictYamlLoader)
