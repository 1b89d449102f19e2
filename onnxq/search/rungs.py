"""Algorithm rungs of the accuracy-target ladder: recipe changes tried before any layer is raised.

A precision rung (int16, fp16, bf16, float; `ladder.py`) costs the deployed model size and
latency on the layers it raises. An algorithm rung changes how every layer is quantized and
costs the deployed model nothing (or a Mul, SmoothQuant's where it cannot fold), only
quantization time: CLE reaches float top-1 on per-tensor MobileNet-v1 where precision alone
raised 24 of 30 layers. So the search climbs these first, in the ladder's order (cheapest
to quantize first), each on top of those kept before it, and keeps one only where the score
improves (`driver.py`).

Each rung is a table entry: a config transform in the config-file shape, and the reason it
has nothing to add to a given recipe (already on, or not applicable), so the summary can
say why a rung was not tried.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from onnxq.config.compose import deep_merge
from onnxq.config.io import config_from_dict, config_to_dict
from onnxq.config.spec import SPEC_DEFAULTS, Config, DType, QScheme
from onnxq.numerics.qmath import FLOAT8_TYPES, INT_TYPES
from onnxq.optimize.bias_correction import OP_TYPES as BIAS_OPS
from onnxq.optimize.cle import LAYERS as CLE_OPS
from onnxq.optimize.registry import CONTRACTS
from onnxq.optimize.smoothquant import SmoothQuantConfig

Recipe = dict[str, Any]  # a config in the config-file shape (`config_to_dict`)
Ops = frozenset[str]  # the op types the recipe's plan quantizes on the model at hand

# SmoothQuant's migration strength as a rung: the paper's default for most models.
SMOOTHQUANT_ALPHA = 0.5


def _names(recipe: Recipe, key: str) -> set[str]:
    return {entry["name"] for entry in recipe.get(key) or [] if entry.get("enabled", True)}


def _named(name: str, recipe: Recipe, key: str) -> str | None:
    """Why the recipe's own entry `name` in `key` leaves the rung nothing to add: there
    and on, or turned off (the recipe's decision, which the rung does not overrule)."""
    entry = next((e for e in recipe.get(key) or [] if e["name"] == name), None)
    if entry is None:
        return None
    return "already in the recipe" if entry.get("enabled", True) else "turned off in the recipe (enabled: false)"


def _with_entry(key: str, entry: dict[str, Any]) -> Callable[[Recipe], Recipe]:
    """Add `entry` to the named list `key` (merged by name, as config files merge)."""
    return lambda recipe: deep_merge(recipe, {key: [entry]})


def _bias_correction_skip(recipe: Recipe, ops: Ops) -> str | None:
    named = _named("bias_correction", recipe, "algo_config")
    if named:
        return named
    if not ops & set(BIAS_OPS):
        return "no quantized Conv, Gemm or MatMul"
    added = CONTRACTS["bias_correction"].target_default or {}
    if recipe.get("target_algorithms", True) and ops & set(BIAS_OPS) <= set(added.get("op_types", ())):
        return "the target adds it already (target_algorithms: true)"
    return None


def _pass_skip(name: str, layers: tuple[str, ...]) -> Callable[[Recipe, Ops], str | None]:
    """The pass `name`'s reason to skip: in the recipe already, or none of the `layers` it
    rescales is quantized (a float16 recipe on the CPU: it could only move float weights)."""
    def skip(recipe: Recipe, ops: Ops) -> str | None:
        named = _named(name, recipe, "pre_quant_opt_config")
        if named or ops & set(layers):
            return named
        return f"no quantized {' or '.join(layers)}"
    return skip


def _rounding_skip(recipe: Recipe, ops: Ops) -> str | None:
    """One algorithm rounds the weights per recipe: those that learn the rounding (AdaRound,
    AdaQuant) and those that round weight-only blocks (GPTQ, AWQ, HQQ), by their contracts."""
    there = {n for n in _names(recipe, "algo_config")
             if n in CONTRACTS and (CONTRACTS[n].learns_rounding or CONTRACTS[n].rounds_blocks)}
    return f"{', '.join(sorted(there))} already rounds the weights" if there else None


def _per_channel_skip(recipe: Recipe, ops: Ops) -> str | None:
    """Per-channel scales only where the weights are per-tensor by default (the global
    weight spec names no qscheme: SPEC_DEFAULTS' per_tensor), not where the recipe asks for
    per-tensor (`--per-tensor`, `qscheme: per_tensor`, the XINT8 preset): that is a choice
    for the deployment (an integer-only NPU, a runtime with one scale per tensor), which a
    model whose score the rung improved would silently break."""
    weight = (recipe.get("global_quant_config") or {}).get("weight") or {}
    if weight.get("qscheme") == QScheme.PER_TENSOR.value:
        return "the recipe asks for per-tensor weights (qscheme: per_tensor)"
    dtype = DType(weight.get("dtype") or SPEC_DEFAULTS["dtype"])
    by_default = weight and weight.get("qscheme") is None and SPEC_DEFAULTS["qscheme"] is QScheme.PER_TENSOR
    if by_default and (dtype in INT_TYPES or dtype in FLOAT8_TYPES):  # types with scales (not float16)
        return None
    return "the weights are not per-tensor"


def _per_channel(recipe: Recipe) -> Recipe:
    return deep_merge(recipe, {"global_quant_config": {"weight": {"qscheme": "per_channel"}}})


@dataclass(frozen=True)
class AlgorithmRung:
    """One recipe change the search may try: `skip` says why it has nothing to add to a
    recipe whose plan quantizes these op types (None: it applies), `apply` returns the
    recipe with it."""

    name: str
    what: str
    skip: Callable[[Recipe, Ops], str | None]
    apply: Callable[[Recipe], Recipe]


ALGORITHM_RUNGS: dict[str, AlgorithmRung] = {r.name: r for r in (
    AlgorithmRung("bias_correction", "bias correction of Conv/Gemm outputs", _bias_correction_skip,
                  _with_entry("algo_config", {"name": "bias_correction"})),
    AlgorithmRung("cle", "cross-layer equalization before calibration", _pass_skip("cle", tuple(sorted(CLE_OPS))),
                  _with_entry("pre_quant_opt_config", {"name": "cle"})),
    AlgorithmRung("smoothquant", f"SmoothQuant (alpha {SMOOTHQUANT_ALPHA}) for MatMul/Gemm inputs",
                  _pass_skip("smoothquant", SmoothQuantConfig.op_types),
                  _with_entry("pre_quant_opt_config", {"name": "smoothquant", "alpha": SMOOTHQUANT_ALPHA})),
    AlgorithmRung("per_channel", "per-channel weight scales", _per_channel_skip, _per_channel),
    AlgorithmRung("adaround", "AdaRound: each weight's rounding learned layer by layer", _rounding_skip,
                  _with_entry("algo_config", {"name": "adaround"})),
    AlgorithmRung("adaquant", "AdaQuant: weights and biases learned layer by layer", _rounding_skip,
                  _with_entry("algo_config", {"name": "adaquant"})),
)}


def algorithm_rungs(ladder: list[str]) -> list[AlgorithmRung]:
    """The ladder's algorithm rungs, in its order."""
    return [ALGORITHM_RUNGS[r] for r in ladder if r in ALGORITHM_RUNGS]


def precision_rungs(ladder: list[str]) -> list[str]:
    """The ladder's precision rungs (what a layer is raised to), in its order."""
    return [r for r in ladder if r not in ALGORITHM_RUNGS]


def skip_reason(rung: AlgorithmRung, config: Config, ops: Collection[str]) -> str | None:
    """Why `rung` has nothing to add to `config`, whose plan quantizes `ops`, or None."""
    return rung.skip(config_to_dict(config), frozenset(ops))


def with_rung(config: Config, rung: AlgorithmRung) -> Config:
    """`config` with `rung` applied (a plain config: saved and rerun, it gives the same bytes)."""
    return config_from_dict(rung.apply(config_to_dict(config)))
