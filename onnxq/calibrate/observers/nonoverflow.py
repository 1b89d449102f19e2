"""`nonoverflow`: the smallest power-of-two scale under which no observed value saturates."""

from __future__ import annotations

import math

from onnxq.calibrate.observers.minmax import MinMaxObserver
from onnxq.calibrate.observers.registry import register_observer
from onnxq.numerics import qmath


def pow2_cover(value: float, steps: int) -> int:
    """Smallest k with 2**k * steps >= value (value > 0, steps > 0)."""
    k = math.ceil(math.log2(value / steps))
    while math.ldexp(steps, k) < value:
        k += 1
    while math.ldexp(steps, k - 1) >= value:
        k -= 1
    return k


@register_observer("nonoverflow")
class NonOverflowObserver(MinMaxObserver):
    """Symmetric: (-2^k D, 2^k D), D = symmetric_divisor, minimal k with 2^k D >= absmax.

    Asymmetric: the smallest power-of-two scale s for which an integer zero point
    zp in [qmin, qmax] puts [min(x, 0), max(x, 0)] inside [s (qmin - zp), s (qmax - zp)];
    of the valid zero points, the one nearest the min/max zero point (so qmin for data
    >= 0). The returned range is exactly that interval, so `compute_qparams` gives back
    this s and zp. The running min/max state is MinMax's.
    """

    integer_only = True

    def compute_range(self) -> tuple[float, float]:
        lo, hi = min(self.min, 0.0), max(self.max, 0.0)
        if self._count == 0 or lo == hi == 0.0:
            return 0.0, 0.0
        if self.spec.symmetric:
            d = qmath.symmetric_divisor(self.info)
            a = math.ldexp(d, pow2_cover(max(-lo, hi), d))
            return -a, a
        qmin, qmax = self.info.qmin, self.info.qmax
        k = pow2_cover(hi - lo, qmax - qmin)
        while True:
            s = math.ldexp(1.0, k)
            zlo, zhi = math.ceil(qmin - lo / s), math.floor(qmax - hi / s)
            if zlo <= zhi:
                zp = min(max(round(qmin - lo * (qmax - qmin) / (hi - lo)), zlo), zhi)
                return s * (qmin - zp), s * (qmax - zp)
            k += 1
