"""Whether an algorithm rung's gain is real or the eval set's noise.

A rung is scored on the same eval samples as the recipe before it, so the two are compared
sample by sample: with d_i the change in sample i's part of the score (`target.Scored`:
100 or 0 for a label matched, a cosine, minus a noise energy), the mean of d is the gain
and its standard error s(d) / sqrt(n) is how far that gain moves with the choice of
samples. A rung is kept only where its gain exceeds that error. On top-1 that is at least
two more labels matched than lost with no others changed (one label more is exactly one
standard error, and a per-channel rung with a SmoothQuant Mul was kept on one image in
600, leaving an Add and the pooling in float); three gained and one lost is not enough,
four gained and one lost is. SQNR and cosine average thousands of outputs, so a
systematic change passes that test however small: a gain beyond the noise must also be
worth a rung, `LEAST_DB` on SQNR and the cosine gain that cuts 1 - cosine by as much.
A rung that meets the target is kept on any gain (the target
is the user's own bar), and a caller's metric, which gives one number per model, keeps a
rung on any gain unless `rung_min_gain` is set; `rung_min_gain` (in the metric's units)
replaces the test wherever it is given, 0 keeping any gain as the search did before.
"""

from __future__ import annotations

import math

import numpy as np

from onnxq.search.target import Scored

# The least SQNR gain worth a rung, in dB: 2.3% less noise energy, the report's last digit.
# A SmoothQuant rung was kept for 0.01 dB on an SQNR target (MiniLM, trust trial,
# 2026-11-29), leaving a Mul before each of its MatMuls for nothing a user could measure.
LEAST_DB = 0.1

# A gain within this fraction of its standard error counts as equal to it (one label in
# top-1 is exactly one standard error up to rounding).
TIE = 1e-9


def rung_gain(candidate: Scored, start: Scored, higher_is_better: bool, met: bool,
              min_gain: float | None) -> str | None:
    """None where `candidate` is better than `start` by more than the noise (module doc),
    else why not, for the summary."""
    gain = candidate.value - start.value if higher_is_better else start.value - candidate.value
    if not gain > 0:
        return "no better"
    if met:
        return None
    if min_gain is not None:
        return None if gain >= min_gain else f"gain {gain:.3g} under rung_min_gain {min_gain:g}"
    if candidate.samples is None or start.samples is None or len(candidate.samples) < 2:
        return None
    d = (candidate.samples.astype(np.float64) - start.samples) * (1 if higher_is_better else -1)
    if not np.all(np.isfinite(d)):  # a sample overflowed in one model: fixed by the rung, or broken by it
        return None if not np.any(np.isnan(d) | (d < 0) & np.isinf(d)) else "no better (a sample overflows)"
    mean, error = float(np.mean(d)), float(np.std(d, ddof=1)) / math.sqrt(len(d))
    if mean > error * (1 + TIE):
        least = least_gain(start)
        return None if gain >= least else (f"gain {gain:.3g} under {least:.3g}, the least worth a rung on "
                                           f"{start.metric} (--rung-min-gain 0 keeps any gain)")
    return (f"gain {gain:.3g} within the eval set's noise ({mean / error if error else 0:.2g} standard "
            f"errors of the per-sample change over {len(d)} samples; --rung-min-gain 0 keeps any gain)")


def least_gain(start: Scored) -> float:
    """The least gain over `start` worth a rung (module doc): `LEAST_DB` on SQNR, on cosine
    the gain that cuts 1 - cosine by the same fraction, nothing on top-1 (whose noise test
    already asks for two labels)."""
    shrink = 1.0 - 10.0 ** (-LEAST_DB / 10.0)
    if start.metric == "sqnr":
        return LEAST_DB
    if start.metric == "cosine" and math.isfinite(start.value):
        return shrink * max(0.0, 1.0 - start.value)
    return 0.0
