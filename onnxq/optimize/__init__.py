"""Stage 3, optimise: passes that rewrite initializers before quantization.

Each pass is one module with one entry point `run(model, options) -> str`, registered by
name in `PASSES`; `Config.pre_quant_opt_config` lists `{"name": ..., **options}` entries
applied in order. The returned string says what the pass changed, for the summary.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import onnx_ir as ir

from onnxq.errors import ConfigError

PassFn = Callable[[ir.Model, Mapping[str, Any]], str]
PASSES: dict[str, PassFn] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    def decorate(fn: PassFn) -> PassFn:
        PASSES[name] = fn
        return fn

    return decorate


def check_pass_name(name: str) -> None:
    """ConfigError with a suggestion when `name` is not a registered pass."""
    if name in PASSES:
        return
    close = difflib.get_close_matches(name, PASSES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; available: {', '.join(sorted(PASSES)) or 'none yet'}"
    raise ConfigError(f"unknown pre-quantization pass {name!r}{hint}")


def run_passes(model: ir.Model, entries: list[Mapping[str, Any]]) -> list[str]:
    """Apply the configured passes in order; returns one report line per pass."""
    reports = []
    for entry in entries:
        name = entry.get("name")
        if not isinstance(name, str):
            raise ConfigError("each pre_quant_opt_config entry needs a 'name' key naming the pass")
        check_pass_name(name)
        options = {k: v for k, v in entry.items() if k != "name"}
        reports.append(f"{name}: {PASSES[name](model, options)}")
    return reports
