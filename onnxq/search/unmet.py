"""The model a search writes when no model it scored meets the target: the best of them.

The candidates are the all-quantized model after the kept algorithm rungs and each
precision-rung trial (`bisect.py`: every ranked layer raised to one rung), in the order
they cost the deployed model, cheapest first (nothing raised, then the ladder's order,
which is cheapest first). The best-scoring one is found; the model written is the
cheapest candidate the best does not beat beyond the eval set's noise, by the rule that
keeps an algorithm rung (`gain.py`: the per-sample change's standard error and, on
SQNR and cosine, the least gain worth a rung; or `rung_min_gain` where set). Measured on ResNet-20 with int4 weights and `top1>=float+5`
(1800 CIFAR-10 images): the all-int4 model (80.28) was written where its int8 trial scored
82.61 with every layer still quantized; that trial is now. With per-tensor int4 weights
the float trial (82.28, every layer float) beats the int8 one (82.17) by two images, within
the noise: the int8 model is written, and the summary names both. An algorithm rung the
climb dropped is no candidate: it was found no better, beyond the noise, than the recipe
the trials were scored on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from onnxq.search.gain import rung_gain
from onnxq.search.target import Scored


@dataclass(frozen=True)
class Candidate:
    """One model the search scored: what it is in words (for the summary), the layers it
    raised (node -> rung; empty: nothing raised) and its score."""

    what: str
    promotions: dict[str, str]
    scored: Scored


@dataclass(frozen=True)
class Choice:
    """The best-scoring candidate, and the one written (the cheapest within its noise)."""

    best: Candidate
    written: Candidate


def _rank(value: float, higher_is_better: bool) -> float:
    """`value` in the direction where larger is better; NaN is the worst of all."""
    return -math.inf if math.isnan(value) else (value if higher_is_better else -value)


def choose_unmet(candidates: Sequence[Candidate], higher_is_better: bool, min_gain: float | None) -> Choice:
    """The best of `candidates` (cheapest first; the first of equal scores), and the first
    candidate it does not beat beyond the noise (module doc), deterministically."""
    if not candidates:
        raise ValueError("no candidate to choose from")
    best = max(candidates, key=lambda c: _rank(c.scored.value, higher_is_better))  # max keeps the first of equals

    def as_good(candidate: Candidate) -> bool:
        if candidate is best:
            return True
        if math.isnan(candidate.scored.value):
            return False
        return rung_gain(best.scored, candidate.scored, higher_is_better, False, min_gain) is not None

    return Choice(best, next(c for c in candidates if as_good(c)))


def raised_words(rung: str, layers: int, ranked: int, promoted: int) -> str:
    """A trial in words: `promoted` of the `ranked` layers raised to `rung`, `layers` of
    them changed by it (int8 raises only the 4-bit weights)."""
    which = "every ranked layer" if promoted >= ranked else f"the {promoted} most sensitive layers"
    count = f"{layers} layer{'' if layers == 1 else 's'}"
    if layers < min(promoted, ranked):  # the rest are there already or cannot be (encoder trial: "69 ranked ... (66)")
        count += f" of {min(promoted, ranked)} changed by it"
    return f"{which} raised to {rung} ({count})"
