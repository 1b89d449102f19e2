"""The algorithm flags (`--adaround`, `--gptq`, ..., `--algorithm`, `--algo-option`) as the
config's `algo_config` entries.

The algorithm names are spelled out here, in one place, for now: the flags and their
order are the only CLI code that knows them.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from onnxq.cli.arguments import key_values
from onnxq.errors import OnnxqError
from onnxq.optimize import CONTRACTS

# Flags that switch an algorithm on (`algo_config` entries, in this order: bias correction
# last, where it runs anyway, `quantize._correction_last`).
ALGORITHM_FLAGS = ("adaround", "adaquant", "gptq", "awq", "bias_correction")
# `--algorithm`: how MatMulNBits weights are rounded (rtn: round to nearest with the clipping search).
WEIGHT_ONLY_ALGORITHMS = ("rtn", "gptq", "awq", "hqq")


def algorithm_entries(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`algo_config` entries of the algorithm flags given, `--algorithm` before bias correction
    and `--algo-option` merged in; empty when none is given."""
    algorithms = [name for name in ALGORITHM_FLAGS if getattr(args, name)]
    if args.algorithm is not None:
        others = [name for name in algorithms if name in WEIGHT_ONLY_ALGORITHMS]
        if others:
            raise OnnxqError(f"--algorithm {args.algorithm} and --{others[0]} both pick the weight-only algorithm; "
                             "give one")
        if args.algorithm != "rtn":  # before bias correction, which runs last
            at = algorithms.index("bias_correction") if "bias_correction" in algorithms else len(algorithms)
            algorithms.insert(at, args.algorithm)
    return _algorithm_options(algorithms, args.algo_option or [])


def _algorithm_options(flagged: list[str], options: list[str]) -> list[dict[str, Any]]:
    """`algo_config` entries for the algorithm flags, with `--algo-option [ALGO.]KEY=VALUE`
    merged in (a bare KEY goes to the one algorithm a flag switched on)."""
    entries = {name: {"name": name} for name in flagged}
    for key, value in key_values(options, "--algo-option").items():
        name, dot, option = key.rpartition(".")
        if not dot:
            if len(flagged) != 1:
                owner = _algorithm_with_option(key)
                raise OnnxqError(f"--algo-option {key}: name its algorithm, e.g. {owner}.{key}=..., "
                                 f"since {'no' if not flagged else 'more than one'} algorithm flag is given")
            name = flagged[0]
        entries.setdefault(name, {"name": name})[option] = value
    return list(entries.values())


def _algorithm_with_option(key: str) -> str:
    """The first registered algorithm with an option `key` (for an example), else adaround."""
    for name, contract in sorted(CONTRACTS.items()):
        if dataclasses.is_dataclass(contract.options) and key in {f.name for f in dataclasses.fields(contract.options)}:
            return name
    return "adaround"
