"""The file paths a config holds: which fields they are (`PATH_FIELDS`), how a config
file's relative ones read (against the file's folder, where its author wrote them from;
flags and Python arguments stay relative to the working directory), how a written config
keeps them (relative to where it is written, so it reads back to the same files), and
which are a run's outputs (`OUTPUT_FIELDS`: left out of a config saved for reuse, whose
reruns would write over them)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from onnxq.config.spec import Config

PATH_FIELDS: tuple[tuple[str, str], ...] = (
    ("calibration", "save_ranges"),
    ("calibration", "load_ranges"),
    ("calibration", "stats"),
    ("calibration", "text"),
    ("mixed_precision", "eval_data"),
)
OUTPUT_FIELDS: tuple[tuple[str, str], ...] = (("calibration", "save_ranges"),)


def _rebased(value: Any, move: Callable[[str], str]) -> Any:
    """A path field's value with each relative path moved (a list: each entry)."""
    if isinstance(value, list):
        return [_rebased(v, move) for v in value]
    if isinstance(value, str | os.PathLike) and not os.path.isabs(value):
        return move(os.fspath(value))
    return value


def read_from(data: dict[str, Any], folder: str | os.PathLike) -> dict[str, Any]:
    """A config file's plain data with its relative paths read against `folder` (the
    file's), as paths relative to the working directory; `data` is left as it was."""
    data = copy.deepcopy(data)
    for section, key in PATH_FIELDS:
        block = data.get(section)
        if isinstance(block, dict) and block.get(key) is not None:
            block[key] = _rebased(block[key], lambda p: os.path.normpath(os.path.join(folder, p)))
    return data


def written_to(config: Config, folder: str | os.PathLike) -> Config:
    """A copy of `config` whose relative paths are relative to `folder` (where it is
    written), so `read_from` that folder gives the same files back."""
    return written_to_with(config, lambda p: os.path.relpath(p, folder or "."))


def absolute(config: Config) -> Config:
    """A copy of `config` whose relative paths are absolute: printed (`config show`), it
    reads back to the same files wherever it is saved."""
    return written_to_with(config, os.path.abspath)


def written_to_with(config: Config, move: Callable[[str], str]) -> Config:
    """A copy of `config` with each relative path of `PATH_FIELDS` moved by `move`."""
    config = copy.deepcopy(config)
    for section, key in PATH_FIELDS:
        block = getattr(config, section)
        if getattr(block, key) is not None:
            setattr(block, key, _rebased(getattr(block, key), move))
    return config


def for_reuse(config: Config) -> Config:
    """A copy of `config` without the run's output paths (`OUTPUT_FIELDS`): the config a
    run used, saved to run again (`--save-config`) without writing over those files."""
    config = copy.deepcopy(config)
    for section, key in OUTPUT_FIELDS:
        setattr(getattr(config, section), key, None)
    return config
