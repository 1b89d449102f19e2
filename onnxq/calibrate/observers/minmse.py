"""`minmse`: the clipping range of least expected quantization MSE on the histogram."""

from __future__ import annotations

import math

import numpy as np

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.nonoverflow import pow2_cover
from onnxq.calibrate.observers.qerror import HistogramErrorModel, best_range
from onnxq.calibrate.observers.registry import register_observer
from onnxq.numerics import qmath

# Power-of-two searches try this many octaves below the smallest covering scale.
POW2_OCTAVES = 24
# Coarse grid per side of the asymmetric 2-D search, before refining each side.
COARSE = 64
REFINE_ROUNDS = 2


def pow2_asymmetric_candidates(
    lo: float, hi: float, qmin: int, qmax: int, octaves: int = POW2_OCTAVES
) -> tuple[np.ndarray, np.ndarray]:
    """Ranges (s (qmin - zp), s (qmax - zp)) for power-of-two s up to the covering one
    and integer zp in [qmin, qmax] (at most 4097 evenly spread ones per scale)."""
    k_top = pow2_cover(max(hi - lo, math.ldexp(1.0, -1000)), qmax - qmin) + 1
    scales = np.ldexp(1.0, np.arange(k_top - octaves, k_top + 1))
    zps = np.unique(np.rint(np.linspace(qmin, qmax, min(qmax - qmin + 1, 4097))))
    s, z = np.meshgrid(scales, zps, indexing="ij")
    return (s * (qmin - z)).ravel(), (s * (qmax - z)).ravel()


@register_observer("minmse")
class MinMseObserver(HistogramObserver):
    """Searches the range that minimises the estimated MSE for the spec's dtype.

    Symmetric specs histogram |x| and try `num_bins` thresholds a in (0, absmax].
    Asymmetric specs try a 64 x 64 grid of (lower, upper) shrink factors of
    [min(x, 0), max(x, 0)], then refine each side alone at `num_bins` resolution.
    With `scale_type == "power_of_two"` only ranges whose scale is an exact power of
    two are tried: (-2^k D, 2^k D) when symmetric, 2^k (qmin - zp, qmax - zp) otherwise.
    """

    def _range(self) -> tuple[float, float]:
        spec = self.spec
        args = (spec.dtype, spec.symmetric, spec.scale_type)
        pow2 = spec.scale_type == "power_of_two"
        n = self.hist.num_bins
        if self.hist.symmetric:
            amax = self.hist.max
            if amax == 0.0:
                return 0.0, 0.0
            model = HistogramErrorModel(self.hist)  # after the all-zero case: its bins are 2^-1000 wide
            if pow2:
                d = qmath.symmetric_divisor(self.info)
                k = pow2_cover(amax, d)
                a = np.ldexp(float(d), np.arange(k - POW2_OCTAVES, k + 1))
            else:
                a = amax * np.arange(1, n + 1) / n
            _, best, _ = best_range(model, -a, a, *args)
            return -best, best
        lo, hi = min(self.hist.min, 0.0), max(self.hist.max, 0.0)
        if lo == hi:
            return 0.0, 0.0
        model = HistogramErrorModel(self.hist)
        if pow2:
            cand_lo, cand_hi = pow2_asymmetric_candidates(lo, hi, self.info.qmin, self.info.qmax)
            best_lo, best_hi, _ = best_range(model, cand_lo, cand_hi, *args)
            return best_lo, best_hi
        coarse = np.arange(1, COARSE + 1) / COARSE
        best_lo, best_hi, err = best_range(model, lo * coarse[:, None], hi * coarse[None, :], *args)
        fine = np.arange(1, n + 1) / n
        for _ in range(REFINE_ROUNDS):
            new_lo, new_hi, new_err = best_range(model, best_lo, hi * fine, *args)
            if new_err < err:
                best_lo, best_hi, err = new_lo, new_hi, new_err
            new_lo, new_hi, new_err = best_range(model, lo * fine, best_hi, *args)
            if new_err < err:
                best_lo, best_hi, err = new_lo, new_hi, new_err
        return best_lo, best_hi
