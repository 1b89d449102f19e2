"""The pass and algorithm tables, filled by `@register_pass` / `@register_algorithm` in
each module of `optimize/`, and the configured entries parsed once against them.

A pass runs before calibration (`Config.pre_quant_opt_config`): `fn(model, options, ctx)`.
An algorithm runs after it (`Config.algo_config`): `fn(model, plan, ranges, options, ctx)`.
Each registers a `Contract`: its typed options, whether it reads the calibration data,
what it rewrites, and where it stands among the others. The pipeline reads the contract,
never the name: which algorithms run last, which the CLI switches on with a flag, which
round weight-only blocks, which every target adds.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from onnxq.calibrate.statistics import Statistic
from onnxq.errors import ConfigError, duplicate_entry, named_fields_only
from onnxq.optimize.options import checks_types_first, parse_options

PassFn = Callable[..., Any]
AlgoFn = Callable[..., Any]
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
    runs_last: it writes into the float model that later algorithms fit to (bias
      correction's corrected biases), so it runs after every other algorithm.
    flag: the CLI switches it on with `--NAME` (help text `flag_help`); algorithms switched
      on by flags run in the order of this number (lower first; None: no flag).
    rounds_blocks: it rounds weight-only blocks (MatMulNBits), one of `--algorithm`'s choices.
    target_default: the options with which every target adds it to a static plan with
      quantized Conv/Gemm layers, unless the config names it (None: never added).
    equalizes: a pass that equalizes layers (CLE), the one an algorithm's `equalize`
      option adds before calibration.
    learns_rounding: it learns the rounding of the quantized Conv/Gemm/MatMul weights
      (AdaRound, AdaQuant); one such per run, since each re-solves what the other learned.
    serial_blas: its codes hold the same on any core count only where BLAS runs on one
      thread (`parallel.serial_blas`), a limit OpenBLAS takes from the main thread alone:
      the summary says so where it ran off the main thread.
    """

    options: Any = NoOptions
    data: DataUse = "none"
    rewrites: tuple[str, ...] = ()
    runs_last: bool = False
    flag: int | None = None
    flag_help: str = ""
    rounds_blocks: bool = False
    target_default: Mapping[str, Any] | None = None
    equalizes: bool = False
    learns_rounding: bool = False
    serial_blas: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rewrites) - set(REWRITES))
        if unknown:
            raise ValueError(f"unknown rewrites {unknown}; use {', '.join(REWRITES)}")

    def parse(self, name: str, options: Mapping[str, Any]) -> Any:
        if dataclasses.is_dataclass(self.options):
            return parse_options(self.options, options, name)
        return self.options(options)


@dataclass(frozen=True)
class Entry:
    """One configured pass or algorithm, parsed once: its name, whether it runs, its typed
    options and its contract. `op_types`, where its options have them, limit it."""

    name: str
    enabled: bool
    options: Any
    contract: Contract

    @property
    def op_types(self) -> tuple[str, ...]:
        return tuple(getattr(self.options, "op_types", ()) or ())


PASSES: dict[str, PassFn] = {}
ALGORITHMS: dict[str, AlgoFn] = {}
CONTRACTS: dict[str, Contract] = {}  # pass or algorithm name -> its contract
# Algorithms that can say, before calibration, which statistics they will need:
# fn(model, plan, options) -> list[Statistic]. The calibration pass collects them too.
REQUESTS: dict[str, Callable[..., list[Statistic]]] = {}
DEFAULT_PASSES = ("fold_batchnorm",)


def _named_fields_only(options: Any, name: str) -> Any:
    """An options dataclass whose unknown keywords name the nearest field (`errors`) and
    whose fields' types are checked as a dict entry's are (`options.checks_types_first`)."""
    if dataclasses.is_dataclass(options) and isinstance(options, type) and not options.__dict__.get("_named"):
        named_fields_only(options)
        checks_types_first(options, name)
        options._named = True
    return options


def _check_new(name: str, fn: Callable[..., Any], replace: bool) -> None:
    """A name another module registered already (a built-in, another plugin) is taken only
    with `replace=True`: a plugin's `adaround` silently ran in place of onnxq's."""
    held = PASSES.get(name) or ALGORITHMS.get(name)
    if held is not None and not replace and _origin(held) != _origin(fn):
        raise ConfigError(f"{_origin(fn)} registers {name!r}, which {_origin(held)} registered already; give it "
                          "another name, or pass replace=True to the decorator to run it in place of that one")


def _origin(fn: Callable[..., Any]) -> str:
    """Where `fn` comes from: onnxq's module, else its source file (a plugin file loaded
    under a made-up module name, or imported as well: the same origin), else its module."""
    if fn.__module__.startswith("onnxq."):
        return fn.__module__
    code = getattr(fn, "__code__", None)
    file = code.co_filename if code is not None else getattr(sys.modules.get(fn.__module__), "__file__", None)
    return file if file and not file.startswith("<") else fn.__module__


def register_pass(name: str, options: Any = NoOptions, data: DataUse = "none",
                  rewrites: tuple[str, ...] = (), *, equalizes: bool = False,
                  replace: bool = False) -> Callable[[PassFn], PassFn]:
    """Register `fn(model, options, ctx) -> report line | PassResult` as pass `name`
    (see `Contract`); `replace`: in place of another module's `name`."""
    contract = Contract(_named_fields_only(options, name), data, rewrites, equalizes=equalizes)

    def decorate(fn: PassFn) -> PassFn:
        _check_new(name, fn, replace)
        PASSES[name], CONTRACTS[name] = fn, contract
        return fn

    return decorate


def register_algorithm(name: str, options: Any = NoOptions, data: DataUse = "required",
                       rewrites: tuple[str, ...] = (), *, runs_last: bool = False, flag: int | None = None, flag_help: str = "",
                       rounds_blocks: bool = False, target_default: Mapping[str, Any] | None = None,
                       learns_rounding: bool = False, serial_blas: bool = False,
                       replace: bool = False) -> Callable[[AlgoFn], AlgoFn]:
    """Register `fn(model, plan, ranges, options, ctx) -> report line | (line, plan) |
    AlgorithmResult` as algorithm `name` (see `Contract`); `replace`: in place of another
    module's `name`."""
    contract = Contract(_named_fields_only(options, name), data, rewrites, runs_last, flag, flag_help, rounds_blocks,
                        target_default, learns_rounding=learns_rounding, serial_blas=serial_blas)

    def decorate(fn: AlgoFn) -> AlgoFn:
        _check_new(name, fn, replace)
        ALGORITHMS[name], CONTRACTS[name] = fn, contract
        return fn

    return decorate


def statistics_of(name: str) -> Callable[[Callable[..., list[Statistic]]], Callable[..., list[Statistic]]]:
    """Register the statistics request of algorithm `name` (see `REQUESTS`)."""
    def decorate(fn: Callable[..., list[Statistic]]) -> Callable[..., list[Statistic]]:
        REQUESTS[name] = fn
        return fn

    return decorate


def flagged_algorithms(run_order: bool = False) -> tuple[str, ...]:
    """The algorithms the CLI switches on with `--NAME`, by their contracts' `flag` (the
    order of the help); with `run_order`, those that run last at the end, where they run
    anyway (the order of the entries the flags make)."""
    names = [name for name in ALGORITHMS if CONTRACTS[name].flag is not None]
    last = (lambda name: CONTRACTS[name].runs_last) if run_order else (lambda name: False)
    return tuple(sorted(names, key=lambda name: (last(name), CONTRACTS[name].flag, name)))


def fits_data(name: str) -> bool:
    """Whether algorithm `name` fits the weights to the calibration data (AdaRound,
    AdaQuant, GPTQ, AWQ: a choice per weight, which can fit those samples' noise): the
    output check, which runs on calibration samples, then reads its own fit, not held-out
    accuracy. Bias correction fits one mean per channel (no more optimistic on those
    samples than on others); passes (CLE, SmoothQuant) keep the float function."""
    contract = CONTRACTS.get(name) if name in ALGORITHMS else None
    return contract is not None and contract.data == "required" and "weights" in contract.rewrites


def block_rounding_algorithms() -> tuple[str, ...]:
    """The algorithms that round weight-only blocks (`--algorithm`'s choices besides rtn),
    those with a flag first, in flag order."""
    names = [name for name in ALGORITHMS if CONTRACTS[name].rounds_blocks]
    return tuple(sorted(names, key=lambda name: (CONTRACTS[name].flag is None, CONTRACTS[name].flag or 0, name)))


def target_defaults(configured: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The algorithms every target adds (`Contract.target_default`) that `configured` does
    not name, with their default options."""
    named = {entry.name for entry in configured}
    return parse_algorithms([{"name": name, **CONTRACTS[name].target_default} for name in ALGORITHMS
                             if CONTRACTS[name].target_default is not None and name not in named])


def equalizing_pass() -> str | None:
    """The registered pass that equalizes layers (`Contract.equalizes`)."""
    return next((name for name in PASSES if CONTRACTS[name].equalizes), None)


def _check_names(entries: list[Mapping[str, Any]], table: Mapping[str, Any], what: str) -> None:
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


def _parse(entries: list[Mapping[str, Any]], table: Mapping[str, Any], what: str) -> tuple[Entry, ...]:
    _check_names(entries, table, what)
    return tuple(Entry(e["name"], bool(e.get("enabled", True)),
                       CONTRACTS[e["name"]].parse(e["name"], {k: v for k, v in e.items() if k not in ("name", "enabled")}),
                       CONTRACTS[e["name"]]) for e in entries)


def parse_passes(entries: list[Mapping[str, Any]]) -> tuple[Entry, ...]:
    """`pre_quant_opt_config` as typed entries; ConfigError for an unknown name or option."""
    return _parse(entries, PASSES, "pre_quant_opt_config pass")


def parse_algorithms(entries: list[Mapping[str, Any]]) -> tuple[Entry, ...]:
    """`algo_config` as typed entries; ConfigError for an unknown name or option."""
    return _parse(entries, ALGORITHMS, "algo_config algorithm")


# Contract flags at most one enabled algorithm of a run may have, and what two would do:
# the same rule for every source (flags, a file, a dict, a preset under them).
EXCLUSIVE: tuple[tuple[str, str], ...] = (
    ("rounds_blocks", "both pick the weight-only algorithm (each rounds the MatMulNBits blocks itself: AWQ after "
                      "its scaling, GPTQ through the Hessian, HQQ by its solver)"),
    ("learns_rounding", "both learn the layers' rounding, and one would undo the other"),
)


def exclusive_with(name: str) -> frozenset[str]:
    """The other algorithms that `name` excludes (`EXCLUSIVE`): a source naming `name`
    replaces them in the sources below it (`config.compose`)."""
    contract = CONTRACTS.get(name)
    if contract is None or name not in ALGORITHMS:
        return frozenset()
    kinds = [kind for kind, _ in EXCLUSIVE if getattr(contract, kind)]
    return frozenset(other for other in ALGORITHMS if other != name
                     and any(getattr(CONTRACTS[other], kind) for kind in kinds))


def check_config_entries(pre_quant: list[Mapping[str, Any]], algos: list[Mapping[str, Any]],
                         matmul_nbits: bool | None = None) -> None:
    """Fail early (before loading the model) on unknown pass or algorithm names, on options
    their contracts reject, on two enabled algorithms of one exclusive kind (`EXCLUSIVE`)
    and, given `matmul_nbits`, on block rounding in a recipe without MatMulNBits."""
    parse_passes(pre_quant)  # a pass may be listed twice: each entry runs
    parsed = parse_algorithms(algos)
    names = [entry.name for entry in parsed]
    if len(set(names)) < len(names):  # one run of each algorithm: two entries would be one choice left to make
        raise ConfigError(duplicate_entry("algo_config", next(n for i, n in enumerate(names) if n in names[:i])))
    entries = [entry for entry in parsed if entry.enabled]
    for kind, what in EXCLUSIVE:
        named = [entry.name for entry in entries if getattr(entry.contract, kind)]
        if len(named) > 1:
            raise ConfigError(f"{named[0]} and {named[1]} in algo_config {what}; give one (remove the other "
                              "entry, or set enabled: false on it)")
    if matmul_nbits is not None:
        check_block_rounding(algos, matmul_nbits)


def check_block_rounding(algos: list[Mapping[str, Any]], matmul_nbits: bool) -> None:
    """An algorithm that rounds MatMulNBits blocks (GPTQ, AWQ, HQQ) in a recipe that lowers
    none would do nothing on any model: ConfigError with the fix."""
    named = [entry.name for entry in parse_algorithms(algos) if entry.enabled and entry.contract.rounds_blocks]
    if named and not matmul_nbits:
        raise ConfigError(f"{named[0]} rounds the weight-only blocks of MatMulNBits, and this recipe lowers no "
                          f"MatMul to MatMulNBits; start from a W4_GROUP128 or W8_GROUP128 preset, or set matmul_nbits: "
                          f"true over per-group weights, or remove {named[0]} from algo_config")
