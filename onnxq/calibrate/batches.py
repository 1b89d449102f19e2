"""Calibration data streamed in validated batches (`iter_batches`): samples of a dynamic
batch merged up to the batch size, a model with a fixed batch fed one whole input at a
time; nothing is read ahead beyond one batch."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from onnxq.calibrate.inputs import (
    Feed,
    InputSpec,
    as_scalars,
    axes_of,
    check_feed,
    rows_of,
    sample_counts,
    sample_rows,
    take_rows,
    whole_feed,
)
from onnxq.calibrate.sources import CalibrationSource
from onnxq.errors import CalibrationDataError


def _concat(feeds: list[Feed], axes: dict[str, int]) -> Feed:
    return {k: np.concatenate([f[k] for f in feeds], axis=axes.get(k, 0)) if len(feeds) > 1 else feeds[0][k]
            for k in feeds[0]}


def _shape_key(feed: Feed, axes: dict[str, int]) -> tuple:
    """What must match for feeds to merge: every shape but its batch axis, and the types."""
    return tuple((k, v.shape[:axes.get(k, 0)] + v.shape[axes.get(k, 0) + 1:], v.dtype.str) for k, v in feed.items())


def _has_fixed_batch(inputs: list[InputSpec]) -> bool:
    """A fixed batch, or a scalar input (a Loop's trip count), which no batch can stack:
    each sample then runs on its own."""
    return any(s.batch_dim is not None or s.shape == () for s in inputs)


def _samples(feed: Feed, inputs: list[InputSpec], fixed: bool) -> Fraction:
    """Samples in a checked feed: rows of its first input over rows per sample.

    With a fixed batch every input must hold the same number of samples (rows may then
    arrive a part of a sample at a time); dynamic inputs may differ, as before.
    """
    counts = sample_counts(feed, inputs)
    if fixed and len(set(counts.values())) > 1:
        rows = {s.name: rows_of(feed[s.name], s.batch_axis) for s in inputs if np.ndim(feed.get(s.name))}
        raise CalibrationDataError(
            f"calibration sample has inputs with different sample counts (rows {rows}, rows per sample "
            f"{sample_rows(inputs)}); give every input the same number of samples"
        )
    return next(iter(counts.values()), Fraction(1))


def _take(feed: Feed, units: Mapping[str, int], samples: Fraction, axes: Mapping[str, int],
          start: Fraction = Fraction(0)) -> Feed:
    """Samples [start, start + samples) of every input of a checked feed."""
    return {k: take_rows(v, axes.get(k, 0), int(start * units[k]), int((start + samples) * units[k]))
            if np.ndim(v) else v for k, v in feed.items()}


def _short_of_one_sample(inputs: list[InputSpec], feed: Feed, units: Mapping[str, int]) -> CalibrationDataError:
    """The error for data that never fills one whole input of a fixed batch."""
    spec = next(s for s in inputs if s.shape and rows_of(feed[s.name], s.batch_axis) < units[s.name])
    rows = rows_of(feed[spec.name], spec.batch_axis)
    given = "[" + ",".join(str(d) for d in (1, *feed[spec.name].shape[1:])) + "]"
    whole = "[" + ",".join("?" if d is None else str(d) for d in spec.shape) + "]"
    return CalibrationDataError(
        f"calibration input {spec.name!r} has a fixed batch of {units[spec.name]} (expected {spec.describe()}), "
        f"but the data stops after {rows} row{'s' if rows != 1 else ''} of shape {given}; give whole {whole} "
        f"inputs (or a stack [N,{whole[1:]}), or export the model with a dynamic batch axis"
    )


def iter_batches(
    source: Any, inputs: list[InputSpec], batch_size: int, max_samples: int | None,
    purpose: str = "calibration", max_batches: int | None = None, kind: str = "calibration",
) -> Iterator[Feed]:
    """Validated batches of up to `batch_size` samples; one whole input with a fixed batch;
    at most `max_batches` of them.

    `max_samples` counts samples as `sample_rows` defines them, and a feed whose inputs
    share no batch axis (`inputs.whole_feed`) as one, run whole. A model with a fixed
    batch runs each whole input on its own; rows that fill no whole input are dropped, and
    data that fills none at all is an error naming the input and the shape it needs.
    `kind`: what the data is to the user, as errors call it ("calibration", "evaluation").
    """
    if not isinstance(source, CalibrationSource):
        source = CalibrationSource(source)
    replayable = source.replayable  # before the read: a reader read to its end is no empty data
    yielded = False
    try:
        for feed in _batches(source, inputs, batch_size, max_samples, purpose, max_batches):
            yielded = True
            yield as_scalars(feed, inputs)
    except CalibrationDataError as exc:
        if kind == "calibration":
            raise
        raise CalibrationDataError(re.sub(r"\bcalibration (input|sample|arrays|data)", rf"{kind} \1", str(exc))) from None
    if not yielded and kind != "calibration" and replayable:  # calibration says it its own way (`sources.empty_data`)
        raise CalibrationDataError(f"the {kind} data holds no sample; give at least one")


def _batches(
    source: Any, inputs: list[InputSpec], batch_size: int, max_samples: int | None,
    purpose: str, max_batches: int | None,
) -> Iterator[Feed]:
    if not isinstance(source, CalibrationSource):
        source = CalibrationSource(source)
    units = sample_rows(inputs)
    axes = axes_of(inputs)
    fixed = _has_fixed_batch(inputs)
    target = Fraction(1 if fixed else max(batch_size, 1))
    seen, batches, pending, pending_samples = Fraction(0), 0, [], Fraction(0)
    names = {spec.name for spec in inputs}
    for raw in source.feeds(inputs, purpose, 1 if fixed else max(batch_size, 1)):
        feed = check_feed(raw, inputs)
        source.ignored.update(set(raw) - names)
        if whole_feed(feed, inputs):  # one sample, neither cut nor merged (`inputs.whole_feed`)
            if pending and not fixed:
                yield _concat(pending, axes)
                batches += 1
                if batches == max_batches:
                    return
            pending, pending_samples = [], Fraction(0)
            if max_samples is not None and seen >= max_samples:
                break
            seen += 1
            source.whole += 1
            yield feed
            batches += 1
            if batches == max_batches:
                return
            continue
        if max_samples is not None:
            if max_samples - seen <= 0:
                break
            feed = _take(feed, units, min(_samples(feed, inputs, fixed), max_samples - seen), axes)
        samples = _samples(feed, inputs, fixed)
        if samples == 0:  # a feed of no rows (a reader's empty batch) adds nothing, and runs nothing
            continue
        seen += samples
        if pending and _shape_key(pending[0], axes) != _shape_key(feed, axes):
            if not fixed:  # a fixed-batch model cannot run a partial input: drop it
                yield _concat(pending, axes)
                batches += 1
                if batches == max_batches:
                    return
            pending, pending_samples = [], Fraction(0)
        pending.append(feed)
        pending_samples += samples
        while pending_samples >= target:
            merged = _concat(pending, axes)
            yield _take(merged, units, target, axes)
            batches += 1
            if batches == max_batches:
                return
            pending_samples -= target
            pending = [_take(merged, units, pending_samples, axes, target)] if pending_samples else []
        if max_samples is not None and seen >= max_samples:
            break
    if pending and not fixed:
        yield _concat(pending, axes)
    elif pending and not batches:
        raise _short_of_one_sample(inputs, _concat(pending, axes), units)
