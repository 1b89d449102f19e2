"""`hfmg` (as in Huawei AMCT): histogram range search that greedily trims sparse ends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.calibrate.observers.base import HistogramObserver
from onnxq.calibrate.observers.options import check_bool_or_none
from onnxq.calibrate.observers.qerror import HistogramErrorModel, range_errors
from onnxq.calibrate.observers.registry import register_observer
from onnxq.errors import ConfigError

VALID_BINS = (1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class HfmgOptions:
    """Options of `hfmg`: histogram bin count (overrides spec.num_bins) and search mode."""

    num_of_bins: int = 4096
    asymmetric: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_of_bins, bool) or self.num_of_bins not in VALID_BINS:
            raise ConfigError(
                f"calib option 'num_of_bins' for method 'hfmg' must be one of "
                f"{', '.join(map(str, VALID_BINS))}, got {self.num_of_bins!r}"
            )
        check_bool_or_none("hfmg", "asymmetric", self.asymmetric)


def trim_path(
    counts: np.ndarray, edges: np.ndarray, start: int, end: int, two_sided: bool
) -> np.ndarray:
    """Bin windows [start, end] visited when trimming one bin at a time.

    Two-sided: trim the end whose trimmed tail (so far plus its next bin) would hold
    fewer values, so the tails lose mass in balance; on a tie, the end farther from 0.
    One-sided: trim from the top only. Returns (start, end) rows, untrimmed first.
    """
    c = counts.tolist()
    e = edges.tolist()
    path = [(start, end)]
    cut_lo = cut_hi = 0
    while start < end:
        take_lo, take_hi = cut_lo + c[start], cut_hi + c[end]
        if two_sided and (take_lo < take_hi or (take_lo == take_hi and -e[start] > e[end + 1])):
            start, cut_lo = start + 1, take_lo
        else:
            end, cut_hi = end - 1, take_hi
        path.append((start, end))
    return np.array(path, dtype=np.int64)


@register_observer("hfmg")
class HfmgObserver(HistogramObserver):
    """Trims the histogram's ends one bin at a time, keeping the trimmed tail masses in
    balance (in the spirit of PyTorch's HistogramObserver), and returns the window of
    least estimated quantization error along that path. Unlike PyTorch it does not stop
    at the first rise: zero-point and power-of-two scale rounding make the error curve
    bumpy, so the whole path (at most num_of_bins windows, scored in one vector
    operation) is searched. Symmetric search trims |x| from the top only. The option
    `asymmetric` picks the search (None: follow spec.symmetric)."""

    options_class = HfmgOptions
    spec_fields = ()  # its bin count is the option num_of_bins

    def _num_bins(self) -> int:
        return int(self.options.num_of_bins)

    def _folded(self) -> bool:
        asym = self.options.asymmetric
        return bool(self.spec.symmetric) if asym is None else not asym

    def _range(self) -> tuple[float, float]:
        hist = self.hist
        nz = np.flatnonzero(hist.counts)
        first, last = int(nz[0]), int(nz[-1])
        if hist.symmetric:
            first = 0
        edges = hist.edges()
        path = trim_path(hist.counts, edges, first, last, two_sided=not hist.symmetric)
        lo = np.maximum(edges[path[:, 0]], hist.min)
        hi = np.minimum(edges[path[:, 1] + 1], hist.max)
        if hist.symmetric:
            lo = -hi
        err = range_errors(
            HistogramErrorModel(hist), lo, hi, self.spec.dtype, hist.symmetric, self.spec.scale_type
        )
        i = int(np.argmin(err))
        return float(lo[i]), float(hi[i])
