"""Stage 3, optimise: passes that rewrite initializers before quantization.

Each pass is one module with one entry point `fn(model, options) -> str`, registered by
name in `PASSES`; `Config.pre_quant_opt_config` lists `{"name": ..., **options}` entries
applied in order. The returned string says what the pass changed, for the summary.
Passes in `DEFAULT_PASSES` run first unless the list names them (to configure them, or
to turn them off with `enabled: false`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from onnxq.errors import ConfigError

PassFn = Callable[[ir.Model, Mapping[str, Any]], str]
PASSES: dict[str, PassFn] = {}
DEFAULT_PASSES = ("fold_batchnorm",)


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
    for entry in entries:
        if not isinstance(entry.get("name"), str):
            raise ConfigError("each pre_quant_opt_config entry needs a 'name' key naming the pass")
        check_pass_name(entry["name"])
    named = {entry["name"] for entry in entries}
    entries = [{"name": d} for d in DEFAULT_PASSES if d not in named] + list(entries)
    reports = []
    for entry in entries:
        options = {k: v for k, v in entry.items() if k not in ("name", "enabled")}
        if entry.get("enabled", True):
            reports.append(f"{entry['name']}: {PASSES[entry['name']](model, options)}")
    ir_passes.RemoveUnusedNodesPass()(model)  # drops initializers the passes replaced
    return reports


# Importing the pass modules fills the registry.
from onnxq.optimize import fold_batchnorm  # noqa: E402, F401
