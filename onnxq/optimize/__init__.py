"""Stage 3, optimise: rewrite initializers before or during quantization.

Two registries, one module per entry:
- `PASSES` run before calibration (`Config.pre_quant_opt_config`, applied in order):
  `fn(model, options, ctx) -> str`. Passes in `DEFAULT_PASSES` run first unless the list
  names them (to configure them, or to turn them off with `enabled: false`).
- `ALGORITHMS` run after calibration, before emission (`Config.algo_config`):
  `fn(model, plan, ranges, options, ctx) -> str | (str, QuantPlan)`; they see what will be
  quantized and how, and one that changes a decision (a bias it adds) returns the new plan.
Each returns one line saying what it changed, for the summary. `ctx` streams calibration
data through the model for passes that need activation statistics.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from onnxq.calibrate.data import CalibrationSource
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError, ConfigError


@dataclass
class PassContext:
    """What a pass may use besides the model: the calibration data and its settings."""

    data: CalibrationSource | None
    calibration: CalibrationConfig
    progress: bool | None = None
    # Nodes a pass created that must stay float (node name -> reason), for the planner.
    keep_float: dict[str, str] = field(default_factory=dict)
    # Statistics already collected on the model as it is now (by the calibration pass).
    statistics: dict[Statistic, np.ndarray | None] = field(default_factory=dict)

    def collect(self, model: ir.Model, stats: list[Statistic], purpose: str) -> dict[Statistic, np.ndarray | None]:
        """The requested statistics of `model`: those already collected, else one pass over the data."""
        if all(stat in self.statistics for stat in stats):
            return {stat: self.statistics[stat] for stat in stats}
        if self.data is None or self.data.source is None:
            raise CalibrationDataError(f"{purpose} needs calibration data; pass --calib-data PATH")
        return collect(model, stats, self.data, self.calibration, self.progress, purpose)


PassFn = Callable[[ir.Model, Mapping[str, Any], PassContext], str]
AlgoFn = Callable[..., "str | tuple[str, Any]"]
PASSES: dict[str, PassFn] = {}
ALGORITHMS: dict[str, AlgoFn] = {}
# Algorithms that can say, before calibration, which statistics they will need:
# fn(model, plan, options) -> list[Statistic]. The calibration pass collects them too.
REQUESTS: dict[str, Callable[..., list[Statistic]]] = {}
DEFAULT_PASSES = ("fold_batchnorm",)


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    def decorate(fn: PassFn) -> PassFn:
        PASSES[name] = fn
        return fn

    return decorate


def register_algorithm(name: str) -> Callable[[AlgoFn], AlgoFn]:
    def decorate(fn: AlgoFn) -> AlgoFn:
        ALGORITHMS[name] = fn
        return fn

    return decorate


def statistics_of(name: str) -> Callable[[Callable[..., list[Statistic]]], Callable[..., list[Statistic]]]:
    """Register the statistics request of algorithm `name` (see `REQUESTS`)."""
    def decorate(fn: Callable[..., list[Statistic]]) -> Callable[..., list[Statistic]]:
        REQUESTS[name] = fn
        return fn

    return decorate


def algorithm_requests(
    model: ir.Model, plan: Any, entries: list[Mapping[str, Any]]
) -> list[Statistic]:
    """What the first enabled algorithm will need from the data, for the calibration pass to
    collect. Only the first: each algorithm rewrites the model the next one observes."""
    enabled = [e for e in entries if e.get("enabled", True)]
    if not enabled or enabled[0]["name"] not in REQUESTS:
        return []
    return REQUESTS[enabled[0]["name"]](model, plan, _options(enabled[0]))


def _check_entries(entries: list[Mapping[str, Any]], table: Mapping[str, Any], what: str) -> None:
    for entry in entries:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str):
            raise ConfigError(f"each {what} entry needs a 'name' key; available: {', '.join(sorted(table))}")
        if name not in table:
            close = difflib.get_close_matches(name, table, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; available: {', '.join(sorted(table)) or 'none'}"
            raise ConfigError(f"unknown {what} {name!r}{hint}")


def _options(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("name", "enabled")}


def run_passes(model: ir.Model, entries: list[Mapping[str, Any]], ctx: PassContext) -> list[str]:
    """Apply the configured pre-quantization passes in order; one report line per pass."""
    _check_entries(entries, PASSES, "pre_quant_opt_config pass")
    named = {entry["name"] for entry in entries}
    entries = [{"name": d} for d in DEFAULT_PASSES if d not in named] + list(entries)
    reports = [
        f"{e['name']}: {PASSES[e['name']](model, _options(e), ctx)}" for e in entries if e.get("enabled", True)
    ]
    ir_passes.RemoveUnusedNodesPass()(model)  # drops initializers the passes replaced
    return reports


def run_algorithms(
    model: ir.Model, plan: Any, ranges: Mapping[str, tuple[float, float]],
    entries: list[Mapping[str, Any]], ctx: PassContext,
) -> tuple[Any, list[str]]:
    """Apply the configured post-calibration algorithms in order: the plan as the last one
    left it, and one report line each."""
    _check_entries(entries, ALGORITHMS, "algo_config algorithm")
    notes = []
    for e in entries:
        if not e.get("enabled", True):
            continue
        result = ALGORITHMS[e["name"]](model, plan, ranges, _options(e), ctx)
        ctx.statistics = {}  # collected on the model before this algorithm changed it
        note, plan = result if isinstance(result, tuple) else (result, plan)
        notes.append(f"{e['name']}: {note}")
    return plan, notes


def check_config_entries(pre_quant: list[Mapping[str, Any]], algos: list[Mapping[str, Any]]) -> None:
    """Fail early (before loading the model) on unknown pass or algorithm names."""
    _check_entries(pre_quant, PASSES, "pre_quant_opt_config pass")
    _check_entries(algos, ALGORITHMS, "algo_config algorithm")


# Importing the modules fills the registries.
from onnxq.optimize import bias_correction, cle, fold_batchnorm, smoothquant  # noqa: E402, F401
