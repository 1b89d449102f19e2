"""Checks and parsing of argument values that several commands share: KEY=VALUE flags,
counts of at least 1, readable model files."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from onnxq.errors import OnnxqError
from onnxq.graph.load import check_readable


def key_values(items: list[str], flag: str = "--calib-option") -> dict[str, Any]:
    """Parse KEY=VALUE flags; values are YAML scalars (numbers, true/false, strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OnnxqError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def check_counts(args: argparse.Namespace, *flags: str) -> None:
    """Each count flag given (`--max-samples`, `--batch-size`, `--shards`) is at least 1."""
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise OnnxqError(f"invalid {flag} {value}; use 1 or more, or leave it out")


def check_model_files(*models: str) -> None:
    """Each model file exists and can be read (a clear message before any work starts)."""
    for model in models:
        check_readable(model)
