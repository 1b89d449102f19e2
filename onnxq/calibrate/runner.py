"""Stage 2, calibrate: stream calibration batches through onnxruntime into observers.

One session exposes every tensor to calibrate; each batch updates one observer per
tensor and is then dropped, so memory does not grow with the number of samples.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.capture import CapturedOutputs
from onnxq.calibrate.data import axes_of, feed_rows, feed_samples, iter_batches, model_inputs
from onnxq.calibrate.observers import Observer, make_observer
from onnxq.calibrate.session import (
    REDUCED_SUFFIXES,
    calibration_options,
    exposed_session,
    profiled_largest,
    run_on_data,
)
from onnxq.calibrate.sources import CalibrationSource, empty_data
from onnxq.calibrate.statistics import Statistic, StatisticsSet
from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError
from onnxq.notes import counted
from onnxq.parallel import serial_blas
from onnxq.progress import bar as progress_bar

# A calibration batch's largest activation, at most: each reduction reads its image right
# after the Conv that wrote it, from cache where the batch's image fits. MobileNet-v1
# (largest activation 2.4 MB a sample), default int8 on 2 cores with VNNI: batch 1 1.61 s,
# 2 1.46 s and 349 MB, 3 1.53 s, 8 1.64 s and 469 MB. Small images are not run in bigger
# batches than `batch_size`: ResNet-20 (64 KB a sample) at 32 took 10% less time than at 8
# but peaked at 174 MB against 155 (onnxruntime's quantize_static: 160).
BATCH_IMAGE_BYTES = 6 << 20


# A calibration batch's largest activation, at most, where the inputs' own sizes are left
# to the data (images of any height and width): a bound on memory rather than the cache's,
# sized by onnxruntime's profiler on the first sample (`profiled_largest`). A VAE decoder
# with dynamic height and width, 64x64 latents (its attention's scores 64 MB a sample):
# batch 8 had peaked at 1.59 GB with min/max, 5.07 GB with entropy histograms (0.94 GB at
# batch 1), and `--max-calib-memory` did not bound it (generative-model trial). Inputs with
# one dynamic axis beside the batch (token windows) are not probed: the profiling session
# costs MiniLM 0.18 s of its 1.6 s quantize, and its windows' activations stay small.
DYNAMIC_BATCH_BYTES = 64 << 20


def calibration_batch(model: ir.Model, options: CalibrationConfig, data: Any = None) -> int:
    """Samples per calibration run: `options.batch_size`, fewer where one sample's largest
    activation of known size (every axis but the first) times the batch would pass
    `BATCH_IMAGE_BYTES`, or, for inputs of dynamic extent, the largest on the first
    sample of `data` would pass `DYNAMIC_BATCH_BYTES`; with `max_memory_mb`, either times
    the batch at most that. The same for every calibration pass and shard of a model,
    config and data; `batch_size` itself where `max_batches` counts batches of it (AMCT's
    batch_num), and for the passes that stream data themselves (GPTQ, AdaRound)."""
    if options.max_batches is not None:
        return options.batch_size
    largest = 0
    for node in model.graph:
        for value in node.outputs:
            dims = value.shape.dims[1:] if value.shape is not None and len(value.shape) > 1 else None
            if dims and value.dtype not in (None, ir.DataType.STRING, ir.DataType.UNDEFINED) and all(
                    isinstance(d, int) for d in dims):
                largest = max(largest, math.prod(dims) * int(value.dtype.itemsize))
    batch = max(1, min(options.batch_size, BATCH_IMAGE_BYTES // largest)) if largest else options.batch_size
    probed = _probed_largest(model, data, options.providers) if batch > 1 and _dynamic_extent(model) else 0
    if probed:
        batch = max(1, min(batch, DYNAMIC_BATCH_BYTES // probed))
    if options.max_memory_mb is not None and max(largest, probed):
        batch = max(1, min(batch, (options.max_memory_mb << 20) // max(largest, probed)))
    return batch


def _dynamic_extent(model: ir.Model) -> bool:
    """Whether an input has two or more dynamic axes beside its first (an image of any
    height and width), so that its activations' sizes are the data's."""
    return any(v.shape is not None and sum(not isinstance(d, int) for d in v.shape.dims[1:]) >= 2
               for v in model.graph.inputs)


def _probed_largest(model: ir.Model, data: Any, providers: list[str] | None) -> int:
    """The largest activation on the first sample of `data` (0 for data that cannot be
    read again: a one-shot reader is read once, by calibration)."""
    if data is None or not (data if isinstance(data, CalibrationSource) else CalibrationSource(data)).replayable:
        return 0
    first = next(iter(iter_batches(data, model_inputs(model), 1, 1, purpose="sizing calibration batches")), None)
    return 0 if first is None else profiled_largest(model, first, providers or ["CPUExecutionProvider"])


@dataclass
class CalibrationResult:
    """Calibrated range per tensor, and how much data produced it."""

    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    num_samples: int = 0
    num_batches: int = 0
    num_passes: int = 1
    statistics: dict[Statistic, np.ndarray | None] = field(default_factory=dict)  # collected alongside
    outputs: CapturedOutputs | None = None  # the model's own outputs on the first batches


def stream_tensors(
    model: ir.Model,
    names: list[str],
    data: Any,
    options: CalibrationConfig,
    progress: bool | None = None,
    purpose: str = "calibrating",
    reduced: Collection[str] = (),
    statistics: StatisticsSet | None = None,
    window: tuple[int, int] | None = None,
    capture: CapturedOutputs | None = None,
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Yield (samples, {tensor: value}) for each calibration batch; nothing is kept.

    Tensors in `reduced` arrive as [min, max] of the batch, computed inside onnxruntime.
    `statistics` are fed from the same batches (`calibrate/statistics.py`). `window`:
    only the batches whose position is in [first, end) run (a calibration shard).
    `capture` keeps the model's outputs on the first batches, as it asks.
    """
    inputs = model_inputs(model)
    axes = axes_of(inputs)
    batch = calibration_batch(model, options, data)  # before any node is added: what count_batches sees
    bar = progress_bar(desc=purpose, unit="sample", enabled=progress, total=options.max_samples)
    on_cpu = not options.providers or options.providers[0] == "CPUExecutionProvider"
    extra_nodes, extra_outputs, whole = statistics.attach(model, on_cpu) if statistics else ([], [], [])
    outputs = [n for n in names if n not in reduced]
    outputs += [n + suffix for n in names if n in reduced for suffix in REDUCED_SUFFIXES]
    outputs += [v.name for v in extra_outputs]
    # Tensors the statistics need whole that the calibration does not already return whole
    # (a tensor reduced to [min, max] for its observer is also returned whole).
    returned = {n for n in names if n not in reduced}
    exposed = list(dict.fromkeys([*names, *whole]))
    extra_whole = [n for n in whole if n in reduced]
    outputs += [n for n in whole if n not in returned]
    # BLAS on one thread: the statistics' small products run between onnxruntime's runs,
    # and OpenBLAS threads left spinning after them slowed its kernels 2x (MobileNet-v1).
    # Only where they run: finding the BLAS libraries costs 4 ms a process (ResNet-20).
    blas = serial_blas() if statistics is not None and statistics.uses_blas else contextlib.nullcontext()
    with exposed_session(model, exposed, options.providers, reduced, (extra_nodes, extra_outputs),
                         also_whole=extra_whole, options=calibration_options()) as session, bar, blas:
        for index, feed in enumerate(iter_batches(data, inputs, batch, options.max_samples, purpose,
                                                  options.max_batches)):
            if window is not None and index >= window[1]:
                break
            if window is not None and index < window[0]:
                continue
            rows, samples = feed_rows(feed, axes), feed_samples(feed, inputs)
            captured = capture.names if capture is not None and capture.wanting else []
            fetched = outputs + [n for n in captured if n not in outputs]
            got = dict(zip(fetched, run_on_data(session, fetched, feed)))
            if captured:
                capture.add(feed, [got[n] for n in captured], samples, rows,
                            cuttable=not any(axes.values()))
            if statistics is not None:
                statistics.update(got, index)
            for n in names:
                if n in reduced:
                    got[n] = np.array([got.pop(n + s) for s in REDUCED_SUFFIXES])
            yield samples, {n: got[n] for n in names}
            bar.update(samples)


def collect(
    model: ir.Model, stats: Collection[Statistic], data: Any, options: CalibrationConfig,
    progress: bool | None = None, purpose: str = "collecting statistics",
) -> dict[Statistic, np.ndarray | None]:
    """Answer statistics requests in one streaming pass over the data (`empty_data` where
    it gives no sample: a pass reading the statistics would find none)."""
    found = StatisticsSet(stats)
    batches = 0
    for _ in stream_tensors(model, [], data, options, progress, purpose, statistics=found):
        batches += 1
    if not batches:
        raise empty_data(data)
    return found.results()


def tensor_groups(model: ir.Model, names: list[str], data: Any, options: CalibrationConfig,
                  reduced: Collection[str] = ()) -> list[list[str]]:
    """Split `names` so one batch of each group's tensors fits `options.max_memory_mb`.

    Sizes are measured on one probe sample, so symbolic dimensions (sequence lengths) are
    real. The `reduced` tensors (min/max reduced inside the session) return two numbers
    each and cost nothing here: they all go in the first group (counted at full size, a
    2.4 GB encoder's bound of 64 MB made more than 100 passes where one held everything,
    big-model trial). Without a bound, everything is calibrated in one pass.
    """
    if options.max_memory_mb is None or not names:
        return [names]
    free = [n for n in names if n in reduced]
    names = [n for n in names if n not in reduced]
    if not names:
        return [free]
    limit = options.max_memory_mb * 2**20
    probe = replace(options, max_samples=1, batch_size=1)
    batches = stream_tensors(model, names, data, probe, progress=False, purpose="sizing calibration")
    try:
        _, values = next(batches)
    except StopIteration:
        raise empty_data(data) from None
    finally:
        batches.close()
    groups: list[list[str]] = [free]
    used = 0
    batch = calibration_batch(model, options, data)
    for name in names:
        size = values[name].nbytes * batch
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups


@dataclass
class CalibrationState:
    """What calibration has seen so far: an observer per tensor and the requested
    statistics. Two states of consecutive stretches of the data merge exactly
    (`calibrate/shards.py`), so calibration can be split over processes or machines."""

    observers: dict[str, Observer]
    statistics: StatisticsSet | None
    num_samples: int = 0
    num_batches: int = 0
    num_passes: int = 1
    outputs: CapturedOutputs | None = None  # the model's outputs on the first batches (never merged)

    def merge(self, other: CalibrationState) -> None:
        """Fold in the state of the batches that come after this one's."""
        for name, observer in self.observers.items():
            observer.merge(other.observers[name])
        if self.statistics is not None and other.statistics is not None:
            self.statistics.merge(other.statistics)
        self.num_samples += other.num_samples
        self.num_batches += other.num_batches

    def result(self) -> CalibrationResult:
        """The ranges and statistics; empty when nothing was asked of the data."""
        if not self.observers and self.statistics is None:
            return CalibrationResult()
        if self.num_batches == 0:
            raise empty_data(None)
        if self.observers and all(o.num_values == 0 for o in self.observers.values()):
            raise CalibrationDataError(
                f"calibration ran {counted(self.num_samples, 'sample')} but saw no value in any of the {len(self.observers)} "
                "tensors it observes: the samples are empty (a zero-length axis, such as a time axis of 0 frames); "
                "give samples that hold data")
        return CalibrationResult(
            {name: obs.compute_range() for name, obs in self.observers.items()}, self.num_samples,
            self.num_batches, self.num_passes, self.statistics.results() if self.statistics is not None else {},
            self.outputs)


def observe(
    model: ir.Model,
    tensors: dict[str, ResolvedSpec],
    data: Any,
    options: CalibrationConfig,
    progress: bool | None = None,
    statistics: Collection[Statistic] = (),
    window: tuple[int, int] | None = None,
    capture: tuple[list[str], int] | None = None,
) -> CalibrationState:
    """Stream the calibration data (the batches in `window`, default all) into an observer
    per tensor and the requested statistics; `.result()` gives the ranges. `capture`
    (output names, samples): also keep the model's outputs on the first batches
    (`CapturedOutputs`).

    Tensors are observed in one pass, or in groups over several passes when
    `options.max_memory_mb` bounds the activations held per batch; statistics are
    collected in the first pass.
    """
    state = CalibrationState({name: make_observer(spec) for name, spec in tensors.items()},
                             StatisticsSet(statistics) if statistics else None)
    if not tensors and not statistics:
        return state
    captured = CapturedOutputs(*capture) if capture is not None and capture[0] and capture[1] > 0 else None
    groups = tensor_groups(model, list(state.observers), data, options,
                           {n for n, observer in state.observers.items() if observer.min_max_only})
    for index, group in enumerate(groups):
        purpose = "calibrating" if len(groups) == 1 else f"calibrating {index + 1}/{len(groups)}"
        reduced = {n for n in group if state.observers[n].min_max_only}
        stats = state.statistics if index == 0 else None
        keep = captured if index == 0 else None
        for samples, values in stream_tensors(model, group, data, options, progress, purpose, reduced, stats, window,
                                              keep):
            for name, value in values.items():
                state.observers[name].update(np.asarray(value))
            if index == 0:
                state.num_samples += samples
                state.num_batches += 1
    if state.num_batches == 0 and window is None:
        raise empty_data(data)
    state.num_passes = len(groups)
    if captured is not None:
        stopped = window is not None or (options.max_samples is not None and state.num_samples >= options.max_samples) \
            or (options.max_batches is not None and state.num_batches >= options.max_batches)
        captured.finish(state.num_samples, exhausted=not stopped)
    state.outputs = captured
    return state

