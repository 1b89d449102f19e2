"""`ifmr` (as in Huawei AMCT): percentile start point, then a clip-factor grid search."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.options import check_bool_or_none, check_number
from onnxq.calibrate.observers.qerror import HistogramErrorModel, best_range
from onnxq.calibrate.observers.registry import register_observer
from onnxq.errors import ConfigError


@dataclass(frozen=True)
class IfmrOptions:
    """Options of `ifmr`; percentiles are fractions in (0.5, 1]."""

    max_percentile: float = 0.999999
    min_percentile: float = 0.999999
    search_range_start: float = 0.7
    search_range_end: float = 1.3
    search_step: float = 0.01
    asymmetric: bool | None = None

    def __post_init__(self) -> None:
        for key in ("max_percentile", "min_percentile"):
            value = check_number("ifmr", key, getattr(self, key))
            if not 0.5 < value <= 1.0:
                raise ConfigError(
                    f"calib option '{key}' for method 'ifmr' must be in (0.5, 1], got {value}"
                )
        start = check_number("ifmr", "search_range_start", self.search_range_start)
        end = check_number("ifmr", "search_range_end", self.search_range_end)
        step = check_number("ifmr", "search_step", self.search_step)
        if not 0 < start <= end:
            raise ConfigError(
                f"ifmr needs 0 < search_range_start <= search_range_end, got {start} and {end}"
            )
        if step <= 0 or (end - start) / step > 100_000:
            raise ConfigError(
                f"calib option 'search_step' for method 'ifmr' must be > 0 and "
                f"give at most 100000 steps, got {step}"
            )
        check_bool_or_none("ifmr", "asymmetric", self.asymmetric)

    def factors(self) -> np.ndarray:
        """The clip factors start, start + step, ..., up to end (inclusive)."""
        count = int(
            np.floor((self.search_range_end - self.search_range_start) / self.search_step + 1e-9)
        )
        return self.search_range_start + self.search_step * np.arange(count + 1)


@register_observer("ifmr")
class IfmrObserver(HistogramObserver):
    """Symmetric search: a0 = max_percentile of |x|, candidates (-f a0, f a0).
    Asymmetric search: hi0 = max_percentile of x, lo0 = (1 - min_percentile) quantile,
    candidates (f lo0, f hi0). The factor f of least estimated MSE wins. The option
    `asymmetric` picks the search (None: follow spec.symmetric); a symmetric spec still
    gets its result symmetrised to (-a, a)."""

    options_class = IfmrOptions

    def _folded(self) -> bool:
        asym = self.options.asymmetric
        return bool(self.spec.symmetric) if asym is None else not asym

    def _range(self) -> tuple[float, float]:
        opts: IfmrOptions = self.options
        hist = self.hist
        f = opts.factors()
        if hist.symmetric:
            a0 = hist.percentile(100.0 * opts.max_percentile) or hist.max
            lo0, hi0 = -a0, a0
        else:
            hi0 = hist.percentile(100.0 * opts.max_percentile)
            lo0 = hist.percentile(100.0 * (1.0 - opts.min_percentile))
        if lo0 == hi0 == 0.0:
            return 0.0, 0.0
        model = HistogramErrorModel(hist)
        best_lo, best_hi, _ = best_range(
            model, lo0 * f, hi0 * f, self.spec.dtype, hist.symmetric, self.spec.scale_type
        )
        return best_lo, best_hi
