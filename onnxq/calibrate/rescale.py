"""Calibrate while a deferred pass waits for its statistics (`optimize.Deferred`).

SmoothQuant reads channel maxima of the model before it scales anything, and then
scales some tensors per channel: x becomes x * f (f > 0 along one axis). Calibrating
after it would cost a second pass over the data; instead, one pass collects the ranges
of every other tensor, the pass's own statistics, and the per-channel min and max of
each tensor it may scale. Rounding is monotonic, so in the tensor's float type
min(x * f) over a channel is exactly min(x) * f: a MinMax range of the scaled tensor
is [min_c min_c(x) f_c, max_c max_c(x) f_c], with no data read again. Requested
statistics of a scaled tensor (means along its channel axis) are scaled the same way.
Observers that need the values themselves (histograms) get one more pass over just
those tensors, as they would without deferral.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.observers import make_observer, observer_class
from onnxq.calibrate.runner import CalibrationResult, observe
from onnxq.calibrate.statistics import Statistic
from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import CalibrationConfig
from onnxq.graph.edit import values_by_name

# tensor -> (channel axis, factor): how a deferred pass scaled it.
Rescales = Mapping[str, tuple[int, np.ndarray]]
Finish = Callable[[Mapping[Statistic, np.ndarray | None]], Rescales]


def rescale_statistics(
    stats: Mapping[Statistic, np.ndarray | None], rescales: Rescales, ranks: Mapping[str, int | None]
) -> dict[Statistic, np.ndarray | None]:
    """`stats` of the tensors as scaled. A statistic that cannot follow its tensor's
    scaling (reduced along another axis) is dropped, so whoever needs it collects it."""
    out: dict[Statistic, np.ndarray | None] = {}
    for stat, value in stats.items():
        if stat.tensor not in rescales or value is None:
            out[stat] = value
            continue
        axis, factor = rescales[stat.tensor]
        rank = ranks.get(stat.tensor)
        if rank is not None and axis >= 0:
            axis -= rank
        if rank is None or stat.axis % rank != axis % rank:
            continue
        if stat.reduce == "windows" and value.shape[0] == factor.shape[0]:
            out[stat] = value * factor[:, None]
        elif value.shape == factor.shape:
            out[stat] = value * factor
    return out


def _scaled_range(spec: ResolvedSpec, lo: np.ndarray | None, hi: np.ndarray | None, factor: np.ndarray | None,
                  dtype: np.dtype) -> tuple[float, float] | None:
    """The MinMax range of the scaled tensor from its per-channel extremes, or None when
    they are missing or not finite (the observer then sees the values)."""
    if lo is None or hi is None or not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        return None
    f = np.ones(lo.shape, dtype) if factor is None else np.asarray(factor).astype(dtype)
    if f.shape != lo.shape:
        return None
    observer = make_observer(spec)
    observer.update(np.concatenate([lo.astype(dtype) * f, hi.astype(dtype) * f]))
    return observer.compute_range()


def calibrate_deferred(
    model: ir.Model,
    tensors: dict[str, ResolvedSpec],
    data: Any,
    options: CalibrationConfig,
    progress: bool | None,
    statistics: Collection[Statistic],
    rescalable: Mapping[str, int],
    finish: Finish,
) -> CalibrationResult:
    """Calibrate `tensors` and collect `statistics` in one pass, run `finish` on them (it
    rewrites `model` and says what it scaled), and settle the scaled tensors (module doc)."""
    held = {n: tensors[n] for n in rescalable if n in tensors}
    extremes = {n: (Statistic(n, "min", rescalable[n]), Statistic(n, "max", rescalable[n]))
                for n, spec in held.items() if observer_class(spec.calib_method).min_max_only}
    internal = [s for pair in extremes.values() for s in pair if s not in statistics]
    rest = {n: spec for n, spec in tensors.items() if n not in held}
    result = observe(model, rest, data, options, progress, [*statistics, *internal]).result()
    found = result.statistics
    rescales = finish(found)
    values = values_by_name(model.graph)
    ranges: dict[str, tuple[float, float]] = {}
    for name, (lo, hi) in extremes.items():
        value = values.get(name)
        dtype = value.dtype.numpy() if value is not None and value.dtype is not None else np.float32
        factor = rescales[name][1] if name in rescales else None  # None: not scaled after all
        scaled = _scaled_range(held[name], found[lo], found[hi], factor, dtype)
        if scaled is not None:
            ranges[name] = scaled
    again = {n: spec for n, spec in held.items() if n not in ranges}
    if again:
        second = observe(model, again, data, options, progress).result()
        ranges.update(second.ranges)
        result.num_passes += second.num_passes
    result.ranges = {name: result.ranges[name] if name in result.ranges else ranges[name] for name in tensors}
    ranks = {n: len(v.shape) if v.shape is not None else None for n, v in values.items()}
    kept = {s: v for s, v in found.items() if s not in internal}
    result.statistics = rescale_statistics(kept, rescales, ranks)
    return result
