"""Calibration observers: one per calib method, looked up by name.

Each module registers its observer class with `@register_observer("name")`; the
pipeline calls `make_observer(spec)` for every tensor to calibrate.
"""

from onnxq.calibrate.observers import (  # noqa: F401  (imported to register)
    entropy,
    hfmg,
    ifmr,
    minmax,
    minmse,
    nonoverflow,
    percentile,
)
from onnxq.calibrate.observers.base import HistogramObserver, Observer
from onnxq.calibrate.observers.histogram import StreamingHistogram
from onnxq.calibrate.observers.registry import (
    OBSERVERS,
    make_observer,
    observer_class,
    observer_options,
    register_observer,
)

__all__ = [
    "OBSERVERS",
    "HistogramObserver",
    "Observer",
    "StreamingHistogram",
    "make_observer",
    "observer_class",
    "observer_options",
    "register_observer",
]
