"""Rank layers by what each does to the model's output when it alone is quantized.

The one rule for "which layer hurts most", used by `onnxq analyze` (its layer table's
order) and by the accuracy search (which layers it raises first, `search/sensitivity.py`).

A layer's own error (the analysis's per-layer noise, `ch noise`: the error it adds to its
own output) misses what the rest of the network does with that error. On MobileNet-v1 with
float8 activations every layer adds about the same relative noise (~30 dB), but the first
two layers' alone bring the logits to 9 dB while the last ones' leave them at 31-33 dB, so
a search ranked by local noise raised 29 of 30 layers. On ResNet-20 with int4 weights the
first convolution ranked sixth by its channels' noise, though alone it brings the logits
to 17.3 dB where no other layer brings them below 24.9: its weights in int8 gain 2.0 dB
at the logits and 1.9 points of top-1 (1800 CIFAR-10 images), those of the three first
by channel noise 0.4 dB and 0.5 points. So each layer is measured where accuracy is: the
model with only that layer quantized runs in a default session on a few samples, and its
first output's noise relative to the float model's ranks it. That costs one model and one
short run per layer, so past a budget set by the model's size (not the clock: rankings are
reproducible) the remaining layers keep the fallback order (the per-layer noise) after the
measured ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnxq.evaluate import sqnr_db

# Samples each single-layer model runs on, and the weight bytes the ranking may emit and
# run in all (layers measured: this over the model's size, at least IMPACT_MIN_LAYERS): a
# budget from the model, not the clock, so the same inputs give the same ranking.
IMPACT_SAMPLES = 32
IMPACT_WORK_BYTES = 4 << 30
IMPACT_MIN_LAYERS = 16
# `onnxq analyze` reads fewer samples where their first output passes this many bytes (a
# 135M-parameter LLM's logits: 50 MB a 256-token window), to keep its memory bounded.
IMPACT_OUTPUT_BYTES = 1 << 27


def noise_db(noise: float) -> float | None:
    """A ranking noise (noise / signal of the first output) as an SQNR in dB: inf for no
    noise, None where the layer was not measured (NaN)."""
    if not math.isfinite(noise) or noise < 0:
        return None
    return math.inf if noise == 0 else -10.0 * math.log10(noise)

FirstOutput = Callable[[Any], np.ndarray]  # a session -> its first output on the ranking's samples


def output_noise(reference: np.ndarray, output: np.ndarray) -> float:
    """Noise power of `output` relative to `reference`'s signal power (inf when not finite)."""
    noise = 10.0 ** (-sqnr_db(reference, output) / 10.0)
    return noise if np.isfinite(noise) else float("inf")


# Where the ranking follows an analysis pass over the data (`onnxq analyze`, `--report`): at
# most this many passes' worth of sample runs, so that its cost follows the model's compute,
# which its weights do not tell (SSDlite-320, 14 MB of weights and 157 layers, every one
# measured on 32 images: 855 s against an 8 s quantize; MobileNet-v1, MiniLM and ResNet-20
# on their 200-256 calibration samples keep every layer measured).
RANK_PASSES = 16


def layers_to_measure(model_bytes: int, analysed: int | None = None, per_layer: int = IMPACT_SAMPLES) -> int:
    """How many layers the ranking measures on a model of `model_bytes` of weights; where
    it follows an analysis pass over `analysed` samples, each layer's model running on
    `per_layer` of them, also at most `RANK_PASSES` such passes."""
    limit = IMPACT_WORK_BYTES // max(model_bytes, 1)
    if analysed is not None:
        limit = min(limit, RANK_PASSES * analysed // max(per_layer, 1))
    return max(IMPACT_MIN_LAYERS, limit)


def impact_order(
    candidates: Sequence[str], fallback: Sequence[str], first_output: FirstOutput, float_session: Any,
    session_with_only: Callable[[str], Any], limit: int,
) -> list[tuple[str, float]]:
    """`candidates` most harmful first, by the output noise of the model in which each is
    the only quantized layer (`session_with_only(name)` opens it; `first_output(session)`
    runs a session on the ranking's samples), the first `limit` of them measured; the others
    follow in `fallback`'s order with NaN. Equal noise goes by name: deterministic."""
    reference = first_output(float_session)
    measured = {name: output_noise(reference, first_output(session_with_only(name)))
                for name in list(candidates)[:limit]}
    ranked = sorted(measured.items(), key=lambda item: (-item[1], item[0]))
    rest = [(n, float("nan")) for n in fallback if n not in measured]
    return ranked + rest
