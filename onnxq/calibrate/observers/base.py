"""The observer interface: one observer per calibrated tensor, fed batch by batch."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from onnxq.calibrate.observers.histogram import StreamingHistogram
from onnxq.calibrate.observers.options import parse_options
from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType
from onnxq.errors import ConfigError
from onnxq.numerics import qmath


class Observer(abc.ABC):
    """Collects statistics of one tensor and turns them into a calibration range.

    State is O(num_bins) whatever the amount of data; `update` never keeps its input.
    Non-finite values are ignored. Subclasses set `name` (via `register_observer`) and
    `options_class` (a frozen dataclass of method options, or None).
    """

    name: ClassVar[str] = ""
    options_class: ClassVar[type | None] = None
    # Methods that search an integer grid cannot calibrate float8 targets.
    integer_only: ClassVar[bool] = True
    # Observers that only need each batch's min and max: the calibration session then
    # computes those inside onnxruntime instead of returning whole tensors, and such an
    # observer sees [bound, max] for a tensor bounded below by a bound >= 0 (a Relu's
    # output: `session.lower_bound`), as two values.
    min_max_only: ClassVar[bool] = False
    # Spec fields (percentile, num_bins) the method reads; setting another beside it is
    # a config error, not a silently ignored value.
    spec_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ResolvedSpec) -> None:
        self.spec = spec
        self.info = qmath.INT_TYPES.get(DType(spec.dtype))
        if self.info is None and self.integer_only:
            raise ConfigError(
                f"calib_method {self.name!r} searches an integer grid and cannot calibrate "
                f"{spec.dtype}; use minmax or percentile"
            )
        self.options: Any = parse_options(self.options_class, self.name, spec.calib_options)

    @abc.abstractmethod
    def update(self, x: np.ndarray) -> None:
        """Fold one batch of the tensor (any shape) into the statistics."""

    @abc.abstractmethod
    def compute_range(self) -> tuple[float, float]:
        """The calibrated (rmin, rmax); (-a, a) for symmetric specs; (0, 0) if no data."""

    @abc.abstractmethod
    def _merge(self, other: Observer) -> None:
        """Fold the statistics of `other` (same class, already checked) into self."""

    @property
    @abc.abstractmethod
    def num_values(self) -> int:
        """Number of finite values seen so far."""

    def state(self) -> dict[str, np.ndarray]:
        """The statistics as arrays; `set_state` restores them exactly (stats files).
        Observers registered without them calibrate in one run only."""
        raise ConfigError(f"calib_method {self.name!r} cannot save its statistics for calibration shards "
                          "(its observer has no state()/set_state()); calibrate in one run, without --shard or "
                          "--shards, or give the observer those two methods")

    def set_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the statistics with those `state` returned."""
        self.state()

    def merge(self, other: Observer) -> None:
        """Fold another observer of the same tensor and class into self, exactly."""
        if type(other) is not type(self) or other.spec != self.spec:
            raise TypeError(
                f"cannot merge a {type(other).__name__} into a {type(self).__name__} "
                "with a different spec"
            )
        self._merge(other)


class HistogramObserver(Observer):
    spec_fields = ("num_bins",)
    """An observer whose state is one `StreamingHistogram` plus the signed data range."""

    def __init__(self, spec: ResolvedSpec) -> None:
        super().__init__(spec)
        self.hist = StreamingHistogram(self._num_bins(), symmetric=self._folded())
        self.data_min = np.inf
        self.data_max = -np.inf

    def _num_bins(self) -> int:
        """Bin count of the histogram; spec.num_bins unless the method says otherwise."""
        if int(self.spec.num_bins) < 2:
            raise ConfigError(f"num_bins must be at least 2, got {self.spec.num_bins}")
        return int(self.spec.num_bins)

    def _folded(self) -> bool:
        """True to histogram |x| (symmetric search), False for signed x."""
        return bool(self.spec.symmetric)

    def update(self, x: np.ndarray) -> None:
        seen = self.hist.update(x)
        if seen is not None:
            self.data_min = min(self.data_min, seen[0])
            self.data_max = max(self.data_max, seen[1])

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, HistogramObserver)
        self.hist.merge(other.hist)
        self.data_min = min(self.data_min, other.data_min)
        self.data_max = max(self.data_max, other.data_max)

    @property
    def num_values(self) -> int:
        return self.hist.total

    def state(self) -> dict[str, np.ndarray]:
        return {**self.hist.state(), "data_range": np.array([self.data_min, self.data_max], np.float64)}

    def set_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.hist.set_state(arrays)
        self.data_min, self.data_max = (float(v) for v in arrays["data_range"])

    def compute_range(self) -> tuple[float, float]:
        if self.hist.is_empty:
            return 0.0, 0.0
        rmin, rmax = self._range()
        if self.spec.symmetric:
            a = max(-rmin, rmax, 0.0)
            return -a, a
        return float(rmin), float(rmax)

    @abc.abstractmethod
    def _range(self) -> tuple[float, float]:
        """The range from a non-empty histogram (symmetrised by `compute_range` if needed)."""
