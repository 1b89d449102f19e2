"""A streaming histogram with a fixed number of bins on a power-of-two grid.

Bin width is always `2**k` and bin edges are integer multiples of it. The grid is a
function of the observed data range only: `k` is the smallest exponent whose window of
`num_bins` bins, starting at the bin that holds the minimum, also holds the maximum
(never finer than `2**-40` times the largest magnitude, which gives constant data a tiny
nonzero width). A wider range can only raise `k`, and a bin of width `2**k` is the union
of whole bins of any finer power-of-two width, so widening merges bins exactly and never
needs the samples again. Hence the histogram of a stream does not depend on how the
stream was batched, and merging histograms of two parts of a stream gives exactly the
histogram of the whole stream.
"""

from __future__ import annotations

import math

import numpy as np

# Finest bin width relative to the largest magnitude seen: 2**-40 keeps every global bin
# index below 2**41, exact in float64 and int64.
_REL_EXPONENT = 40
# Exponent used while every value seen is zero.
_MIN_EXPONENT = -1000


def finite_values(x: np.ndarray) -> np.ndarray:
    """`x` flattened to float64 with nan and +-inf dropped."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    if flat.size and not (np.isfinite(flat.min()) and np.isfinite(flat.max())):
        flat = flat[np.isfinite(flat)]
    return flat


def _bin_index(x: float, k: int) -> int:
    """floor(x / 2**k), exact (a negative x that underflows to -0.0 is in bin -1)."""
    scaled = math.ldexp(x, -k)
    return -1 if scaled == 0.0 and x < 0.0 else math.floor(scaled)


def _grid(lo: float, hi: float, num_bins: int) -> tuple[int, int]:
    """Canonical (exponent, first global bin index) of the window covering [lo, hi]."""
    mag = max(abs(lo), abs(hi))
    k = _MIN_EXPONENT if mag == 0.0 else max(math.frexp(mag)[1] - _REL_EXPONENT, _MIN_EXPONENT)
    # A window of num_bins bins needs a width of at least (hi - lo) / num_bins; halving
    # avoids overflow near the float64 maximum.
    ratio = (hi / 2 - lo / 2) / num_bins
    if ratio > 0:
        k = max(k, math.floor(math.log2(ratio)))
    while True:
        start = _bin_index(lo, k)
        if _bin_index(hi, k) - start < num_bins:
            return k, start
        k += 1


class StreamingHistogram:
    """Histogram of x (or of |x| when `symmetric`) with exact widening and merging.

    State is `num_bins` int64 counts plus a few scalars, whatever the amount of data.
    Bins are half-open `[edge_i, edge_{i+1})`; in symmetric mode the window starts at 0.
    """

    def __init__(self, num_bins: int = 2048, symmetric: bool = False) -> None:
        if int(num_bins) < 2:
            raise ValueError(f"a histogram needs at least 2 bins, got {num_bins}")
        self.num_bins = int(num_bins)
        self.symmetric = bool(symmetric)
        self._counts = np.zeros(self.num_bins, dtype=np.int64)
        self._exp = _MIN_EXPONENT
        self._start = 0
        self._lo: float | None = None  # smallest value histogrammed (0 in symmetric mode)
        self._hi: float | None = None  # largest value histogrammed
        self._zeros = 0  # exact zeros (ReLU outputs, padding): always representable

    # -- state ---------------------------------------------------------------------------
    @property
    def counts(self) -> np.ndarray:
        """Read-only view of the int64 bin counts."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    @property
    def total(self) -> int:
        """Number of values histogrammed."""
        return int(self._counts.sum())

    @property
    def zeros(self) -> int:
        """Number of values exactly 0 (also counted in their bin)."""
        return self._zeros

    @property
    def is_empty(self) -> bool:
        return self._hi is None

    @property
    def min(self) -> float:
        """Smallest value seen (of |x| in symmetric mode: 0); 0.0 when empty."""
        return 0.0 if self._lo is None else self._lo

    @property
    def max(self) -> float:
        """Largest value seen (of |x| in symmetric mode); 0.0 when empty."""
        return 0.0 if self._hi is None else self._hi

    @property
    def bin_width(self) -> float:
        return math.ldexp(1.0, self._exp)

    def edges(self) -> np.ndarray:
        """The `num_bins + 1` bin edges (exact: integer multiples of the bin width)."""
        return np.ldexp(
            np.arange(self._start, self._start + self.num_bins + 1, dtype=np.float64), self._exp
        )

    def centers(self) -> np.ndarray:
        """Bin centres."""
        e = self.edges()
        return 0.5 * (e[:-1] + e[1:])

    def last_nonzero(self) -> int:
        """Index of the last non-empty bin, -1 when empty."""
        nz = np.flatnonzero(self._counts)
        return int(nz[-1]) if nz.size else -1

    def copy(self) -> StreamingHistogram:
        other = StreamingHistogram(self.num_bins, self.symmetric)
        other._counts = self._counts.copy()
        other._exp, other._start, other._lo, other._hi = self._exp, self._start, self._lo, self._hi
        other._zeros = self._zeros
        return other

    def state(self) -> dict[str, np.ndarray]:
        """The histogram as arrays (`set_state` restores it exactly; stats files)."""
        empty = self._hi is None
        return {"counts": self._counts.copy(), "exp_start_zeros": np.array([self._exp, self._start, self._zeros], np.int64),
                "lo_hi": np.array([np.nan, np.nan] if empty else [self._lo, self._hi], np.float64)}

    def set_state(self, arrays: dict[str, np.ndarray]) -> None:
        counts = np.asarray(arrays["counts"], np.int64)
        if counts.shape != (self.num_bins,):
            raise ValueError(f"histogram state has {counts.size} bins, expected {self.num_bins}")
        self._counts = counts.copy()
        self._exp, self._start, self._zeros = (int(v) for v in arrays["exp_start_zeros"])
        lo, hi = (float(v) for v in arrays["lo_hi"])
        self._lo, self._hi = (None, None) if math.isnan(hi) else (lo, hi)

    # -- updates -------------------------------------------------------------------------
    def update(self, x: np.ndarray) -> tuple[float, float] | None:
        """Add the finite values of one batch (any shape); nan and inf are ignored.

        Returns the batch's finite (min, max) of the signed values, None if it had none.

        Vectorised and in place: the batch is scaled by the power-of-two bin width (exact),
        floored and counted with `np.bincount`. float32 data stays float32 whenever that is
        exact (bin indices below 2**24, no underflow); otherwise float64 is used.
        """
        flat = np.asarray(x).ravel()
        if flat.dtype not in (np.float32, np.float64):
            flat = flat.astype(np.float64)
        if flat.size == 0:
            return None
        lo, hi = float(flat.min()), float(flat.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            flat = flat[np.isfinite(flat)]
            if flat.size == 0:
                return None
            lo, hi = float(flat.min()), float(flat.max())
        signed = (lo, hi)
        if self.symmetric:
            flat = np.abs(flat)
            lo, hi = 0.0, max(-lo, hi)
        self._extend(lo, hi)
        exact32 = flat.dtype == np.float32 and -100 < self._exp <= 0 and abs(self._start) + self.num_bins < 2**24
        work = flat.astype(np.float32 if exact32 else np.float64)  # one copy, reused in place
        np.multiply(work, work.dtype.type(2.0**-self._exp), out=work)
        np.floor(work, out=work)
        work -= self._start
        idx = work.astype(np.int32 if exact32 else np.int64)
        np.clip(idx, 0, self.num_bins - 1, out=idx)  # values rounding onto the top edge
        self._counts += np.bincount(idx, minlength=self.num_bins)
        self._zeros += flat.size - int(np.count_nonzero(flat))
        return signed

    def merge(self, other: StreamingHistogram) -> None:
        """Add `other`'s counts into self, exactly (both end on the grid of the union)."""
        if other.num_bins != self.num_bins or other.symmetric != self.symmetric:
            raise ValueError(
                "cannot merge histograms with different bin counts or modes: "
                f"({self.num_bins}, symmetric={self.symmetric}) and "
                f"({other.num_bins}, symmetric={other.symmetric})"
            )
        if other.is_empty:
            return
        self._extend(other.min, other.max)
        self._counts += other._rebinned(self._exp, self._start)
        self._zeros += other._zeros

    def _extend(self, lo: float, hi: float) -> None:
        """Widen the grid to the canonical one for the union of the range and [lo, hi]."""
        if self._lo is not None and self._hi is not None:
            lo, hi = min(lo, self._lo), max(hi, self._hi)
            if lo == self._lo and hi == self._hi:
                return
        exp, start = _grid(lo, hi, self.num_bins)
        if self._hi is not None:
            self._counts = self._rebinned(exp, start)
        self._exp, self._start, self._lo, self._hi = exp, start, lo, hi

    def _rebinned(self, exp: int, start: int) -> np.ndarray:
        """Counts moved to the coarser-or-equal grid (exp, start); each old bin lands whole."""
        if exp < self._exp:
            raise ValueError("a histogram can only move to a coarser grid")
        old = np.flatnonzero(self._counts)
        shift = min(exp - self._exp, 62)  # global indices are < 2**41, so 62 means "all"
        new = ((old + self._start) >> shift) - start
        assert new.size == 0 or (new[0] >= 0 and new[-1] < self.num_bins), (
            "grid does not cover data"
        )
        out = np.zeros(self.num_bins, dtype=np.int64)
        np.add.at(out, new, self._counts[old])
        return out

    # -- queries -------------------------------------------------------------------------
    def cumulative(self) -> np.ndarray:
        """Counts at or below each edge: `num_bins + 1` values from 0 to `total`."""
        return np.concatenate(([0], np.cumsum(self._counts)))

    def percentile(self, p: float) -> float:
        """Value below which `p` percent of the data falls, linear inside the bin.

        The result lies in the same bin as numpy's `method="inverted_cdf"` percentile, so
        it is within one bin width of it; it is clamped to the observed [min, max].
        """
        total = self.total
        if total == 0:
            return 0.0
        target = min(max(float(p), 0.0), 100.0) / 100.0 * total
        cum = self.cumulative()
        if target <= 0.0:
            i = int(np.flatnonzero(self._counts)[0])
            frac = 0.0
        else:
            i = min(int(np.searchsorted(cum[1:], target, side="left")), self.num_bins - 1)
            frac = (target - cum[i]) / self._counts[i]
        value = math.ldexp(self._start + i + frac, self._exp)
        return float(min(max(value, self.min), self.max))
