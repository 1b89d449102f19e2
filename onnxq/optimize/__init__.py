"""Stage 3, optimise: rewrite initializers before or during quantization.

Two registries, one module per entry:
- `PASSES` run before calibration (`Config.pre_quant_opt_config`, applied in order):
  `fn(model, options, ctx) -> str`, `options` parsed as the pass's `Contract` declares.
  Passes in `DEFAULT_PASSES` run first unless the list names them (to configure them, or
  to turn them off with `enabled: false`).
- `ALGORITHMS` run after calibration, before emission (`Config.algo_config`):
  `fn(model, plan, ranges, options, ctx) -> str | (str, QuantPlan)`; they see what will be
  quantized and how, and one that changes a decision (a bias it adds) returns the new plan.
Each returns one line saying what it changed, for the summary. `ctx` streams calibration
data through the model for passes that need activation statistics.

A pass whose statistics can be read from the model before it runs (SmoothQuant's channel
maxima) may defer its data-dependent half when it is the last pass: it makes its
structural edits with neutral values, hands a `Deferred` to `ctx`, and the calibration
pass collects its statistics together with the ranges. `finish` then writes the real
values and says which tensors it scaled per channel, so their ranges follow exactly
(`calibrate/rescale.py`) instead of costing a second pass over the data.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from onnxq.calibrate.data import CalibrationSource
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError, ConfigError, named_fields_only
from onnxq.optimize.options import parse_options
from onnxq.plan.params import WeightCache

# A tensor a pass scaled per channel: its values became old * factor along axis (factor > 0).
Rescale = tuple[int, np.ndarray]


@dataclass(frozen=True)
class Deferred:
    """The data-dependent half of a pass, run after the calibration pass (module doc).

    statistics: what `finish` needs, collected on the model as the pass left it.
    rescalable: tensor -> channel axis, every tensor `finish` may scale.
    finish(statistics) -> (report line, {tensor: (axis, factor)} of the tensors it scaled).
    """

    name: str
    statistics: tuple[Statistic, ...]
    rescalable: Mapping[str, int]
    finish: Callable[[Mapping[Statistic, np.ndarray | None]], tuple[str, dict[str, Rescale]]]


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
    # The statistics emission lays the model out with (float8 channel means), from the
    # calibration pass: kept through every algorithm, so that a trial emission
    # (`emit.trial`) centres float8 activations exactly as the final one will.
    emission_statistics: dict[Statistic, np.ndarray | None] = field(default_factory=dict)
    # Weights quantized by an algorithm, reused by emission (`plan.params.WeightCache`).
    weights: WeightCache = field(default_factory=WeightCache)
    # Layers whose bias an algorithm fitted on the quantized model's own inputs (node ->
    # algorithm): it holds their mean correction already, so bias correction leaves them.
    fitted_biases: dict[str, str] = field(default_factory=dict)
    # Whether the pass now running may defer (`Deferred`); set by `run_passes` for the last
    # pass when the caller calibrates afterwards (`deferrable`).
    deferrable: bool = False
    may_defer: bool = False
    # The Q/DQ domain emission uses (algorithms that emit a trial graph use the same).
    qdq_domain: str = "ai.onnx"
    # Whether emission writes the extended format (qdq-ext: its own rounding and types).
    extended: bool = False
    deferred: Deferred | None = None

    def defer(self, deferred: Deferred) -> bool:
        """Hand the pass's data-dependent half to the calibration pass, if allowed now."""
        if not self.may_defer:
            return False
        self.deferred = deferred
        return True

    def collect(self, model: ir.Model, stats: list[Statistic], purpose: str) -> dict[Statistic, np.ndarray | None]:
        """The requested statistics of `model`: those already collected, else one pass over the data."""
        if all(stat in self.statistics for stat in stats):
            return {stat: self.statistics[stat] for stat in stats}
        if self.data is None or self.data.source is None:
            raise CalibrationDataError(f"{purpose} needs calibration data; pass --calib-data PATH")
        return collect(model, stats, self.data, self.calibration, self.progress, purpose)


PassFn = Callable[[ir.Model, Any, PassContext], str]
AlgoFn = Callable[..., "str | tuple[str, Any]"]
DataUse = Literal["none", "optional", "required"]
REWRITES = ("weights", "biases", "graph", "activations")


@dataclass(frozen=True)
class NoOptions:
    """The options of a pass that takes none."""


@dataclass(frozen=True)
class Contract:
    """What a pass or algorithm declares when it registers.

    options: its frozen options dataclass (parsed with `parse_options`: a misspelled key
      is an error naming the nearest) or a function parsing the options mapping; the
      function receives the parsed value, and the config is checked before the model loads.
    data: whether it reads the calibration data ("optional": some steps do).
    rewrites: what it may change: "weights", "biases" (initializers), "graph" (nodes
      added, removed or replaced), "activations" (tensors scaled per channel).
    """

    options: Any = NoOptions
    data: DataUse = "none"
    rewrites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rewrites) - set(REWRITES))
        if unknown:
            raise ValueError(f"unknown rewrites {unknown}; use {', '.join(REWRITES)}")

    def parse(self, name: str, options: Mapping[str, Any]) -> Any:
        if dataclasses.is_dataclass(self.options):
            return parse_options(self.options, options, name)
        return self.options(options)


PASSES: dict[str, PassFn] = {}
ALGORITHMS: dict[str, AlgoFn] = {}
CONTRACTS: dict[str, Contract] = {}  # pass or algorithm name -> its contract
# Algorithms that can say, before calibration, which statistics they will need:
# fn(model, plan, options) -> list[Statistic]. The calibration pass collects them too.
REQUESTS: dict[str, Callable[..., list[Statistic]]] = {}
DEFAULT_PASSES = ("fold_batchnorm",)


def _named_fields_only(options: Any) -> Any:
    """An options dataclass whose unknown keywords name the nearest field (`errors`)."""
    if dataclasses.is_dataclass(options) and isinstance(options, type) and not options.__dict__.get("_named"):
        named_fields_only(options)
        options._named = True
    return options


def register_pass(name: str, options: Any = NoOptions, data: DataUse = "none",
                  rewrites: tuple[str, ...] = ()) -> Callable[[PassFn], PassFn]:
    """Register `fn(model, options, ctx) -> report line` as pass `name` (see `Contract`)."""
    contract = Contract(_named_fields_only(options), data, rewrites)

    def decorate(fn: PassFn) -> PassFn:
        PASSES[name], CONTRACTS[name] = fn, contract
        return fn

    return decorate


def register_algorithm(name: str, options: Any = NoOptions, data: DataUse = "required",
                       rewrites: tuple[str, ...] = ()) -> Callable[[AlgoFn], AlgoFn]:
    """Register `fn(model, plan, ranges, options, ctx)` as algorithm `name` (see `Contract`)."""
    contract = Contract(_named_fields_only(options), data, rewrites)

    def decorate(fn: AlgoFn) -> AlgoFn:
        ALGORITHMS[name], CONTRACTS[name] = fn, contract
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


def without_another_read(entries: list[dict[str, Any]], why: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The algorithms that can run when the calibration data cannot be read again (a
    generator, or none: statistics loaded from files), and a note per one skipped, `why`
    naming the fix. Only the first enabled algorithm gets its statistics from the
    calibration pass (`algorithm_requests`); one that reads the data itself (AdaRound,
    AdaQuant) or comes later would need another read, so it is skipped, and the next one
    becomes first (a preset's AdaRound skipped leaves its bias correction working)."""
    kept, notes, first = [], [], True
    for entry in entries:
        name = entry.get("name")
        contract = CONTRACTS.get(name)
        if not entry.get("enabled", True) or contract is None or contract.data != "required":
            kept.append(entry)
        elif first and name in REQUESTS:
            kept.append(entry)
            first = False
        else:
            notes.append(f"{name}: skipped: {why}")
    return kept, notes


def _check_entries(entries: list[Mapping[str, Any]], table: Mapping[str, Any], what: str) -> None:
    for entry in entries:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str):
            raise ConfigError(f"each {what} entry needs a 'name' key; available: {', '.join(sorted(table))}")
        if name not in table:
            other = ("algo_config", ALGORITHMS) if table is PASSES else ("pre_quant_opt_config", PASSES)
            if name in other[1]:
                raise ConfigError(f"{name} belongs in {other[0]}, not in {what.split()[0]}; move the entry there")
            close = difflib.get_close_matches(name, table, n=1)
            hint = (f"; did you mean {close[0]!r}?" if close else
                    f"; available: {', '.join(sorted(table)) or 'none'} (your own: load the file that "
                    "registers it with --plugin FILE.py)")
            raise ConfigError(f"unknown {what} {name!r}{hint}")


def _options(entry: Mapping[str, Any]) -> Any:
    """The entry's options, parsed as its contract says."""
    return CONTRACTS[entry["name"]].parse(entry["name"], {k: v for k, v in entry.items()
                                                           if k not in ("name", "enabled")})


def run_passes(model: ir.Model, entries: list[Mapping[str, Any]], ctx: PassContext) -> list[str]:
    """Apply the configured pre-quantization passes in order; one report line per pass
    (none for a pass that deferred its second half to `ctx.deferred`)."""
    _check_entries(entries, PASSES, "pre_quant_opt_config pass")
    named = {entry["name"] for entry in entries}
    entries = [{"name": d} for d in DEFAULT_PASSES if d not in named] + list(entries)
    enabled = [e for e in entries if e.get("enabled", True)]
    reports = []
    for i, e in enumerate(enabled):
        ctx.may_defer = ctx.deferrable and i == len(enabled) - 1
        report = PASSES[e["name"]](model, _options(e), ctx)
        if ctx.deferred is None or ctx.deferred.name != e["name"]:
            reports.append(f"{e['name']}: {report}")
    ctx.may_defer = False
    ir_passes.RemoveUnusedNodesPass()(model)  # drops initializers the passes replaced
    return reports


def finish_deferred(
    model: ir.Model, deferred: Deferred, statistics: Mapping[Statistic, np.ndarray | None]
) -> tuple[str, dict[str, Rescale]]:
    """Run a deferred pass's second half on the statistics the calibration pass collected:
    its report line and the tensors it scaled."""
    report, rescaled = deferred.finish(statistics)
    ir_passes.RemoveUnusedNodesPass()(model)
    return f"{deferred.name}: {report}", rescaled


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


def equalizing_algorithm(entries: list[Mapping[str, Any]], per_tensor: bool) -> str | None:
    """The first enabled algorithm that wants cross-layer equalization before calibration
    (option `equalize`: "always", or "auto" when some Conv/Gemm weight is per tensor)."""
    for e in entries:
        if not e.get("enabled", True) or e.get("name") not in ALGORITHMS:
            continue
        mode = getattr(_options(e), "equalize", None)
        if mode == "always" or (mode == "auto" and per_tensor):
            return e["name"]
    return None


def check_config_entries(pre_quant: list[Mapping[str, Any]], algos: list[Mapping[str, Any]]) -> None:
    """Fail early (before loading the model) on unknown pass or algorithm names and on
    options their contracts reject."""
    _check_entries(pre_quant, PASSES, "pre_quant_opt_config pass")
    _check_entries(algos, ALGORITHMS, "algo_config algorithm")
    for entry in [*pre_quant, *algos]:
        _options(entry)


# Importing the modules fills the registries.
from onnxq.optimize import (  # noqa: E402, F401
    adaquant,
    adaround,
    awq,
    bias_correction,
    cle,
    fold_batchnorm,
    gptq,
    hqq,
    smoothquant,
)
