"""`percentile`: clip at a percentile of the data, read from the streaming histogram."""

from __future__ import annotations

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.registry import register_observer
from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import ConfigError


@register_observer("percentile")
class PercentileObserver(HistogramObserver):
    """Symmetric: (-a, a) with a the p-th percentile of |x|. Asymmetric: the (100-p)-th
    and p-th percentiles of x. p = spec.percentile, in [50, 100]."""

    integer_only = False
    spec_fields = ("percentile", "num_bins")

    def __init__(self, spec: ResolvedSpec) -> None:
        if not 50.0 <= float(spec.percentile) <= 100.0:
            raise ConfigError(f"percentile must be in [50, 100], got {spec.percentile}")
        super().__init__(spec)

    def _range(self) -> tuple[float, float]:
        p = float(self.spec.percentile)
        if self.hist.symmetric:
            a = self.hist.percentile(p)
            return -a, a
        return self.hist.percentile(100.0 - p), self.hist.percentile(p)
