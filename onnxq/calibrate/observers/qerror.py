"""Expected quantization error of histogrammed data, for the range-searching observers.

Values are taken as uniformly spread inside each bin. A candidate range becomes a real
quantizer through `qmath.compute_qparams` (same dtype, symmetry and scale type as the
emitter will use), which clips at `scale * (qmin - zp)` and `scale * (qmax - zp)`. The
error is the exact squared clipping error of the mass outside that interval plus the
rounding noise `scale**2 / 12` per value inside it, except exact zeros, which quantize
without error. Prefix sums of the bin moments make
each candidate O(1), so thousands of candidates cost a few vector operations.
"""

from __future__ import annotations

import numpy as np

from onnxq.calibrate.observers.histogram import StreamingHistogram
from onnxq.config.spec import DType
from onnxq.numerics import qmath


class HistogramErrorModel:
    """Squared quantization error of a histogram's data for many clip intervals at once."""

    def __init__(self, hist: StreamingHistogram) -> None:
        edges = hist.edges()
        counts = hist.counts.astype(np.float64)
        self._w = float(edges[1] - edges[0])
        self._n = counts.size
        self._zeros = float(hist.zeros)
        # Work around the window centre to limit cancellation in the moment sums.
        self._ref = float(0.5 * (edges[0] + edges[-1]))
        self._left = edges[:-1] - self._ref
        self._density = counts / self._w
        c = self._left + 0.5 * self._w
        zero = np.zeros(1)
        self._c0 = np.concatenate((zero, np.cumsum(counts)))
        self._c1 = np.concatenate((zero, np.cumsum(counts * c)))
        self._c2 = np.concatenate((zero, np.cumsum(counts * (c * c + self._w**2 / 12))))

    def _below(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mass, first and second moment of the data below each t (centred coordinates)."""
        j = np.clip(np.floor((t - self._left[0]) / self._w), 0, self._n - 1).astype(np.int64)
        left = self._left[j]
        u = np.clip(t, left, left + self._w)
        du = u - left
        d = self._density[j]
        m0 = self._c0[j] + d * du
        m1 = self._c1[j] + d * du * (u + left) / 2
        m2 = self._c2[j] + d * du * (u * u + u * left + left * left) / 3
        return m0, m1, m2

    def sq_error(self, cmin: np.ndarray, cmax: np.ndarray, step: np.ndarray) -> np.ndarray:
        """Total squared error when clipping to [cmin, cmax] and rounding to `step`."""
        lo = np.asarray(cmin, dtype=np.float64) - self._ref
        hi = np.asarray(cmax, dtype=np.float64) - self._ref
        a0, a1, a2 = self._below(lo)
        b0, b1, b2 = self._below(hi)
        t0, t1, t2 = self._c0[-1], self._c1[-1], self._c2[-1]
        under = np.maximum(lo * lo * a0 - 2 * lo * a1 + a2, 0.0)
        over = np.maximum((t2 - b2) - 2 * hi * (t1 - b1) + hi * hi * (t0 - b0), 0.0)
        # Exact zeros are always representable (the range includes 0): no rounding noise.
        inside = (
            np.maximum(b0 - a0 - self._zeros, 0.0) * np.asarray(step, dtype=np.float64) ** 2 / 12
        )
        return under + over + inside


def range_errors(
    model: HistogramErrorModel,
    rmin: np.ndarray,
    rmax: np.ndarray,
    dtype: DType | str,
    symmetric: bool,
    scale_type: str,
) -> np.ndarray:
    """Estimated squared error of quantizing with the qparams of each (rmin, rmax)."""
    info = qmath.int_type(dtype)
    scale, zp = qmath.compute_qparams(rmin, rmax, dtype, symmetric, scale_type)
    s = scale.astype(np.float64)
    z = zp.astype(np.float64)
    return model.sq_error(s * (info.qmin - z), s * (info.qmax - z), s)


def best_range(
    model: HistogramErrorModel,
    rmin: np.ndarray,
    rmax: np.ndarray,
    dtype: DType | str,
    symmetric: bool,
    scale_type: str,
) -> tuple[float, float, float]:
    """The candidate (rmin, rmax) of least estimated error, and that error."""
    rmin, rmax = np.broadcast_arrays(np.asarray(rmin, np.float64), np.asarray(rmax, np.float64))
    err = range_errors(model, rmin, rmax, dtype, symmetric, scale_type)
    i = int(np.argmin(err))
    return float(rmin.flat[i]), float(rmax.flat[i]), float(err.flat[i])
