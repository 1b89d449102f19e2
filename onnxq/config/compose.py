"""Layer configuration sources: preset < config file < explicit overrides.

All three are dicts of the config-file shape, so a CLI flag, a YAML key and a Python
dict mean exactly the same thing. Nested mappings merge key by key; other values
(lists included) replace, except `exclude`, which accumulates, and the pass lists
(`pre_quant_opt_config`, `algo_config`), whose entries merge by `name` (key by key).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from onnxq.config.io import config_from_dict, config_to_dict, read_config_dict
from onnxq.config.presets import get_preset
from onnxq.config.spec import Config
from onnxq.errors import ConfigError

NAMED_LISTS = ("pre_quant_opt_config", "algo_config")


def _merge_by_name(base: list[Any], override: list[Any]) -> list[Any]:
    """Entries of `override` merge into same-named entries of `base` (their keys win, in
    place) or append."""
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


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `override` merged into `base` recursively."""
    merged = dict(base)
    for key, value in override.items():
        if key == "exclude" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = merged[key] + [v for v in value if v not in merged[key]]
        elif key in NAMED_LISTS and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = _merge_by_name(merged[key], value)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def compose_config(
    preset: str | None = None,
    config_file: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The config made of a preset (default U8S8), a file over it, and overrides over both."""
    layers = config_to_dict(get_preset(preset or "U8S8"))
    where = "options"
    if config_file is not None:
        layers = deep_merge(layers, read_config_dict(config_file))
        where = str(config_file)
    if overrides:
        layers = deep_merge(layers, overrides)
    try:
        return config_from_dict(layers)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
