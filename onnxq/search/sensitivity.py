"""Rank layers by what each does to the model's output when it alone is quantized.

The rule is the analysis's (`analyze/impact.py`: `onnxq analyze` orders its layer table by
it too); here each candidate's single-layer model is emitted from the search's calibrated
state with every other candidate at the ladder's top rung (no new calibration), and run
on the first IMPACT_SAMPLES samples of the eval set, where the target is scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from onnxq.analyze.impact import IMPACT_SAMPLES
from onnxq.analyze.impact import impact_order as _impact_order
from onnxq.search.target import EvalSet


def impact_order(
    candidates: Sequence[str], fallback: Sequence[str], evalset: EvalSet, float_session,
    session_with_only: Callable[[str], object], limit: int,
) -> list[tuple[str, float]]:
    """`candidates` most harmful first, by the output noise of the model in which each is
    the only quantized layer (`session_with_only(name)` opens it), on the eval set's first
    IMPACT_SAMPLES samples, the first `limit` of them measured; the others follow in
    `fallback`'s order (the analysis ranking)."""
    sample = dataclasses.replace(evalset, max_samples=min(evalset.max_samples or IMPACT_SAMPLES, IMPACT_SAMPLES),
                                 reference=None)
    return _impact_order(candidates, fallback, sample.first_output, float_session, session_with_only, limit)
