"""Rank layers by what each does to the model's output when it alone is quantized.

The analysis's per-layer noise (`onnxq.analyze`: the error a layer adds to its own output)
misses what the rest of the network does with that error: on MobileNet-v1 with float8
activations every layer adds about the same relative noise (~30 dB), but the first two
layers' alone bring the logits to 9 dB while the last ones' leave them at 31-33 dB, so a
search ranked by local noise raised 29 of 30 layers. Here each candidate is measured
where the target is scored: the model is emitted with only that layer quantized (every
other candidate at the ladder's top rung, from the calibrated state, no new calibration)
and run in a default session on a few samples; its output noise relative to the float
output ranks it. That costs one emission and one short run per layer, so past a budget set
by the model's size (not the clock: rankings are reproducible) the remaining layers keep
the analysis's order after the measured ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from onnxq.evaluate import sqnr_db
from onnxq.search.target import EvalSet

# Samples each single-layer model runs on, and the weight bytes the ranking may emit and
# run in all (layers measured: this over the model's size, at least IMPACT_MIN_LAYERS): a
# budget from the model, not the clock, so the same inputs give the same ranking.
IMPACT_SAMPLES = 32
IMPACT_WORK_BYTES = 4 << 30
IMPACT_MIN_LAYERS = 16


def output_noise(reference: np.ndarray, output: np.ndarray) -> float:
    """Noise power of `output` relative to `reference`'s signal power (inf when not finite)."""
    noise = 10.0 ** (-sqnr_db(reference, output) / 10.0)
    return noise if np.isfinite(noise) else float("inf")


def layers_to_measure(model_bytes: int) -> int:
    """How many layers the ranking measures on a model of `model_bytes` of weights."""
    return max(IMPACT_MIN_LAYERS, IMPACT_WORK_BYTES // max(model_bytes, 1))


def impact_order(
    candidates: Sequence[str], fallback: Sequence[str], evalset: EvalSet, float_session,
    session_with_only: Callable[[str], object], limit: int,
) -> list[tuple[str, float]]:
    """`candidates` most harmful first, by the output noise of the model in which each is
    the only quantized layer (`session_with_only(name)` opens it), the first `limit` of them
    measured; the others follow in `fallback`'s order (the analysis ranking)."""
    sample = dataclasses.replace(evalset, max_samples=min(evalset.max_samples or IMPACT_SAMPLES, IMPACT_SAMPLES),
                                 reference=None)
    reference = sample.first_output(float_session)
    measured = {name: output_noise(reference, sample.first_output(session_with_only(name)))
                for name in list(candidates)[:limit]}
    ranked = sorted(measured.items(), key=lambda item: (-item[1], item[0]))
    rest = [(n, float("nan")) for n in fallback if n not in measured]
    return ranked + rest
