"""Checks and parsing of argument values that several commands share: KEY=VALUE flags,
counts of at least 1, readable model files (or model folders)."""

from __future__ import annotations

import argparse
from typing import Any

from onnxq.config.io import yaml_value
from onnxq.errors import OnnxqError
from onnxq.graph.folder import open_folder
from onnxq.graph.load import check_readable


def key_values(items: list[str], flag: str = "--calib-option") -> dict[str, Any]:
    """Parse KEY=VALUE flags; values are YAML scalars (numbers, true/false, strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OnnxqError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = yaml_value(value)
    return out


def check_counts(args: argparse.Namespace, *flags: str) -> None:
    """Each count flag given (`--max-samples`, `--batch-size`, `--shards`) is at least 1."""
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise OnnxqError(f"invalid {flag} {value}; use 1 or more, or leave it out")


def check_model_files(args: argparse.Namespace, *fields: str) -> None:
    """Each model argument `fields` names exists and can be read (a clear message before
    any work starts); a model folder (onnxruntime-genai, or one holding one .onnx) stands
    for its model file, as `quantize` takes it."""
    for name in fields:
        folder = open_folder(getattr(args, name))
        if folder is not None:
            setattr(args, name, str(folder.model))
        check_readable(getattr(args, name))
