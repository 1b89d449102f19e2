"""`entropy`: TensorRT-style KL-divergence threshold on the |x| histogram."""

from __future__ import annotations

import numpy as np

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.registry import register_observer
from onnxq.numerics import qmath

# Thresholds are searched coarse to fine: COARSE evenly strided candidates, then the
# neighbourhood of the best at the resolution of MAX_CANDIDATES over the whole range.
COARSE = 96
MAX_CANDIDATES = 512


def _smooth(p: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    """Give empty bins `eps` counts, taken evenly from the others (MXNet/TensorRT)."""
    zeros = p == 0
    n_zero = int(zeros.sum())
    n_nonzero = p.size - n_zero
    if n_nonzero == 0:
        return None
    return p + eps * zeros - (eps * n_zero / n_nonzero) * ~zeros


def kl_divergence_of_threshold(hist: np.ndarray, i: int, levels: int) -> float:
    """KL(P || Q): P = first `i` bins with the tail folded into the last, Q = P's bins
    merged into `levels` groups and spread back evenly over P's non-empty bins."""
    p = hist[:i].astype(np.float64)
    p[-1] += hist[i:].sum()
    nonzero = p != 0
    starts = (np.arange(levels) * (i // levels)).astype(np.int64)
    group_sum = np.add.reduceat(hist[:i].astype(np.float64), starts)
    group_nz = np.add.reduceat(nonzero.astype(np.int64), starts)
    lengths = np.diff(np.append(starts, i))
    per_bin = np.divide(group_sum, group_nz, out=np.zeros(levels), where=group_nz > 0)
    q = np.repeat(per_bin, lengths) * nonzero
    ps, qs = _smooth(p), _smooth(q)
    if ps is None or qs is None:
        return np.inf
    ps, qs = np.maximum(ps, 1e-12), np.maximum(qs, 1e-12)
    ps, qs = ps / ps.sum(), qs / qs.sum()
    return float(np.sum(ps * np.log(ps / qs)))


def entropy_threshold(hist: np.ndarray, edges: np.ndarray, levels: int) -> float:
    """Upper edge of the bin count whose clipped distribution has least KL divergence.

    As in TensorRT's calibrator, the first bin (where exact zeros, e.g. from ReLU, pile
    up) is given the count of the second so that the spike does not decide the result;
    ties go to the widest threshold.
    """
    hist = hist.astype(np.int64)
    if hist.size > 1:
        hist[0] = hist[1]
    nz = np.flatnonzero(hist)
    end = int(nz[-1]) + 1 if nz.size else 0
    if end <= levels:
        return float(edges[end])
    fine = max(1, (end - levels) // MAX_CANDIDATES)
    coarse = max(fine, (end - levels) // COARSE)
    best = _best(hist, _span(levels, end, coarse), levels)
    best = _best(hist, _span(max(levels, best - coarse), min(end, best + coarse), fine), levels)
    return float(edges[best])


def _span(lo: int, hi: int, stride: int) -> list[int]:
    """lo, lo + stride, ... up to and including hi."""
    out = list(range(lo, hi + 1, stride))
    if out[-1] != hi:
        out.append(hi)
    return out


def _best(hist: np.ndarray, candidates: list[int], levels: int) -> int:
    """The candidate of least KL divergence; ties go to the widest threshold."""
    kl = np.array([kl_divergence_of_threshold(hist, i, levels) for i in candidates])
    return candidates[len(kl) - 1 - int(np.argmin(kl[::-1]))]


@register_observer("entropy")
class EntropyObserver(HistogramObserver):
    """Threshold t from the |x| histogram. Levels: symmetric_divisor + 1 (128 for 8-bit),
    or the whole integer range (256) for an asymmetric spec on one-sided data.
    Symmetric specs get (-t, t); asymmetric ones get (max(min(x), -t), min(max(x), t)),
    e.g. (0, t) for ReLU outputs. If the histogram has no more used bins than levels
    (very wide dtypes), t = max|x| (no clipping)."""

    def _folded(self) -> bool:
        return True

    def _range(self) -> tuple[float, float]:
        one_sided = self.data_min >= 0.0 or self.data_max <= 0.0
        if one_sided and not self.spec.symmetric:
            levels = self.info.qmax - self.info.qmin + 1
        else:
            levels = qmath.symmetric_divisor(self.info) + 1
        t = entropy_threshold(self.hist.counts, self.hist.edges(), levels)
        t = min(t, self.hist.max)
        if self.spec.symmetric:
            return -t, t
        return max(self.data_min, -t), min(self.data_max, t)
