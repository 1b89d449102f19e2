"""`minmax`: the running minimum and maximum of the data."""

from __future__ import annotations

import numpy as np

from onnxq.calibrate.observers.base import Observer
from onnxq.calibrate.observers.histogram import finite_values
from onnxq.calibrate.observers.registry import register_observer
from onnxq.config.resolve import ResolvedSpec


@register_observer("minmax")
class MinMaxObserver(Observer):
    """Range = [min, max] of all finite values; symmetric specs get (-absmax, absmax)."""

    integer_only = False
    min_max_only = True

    def __init__(self, spec: ResolvedSpec) -> None:
        super().__init__(spec)
        self.min = np.inf
        self.max = -np.inf
        self._count = 0

    def update(self, x: np.ndarray) -> None:
        flat = finite_values(x)
        if flat.size:
            self.min = min(self.min, float(flat.min()))
            self.max = max(self.max, float(flat.max()))
            self._count += flat.size

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, MinMaxObserver)
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self._count += other._count

    @property
    def num_values(self) -> int:
        return self._count

    def state(self) -> dict[str, np.ndarray]:
        return {"range": np.array([self.min, self.max], np.float64), "count": np.int64(self._count)}

    def set_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.min, self.max = (float(v) for v in arrays["range"])
        self._count = int(arrays["count"])

    def compute_range(self) -> tuple[float, float]:
        if self._count == 0:
            return 0.0, 0.0
        if self.spec.symmetric:
            a = max(abs(self.min), abs(self.max))
            return -a, a
        return self.min, self.max
