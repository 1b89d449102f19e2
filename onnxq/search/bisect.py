"""Find the fewest layers to promote, along the sensitivity order, that meet a target.

For each rung of the ladder, cheapest first: if promoting every ranked layer to that
rung meets the target, bisect on how many of the most sensitive layers it takes
(the score is assumed to improve as layers are promoted). A search over n layers
evaluates about log2(n) + rungs + 1 models, not n.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Trial:
    promoted: int  # the most sensitive `promoted` layers were raised to `rung`
    rung: str
    score: float
    met: bool


@dataclass
class SearchOutcome:
    promotions: dict[str, str]  # node -> rung; empty when the model met the target as is
    met: bool
    trials: list[Trial] = field(default_factory=list)


def bisect_promotions(
    order: list[str], ladder: list[str], score_of: Callable[[dict[str, str]], float],
    met: Callable[[float], bool], base_score: float,
) -> SearchOutcome:
    """The promotions (first layers of `order` to one rung) that meet the target, fewest first."""
    trials: list[Trial] = []
    if met(base_score) or not order:
        return SearchOutcome({}, met(base_score), trials)

    def attempt(k: int, rung: str) -> bool:
        score = score_of({name: rung for name in order[:k]})
        trials.append(Trial(k, rung, score, met(score)))
        return trials[-1].met

    for rung in ladder:
        if not attempt(len(order), rung):
            continue
        fails, meets = 0, len(order)
        while meets - fails > 1:
            mid = (fails + meets) // 2
            if attempt(mid, rung):
                meets = mid
            else:
                fails = mid
        return SearchOutcome({name: rung for name in order[:meets]}, True, trials)
    return SearchOutcome({}, False, trials)
