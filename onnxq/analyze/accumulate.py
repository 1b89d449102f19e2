"""Streaming error and range statistics: batch after batch, in constant memory."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from onnxq.evaluate import top1_agreement

HISTOGRAM_BINS = 64


def channel_axis(ndim: int) -> int | None:
    """The channel axis of an activation: 1 for NCHW-style (3+ spatial/sequence dims),
    the last for [batch, features] and [batch, sequence, features]."""
    if ndim >= 4:
        return 1
    if ndim >= 2:
        return ndim - 1
    return None


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """a . b by float32 BLAS (10x faster than float64 copies, its rounding ~1e-6 relative is
    far below any error worth reporting), in float64 where float32 overflows: masking
    constants near float32's limit (-3.4e38) square beyond it."""
    with np.errstate(over="ignore", invalid="ignore"):
        value = float(np.dot(a, b))
    if math.isfinite(value):
        return value
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)))


def _square_sum(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Sum of x^2 over `axes` in float64, squared in float32 unless that overflows."""
    with np.errstate(over="ignore"):
        squares = np.square(x, dtype=np.float32)
    if not np.isfinite(squares).all():
        squares = np.square(x, dtype=np.float64)
    return squares.sum(axis=axes, dtype=np.float64)


@dataclass
class ErrorStats:
    """Running sums for SQNR, cosine and the largest absolute error of `test` against `ref`."""

    signal: float = 0.0  # sum ref^2
    noise: float = 0.0  # sum (ref - test)^2
    test_energy: float = 0.0  # sum test^2
    dot: float = 0.0  # sum ref * test
    max_abs: float = 0.0
    count: int = 0
    channel_signal: np.ndarray | None = None  # per channel (`channel_axis`): sum ref^2
    channel_noise: np.ndarray | None = None

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        r = np.asarray(ref, np.float32).ravel()
        t = np.asarray(test, np.float32).ravel()
        if r.shape != t.shape:
            raise ValueError(f"shapes differ: {ref.shape} vs {test.shape}")
        with np.errstate(over="ignore", invalid="ignore"):
            diff = r - t
        noise = _dot(diff, diff)
        if not math.isfinite(noise) and np.isfinite(r).all() and np.isfinite(t).all():
            diff = r.astype(np.float64) - t.astype(np.float64)  # float32's difference overflowed
            noise = float(np.dot(diff, diff))
        self.signal += _dot(r, r)
        self.noise += noise
        self.test_energy += _dot(t, t)
        self.dot += _dot(r, t)
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(diff))))
        self.count += r.size
        self._per_channel(np.asarray(ref), diff.reshape(np.shape(ref)))

    def _per_channel(self, ref: np.ndarray, diff: np.ndarray) -> None:
        axis = channel_axis(ref.ndim)
        if axis is None:
            return
        other = tuple(i for i in range(ref.ndim) if i != axis)
        signal, noise = _square_sum(ref, other), _square_sum(diff, other)
        if self.channel_signal is None or self.channel_signal.shape != signal.shape:
            self.channel_signal, self.channel_noise = signal, noise
        else:
            self.channel_signal += signal
            self.channel_noise += noise

    @property
    def channel_relative_noise(self) -> float:
        """The mean over channels of each channel's noise / signal: a channel the layer
        wipes out counts fully however small it is, since a later layer may scale it up."""
        if self.channel_signal is None:
            return self.relative_noise
        live = self.channel_signal > 1e-12 * max(float(self.channel_signal.max()), 1e-30)
        if not live.any():
            return self.relative_noise
        return float(np.mean(self.channel_noise[live] / self.channel_signal[live]))

    @property
    def sqnr_db(self) -> float:
        """10 log10(signal / noise); inf when identical."""
        if self.noise == 0:
            return math.inf
        return 10.0 * math.log10(max(self.signal, 1e-30) / self.noise)

    @property
    def relative_noise(self) -> float:
        """noise / signal: the share of the tensor's power that quantization adds."""
        return self.noise / max(self.signal, 1e-30)

    @property
    def cosine(self) -> float:
        denom = math.sqrt(self.signal * self.test_energy)
        return self.dot / denom if denom else 1.0


@dataclass
class RangeStats:
    """The range a tensor's float values use against the grid its Q/DQ represents, and a
    histogram of the values over a window around that grid."""

    low: float
    high: float
    step: float | None = None  # the grid's step, where uniform: values within half of it past an end are no clip
    used_min: float = math.inf
    used_max: float = -math.inf
    saturated: int = 0
    count: int = 0
    edges: np.ndarray = field(default_factory=lambda: np.zeros(0))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        width = max(self.high - self.low, 1e-12)
        self.edges = np.linspace(self.low - 0.25 * width, self.high + 0.25 * width, HISTOGRAM_BINS + 1)
        self.counts = np.zeros(HISTOGRAM_BINS, np.int64)

    def update(self, values: np.ndarray) -> None:
        v = np.asarray(values, np.float32).ravel()
        if not v.size:
            return
        self.used_min = min(self.used_min, float(v.min()))
        self.used_max = max(self.used_max, float(v.max()))
        # A bound the grid misses by its scale's rounding; on a uniform grid, half a step: a
        # SiLU's minimum -0.278 on a grid ending at -0.265 (its zero point rounded) had read
        # as 10.7% clipped, where those values round to the end with at most that error.
        slack = max(1e-5 * (self.high - self.low), 0.5 * (self.step or 0.0))
        self.saturated += int(np.count_nonzero((v < self.low - slack) | (v > self.high + slack)))
        self.count += v.size
        lo, hi = self.edges[0], self.edges[-1]
        bins = ((v - lo) * (HISTOGRAM_BINS / (hi - lo))).astype(np.int64)
        np.clip(bins, 0, HISTOGRAM_BINS - 1, out=bins)
        self.counts += np.bincount(bins, minlength=HISTOGRAM_BINS)

    @property
    def saturation(self) -> float:
        """The fraction of values outside the grid (clipped by the QuantizeLinear)."""
        return self.saturated / self.count if self.count else 0.0


@dataclass
class AgreementStats:
    """Top-1 agreement of class scores [batch, classes], and accuracy against labels."""

    agree: int = 0
    total: int = 0

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        """Counted for outputs that look like class scores, as `evaluate.top1_agreement`
        judges them (not unit-length embeddings: their largest entry means nothing)."""
        share = top1_agreement(ref, test)
        if share is not None:
            self.agree += int(round(share * ref.shape[0]))
            self.total += ref.shape[0]

    @property
    def rate(self) -> float | None:
        return self.agree / self.total if self.total else None
