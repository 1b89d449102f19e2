"""The algorithm flags (`--adaround`, `--gptq`, ..., `--algorithm`, `--algo-option`,
`--reconstruct`) as the config's `algo_config` entries. Which algorithms have flags, in
which order they run, which round weight-only blocks, which learn rounding and which run
last all come from the registered contracts (`optimize/registry.py`): this module knows no
algorithm by name. Two that exclude each other are refused where every config is checked
(`registry.EXCLUSIVE`), whichever source names them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from onnxq.cli.arguments import key_values
from onnxq.config.compose import compose_config
from onnxq.config.io import read_config_dict
from onnxq.errors import OnnxqError
from onnxq.optimize.registry import CONTRACTS, block_rounding_algorithms, flagged_algorithms

# `--algorithm` without an algorithm entry: round to nearest with the per-block clipping search.
NEAREST = "rtn"


def weight_only_choices() -> tuple[str, ...]:
    """`--algorithm`'s choices: how MatMulNBits weights are rounded."""
    return (NEAREST, *block_rounding_algorithms())


def algorithm_entries(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`algo_config` entries of the algorithm flags given, `--algorithm` before those that
    run last and `--algo-option` merged in; empty when none is given."""
    algorithms = [name for name in flagged_algorithms(run_order=True) if getattr(args, name)]
    if args.algorithm is not None and args.algorithm != NEAREST and args.algorithm not in algorithms:
        at = next((i for i, name in enumerate(algorithms) if CONTRACTS[name].runs_last), len(algorithms))
        algorithms.insert(at, args.algorithm)  # two that pick one thing: `registry.EXCLUSIVE` refuses them
    options = list(args.algo_option or [])
    reconstruct = getattr(args, "reconstruct", None)
    # the file's entries, read only where a flag must see them (they are composed later anyway)
    in_file = _file_algorithms(args) if reconstruct is not None or args.algorithm == NEAREST else []
    if reconstruct is not None:
        targets = _reconstructing(algorithms)
        _check_file_learner(args, targets, in_file)
        options += [f"{name}.reconstruct={reconstruct}" for name in targets]
    configured = _configured(args) if not algorithms and options else []
    return _algorithm_options(algorithms, options, configured) + _nearest(args, algorithms, in_file)


def _configured(args: argparse.Namespace) -> list[str]:
    """The algorithms the preset and the config file run together, as they compose (a
    file's learner replaces the preset's, `enabled: false` drops one); none where they do
    not compose (their error is said where the whole config is)."""
    try:
        composed = compose_config(getattr(args, "preset", None), getattr(args, "config", None))
    except OnnxqError:
        return []
    # a composed config's entries are dicts (`validate_config`)
    return [e["name"] for e in composed.algo_config if e.get("enabled", True) and e["name"] in CONTRACTS]


def _file_algorithms(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The enabled `algo_config` entries of the config file given (`--config`), if any."""
    config = getattr(args, "config", None)
    entries = read_config_dict(config).get("algo_config") or [] if config is not None else []
    return [e for e in entries if isinstance(e, dict) and e.get("name") in CONTRACTS and e.get("enabled", True)]


def _nearest(args: argparse.Namespace, flagged: list[str], in_file: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`--algorithm rtn` (round to nearest) beside a flag that picks a block rounder is
    refused, as two such flags are; over a config file's block rounder it switches that
    one off (a higher source's choice replaces a lower one's)."""
    if args.algorithm != NEAREST:
        return []
    rounders = [name for name in flagged if CONTRACTS[name].rounds_blocks]
    if rounders:
        raise OnnxqError(f"--algorithm {NEAREST} and --{rounders[0]} both pick the weight-only algorithm (each "
                         "rounds the MatMulNBits blocks itself: rtn to nearest); give one")
    return [{"name": e["name"], "enabled": False} for e in in_file if CONTRACTS[e["name"]].rounds_blocks]


def _check_file_learner(args: argparse.Namespace, targets: list[str], in_file: list[dict[str, Any]]) -> None:
    """`--reconstruct` without a learner flag sets AdaRound's option, or switches AdaRound on;
    over a config file whose rounding learner is another (AdaQuant) that would replace the
    file's learner unasked (`registry.EXCLUSIVE`): refused, as `--adaquant --reconstruct` is."""
    if any(CONTRACTS[name].learns_rounding for name in flagged_algorithms() if getattr(args, name)):
        return
    learners = [e["name"] for e in in_file if CONTRACTS[e["name"]].learns_rounding]
    others = [name for name in learners if name not in targets]
    if others:
        raise OnnxqError(f"--reconstruct {args.reconstruct} is {targets[0]}'s option, and {args.config} runs "
                         f"{others[0]}; "
                         f"give --{targets[0]} to run {targets[0]} instead, or leave --reconstruct out")


def _reconstructing(flagged: list[str]) -> list[str]:
    """Whom `--reconstruct` sets: the rounding learners switched on by flags, else the first
    of them in flag order (AdaRound: the preset's, or one this switches on)."""
    learners = [name for name in flagged_algorithms() if CONTRACTS[name].learns_rounding]
    return [name for name in flagged if name in learners] or learners[:1]


def _algorithm_options(flagged: list[str], options: list[str], configured: list[str]) -> list[dict[str, Any]]:
    """`algo_config` entries for the algorithm flags, with `--algo-option [ALGO.]KEY=VALUE`
    merged in (a bare KEY goes to the one algorithm a flag switched on; without a flag, to
    the one algorithm of the config file and preset (`configured`) that has the option)."""
    entries = {name: {"name": name} for name in flagged}
    for key, value in key_values(options, "--algo-option").items():
        name, dot, option = key.rpartition(".")
        if not dot:
            owners = [n for n in configured if _has_option(n, key)] if not flagged else []
            if len(flagged) != 1 and len(owners) != 1:
                owner = _algorithm_with_option(key, flagged or owners)
                raise OnnxqError(f"--algo-option {key}: name its algorithm, e.g. {owner}.{key}=..., "
                                 f"since {'no' if not flagged else 'more than one'} algorithm flag is given"
                                 + (f" and the config runs {' and '.join(owners)}" if len(owners) > 1 else ""))
            name = flagged[0] if flagged else owners[0]
        entries.setdefault(name, {"name": name})[option] = value
    return list(entries.values())


def _algorithm_with_option(key: str, flagged: list[str]) -> str:
    """The first algorithm with an option `key` (for an example), those the flags switched
    on first, else the first with a flag."""
    for name in [*flagged, *sorted(CONTRACTS)]:
        if _has_option(name, key):
            return name
    return flagged_algorithms()[0]


def _has_option(name: str, key: str) -> bool:
    options = CONTRACTS[name].options
    return dataclasses.is_dataclass(options) and key in {f.name for f in dataclasses.fields(options)}
