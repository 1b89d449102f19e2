"""`percentile`: clip at a percentile of the data, read from the streaming histogram."""

from __future__ import annotations

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.registry import register_observer
from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import ConfigError

# A percentile in percent: the range keeps [100 - p, p] of the data (asymmetric) or p of |x|;
# under 50 the asymmetric ends cross. One range for this observer and the config check
# (`config/spec_rules.py`).
PERCENTILE_RANGE = (50.0, 100.0)
PERCENTILE_FIX = "use a percent in [50, 100], e.g. 99.999 (not a fraction: 0.99999 is 0.99999%)"


@register_observer("percentile")
class PercentileObserver(HistogramObserver):
    """Symmetric: (-a, a) with a the p-th percentile of |x|. Asymmetric: the (100-p)-th
    and p-th percentiles of x. p = spec.percentile, in [50, 100]."""

    integer_only = False
    spec_fields = ("percentile", "num_bins")

    def __init__(self, spec: ResolvedSpec) -> None:
        if not PERCENTILE_RANGE[0] <= float(spec.percentile) <= PERCENTILE_RANGE[1]:
            raise ConfigError(f"invalid percentile {spec.percentile}; {PERCENTILE_FIX}")
        super().__init__(spec)

    def _range(self) -> tuple[float, float]:
        p = float(self.spec.percentile)
        if self.hist.symmetric:
            a = self.hist.percentile(p)
            return -a, a
        return self.hist.percentile(100.0 - p), self.hist.percentile(p)
