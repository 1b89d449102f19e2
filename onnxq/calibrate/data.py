"""Calibration data sources, checked against the model's inputs and streamed in batches.

Accepted sources: a directory of .npy/.npz files, one .npz (arrays keyed by input name,
samples on axis 0), one .npy (single-input models), a mapping of input name to array,
any iterable of feed dicts, and onnxruntime's `CalibrationDataReader` protocol (an
object with `get_next()`). Nothing is read ahead beyond one batch.

Arrays hold rows on the model's axis 0. For an input with a fixed batch B (such as
[1,3,32,32], or [3,32,32] whose first axis is not a batch at all) one sample is one whole
input of B rows: an array of exactly the input's shape is one sample, a stack of N of them
(shape [N, *input shape]) is N samples, and B rows given one by one make one sample.
"""

from __future__ import annotations

import math
import os
import re
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.errors import CalibrationDataError

Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (ints for static dims, None otherwise)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...] | None
    kind: str = "tensor"  # or "sequence", "optional": dtype and shape are then the element's

    @property
    def batch_dynamic(self) -> bool:
        return self.shape is not None and len(self.shape) > 0 and self.shape[0] is None

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` has this input's rank and static dimensions."""
        return self.shape is not None and len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape)
        )

    def describe(self) -> str:
        dims = "?" if self.shape is None else "[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"
        return f"{self.dtype} {dims}"


def model_inputs(model: ir.Model) -> list[InputSpec]:
    """The non-initializer graph inputs the calibration data must provide."""
    specs = []
    for value in model.graph.inputs:
        shape = None
        if value.shape is not None:
            shape = tuple(d if isinstance(d, int) else None for d in value.shape)
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        specs.append(InputSpec(value.name, dtype, shape, _kind(value.type)))
    return specs


def _kind(value_type: ir.TypeProtocol | None) -> str:
    if isinstance(value_type, ir.SequenceType):
        return "sequence"
    if isinstance(value_type, ir.OptionalType):
        return "optional"
    return "tensor"


def _from_reader(reader: Any) -> Iterator[Mapping[str, Any]]:
    while (item := reader.get_next()) is not None:
        yield item


def _split_rows(arrays: Mapping[str, np.ndarray], inputs: list[InputSpec]) -> Iterator[Feed]:
    """Yield one sample at a time from arrays that hold samples on axis 0.

    A sample is one row, or for an input with a fixed batch B its B rows; a last part
    that fills no whole sample is still yielded, for iter_batches to drop or report.
    """
    units = sample_rows(inputs)
    counts = {name: Fraction(len(a), units.get(name, 1)) for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        shown = {name: str(n) for name, n in counts.items()}
        raise CalibrationDataError(
            f"calibration arrays have different sample counts {shown}; give each input the same number of samples"
        )
    n = math.ceil(next(iter(counts.values()), 0))
    for i in range(n):
        yield {name: a[i * units.get(name, 1) : (i + 1) * units.get(name, 1)] for name, a in arrays.items()}


def _read_file(path: Path, inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Arrays of one .npz (keyed by input name) or .npy (single-input models) file."""
    if path.suffix == ".npy" and len(inputs) != 1:
        raise CalibrationDataError(
            f"{path.name}: .npy files only work for single-input models; use .npz keyed by input name "
            f"({', '.join(s.name for s in inputs)})"
        )
    if path.suffix not in (".npy", ".npz"):
        raise CalibrationDataError(f"unsupported calibration file {path.name}; use .npz, .npy or a directory of them")
    magic = {".npy": b"\x93NUMPY", ".npz": b"PK"}[path.suffix]
    try:
        with open(path, "rb") as f:
            if f.read(len(magic)) != magic:
                raise CalibrationDataError(
                    f"cannot read calibration file {path}: it is not a numpy {path.suffix} file; write it with "
                    f"numpy.{'save' if path.suffix == '.npy' else 'savez'}")
        if path.suffix == ".npy":
            return {inputs[0].name: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CalibrationDataError(
            f"cannot read calibration file {path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            "; check that it is a complete .npy/.npz written by numpy"
        ) from None


def _from_path(path: Path, inputs: list[InputSpec]) -> Iterator[Mapping[str, Any]]:
    if not path.exists():
        raise CalibrationDataError(f"calibration data not found: {path}; pass a .npz/.npy file or a directory of them")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz"))
        if not files:
            raise CalibrationDataError(f"no .npy or .npz files in {path}; save one sample or batch per file")
        for f in files:
            yield _checked_file(f, _read_file(f, inputs), inputs)
        return
    arrays = _checked_file(path, _read_file(path, inputs), inputs)
    yield from _split_rows(_arrays_to_rows(arrays, inputs), inputs)


def _checked_file(path: Path, arrays: dict[str, np.ndarray], inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """`arrays` of file `path`, their type, shape and values checked as a whole, so that an
    error names the file and its arrays' shapes (not one sample's) and counts every NaN."""
    specs = {s.name: s for s in inputs}
    try:
        for name, array in arrays.items():
            if name in specs:
                _check_finite(specs[name], _check_array(specs[name], np.asarray(array)))
    except CalibrationDataError as exc:
        raise CalibrationDataError(f"{path.name}: {exc}") from None
    return arrays


def _to_rows(spec: InputSpec | None, array: np.ndarray) -> np.ndarray:
    """`array` with its rows on the model's axis 0.

    A lone sample without the batch axis gains it; a stack of N whole inputs of a fixed
    batch B (shape [N, B, ...]) becomes its N*B rows, every B of which make one input again.
    """
    if spec is None or spec.shape is None or not spec.shape:
        return array
    if array.ndim == len(spec.shape) - 1 and (
            spec.fits((spec.shape[0] or 1, *array.shape)) or spec.shape[1] in (None, array.shape[0])):
        return array[None]  # one sample (the later check names a wrong size)
    if array.ndim == len(spec.shape) + 1 and spec.shape[0] is not None and spec.fits(array.shape[1:]):
        return array.reshape(-1, *array.shape[2:])
    return array


def _arrays_to_rows(arrays: Mapping[str, Any], inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    specs = {s.name: s for s in inputs}
    return {k: _to_rows(specs.get(k), np.asarray(v)) for k, v in arrays.items()}


def raw_feeds(source: Any, inputs: list[InputSpec]) -> Iterator[Mapping[str, Any]]:
    """Turn any accepted source into an iterator of (unchecked) feed dicts."""
    if source is None:
        raise CalibrationDataError("static quantization needs calibration data; pass --calib-data PATH")
    if isinstance(source, str | os.PathLike):
        return _from_path(Path(source), inputs)
    if hasattr(source, "get_next"):
        return _from_reader(source)
    if isinstance(source, Mapping):
        return _split_rows(_arrays_to_rows(source, inputs), inputs)
    if isinstance(source, Iterable):
        return iter(source)
    raise CalibrationDataError(
        f"unsupported calibration data of type {type(source).__name__}; pass a path, a dict of arrays, "
        "an iterable of feed dicts or an object with get_next()"
    )


class CalibrationSource:
    """Calibration data that may be read several times (calibration, then algorithms).

    Paths, dicts of arrays and sequences can be re-read; a reader with `rewind()` is
    rewound; a one-shot iterator or reader can be read once, and a second read is a
    clear error rather than silently empty data.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self.reads = 0
        # Arrays in the data that are no model input (a `labels` array): left out, named
        # in the summary.
        self.ignored: set[str] = set()

    @property
    def replayable(self) -> bool:
        s = self.source
        return isinstance(s, str | os.PathLike | Mapping | list | tuple) or hasattr(s, "rewind")

    def feeds(self, inputs: list[InputSpec], purpose: str = "calibration") -> Iterator[Mapping[str, Any]]:
        if self.reads and not self.replayable:
            raise CalibrationDataError(
                f"{purpose} needs another pass over the calibration data, but a "
                f"{type(self.source).__name__} can be read only once; pass a path, a dict of arrays or a list of feeds"
            )
        if self.reads and hasattr(self.source, "rewind"):
            self.source.rewind()
        self.reads += 1
        return raw_feeds(self.source, inputs)


def check_feed(feed: Mapping[str, Any], inputs: list[InputSpec]) -> Feed:
    """Validate one feed against the model inputs; returns arrays with a batch axis (arrays
    that are no model input are left out)."""
    if not isinstance(feed, Mapping):
        raise CalibrationDataError(
            f"calibration sample is a {type(feed).__name__}, expected a dict of input name -> array"
        )
    out: Feed = {}
    for spec in inputs:
        if spec.kind != "tensor":
            raise CalibrationDataError(
                f"model input {spec.name!r} is a {spec.kind}, but calibration feeds only tensor inputs; "
                "export the model with tensor inputs, or use a preset that needs no data (W8_DYNAMIC)"
            )
        if spec.name not in feed:
            raise CalibrationDataError(
                f"calibration data is missing input {spec.name!r} (expected {spec.describe()}); "
                + _given(feed, inputs)
            )
        out[spec.name] = _check_array(spec, np.asarray(feed[spec.name]))
        _check_finite(spec, out[spec.name])
    return out


def _given(feed: Mapping[str, Any], inputs: list[InputSpec]) -> str:
    names = {spec.name for spec in inputs}
    extra = [repr(k) for k in sorted(feed) if k not in names]
    if not feed:
        return "given: nothing"
    if not extra:
        return f"given: {', '.join(repr(k) for k in sorted(feed))}"
    return f"it has {', '.join(extra)}, which {'is not a model input' if len(extra) == 1 else 'are no model inputs'}"


def _check_finite(spec: InputSpec, array: np.ndarray) -> None:
    """NaN or infinity in a float input would be calibrated around silently (observers
    skip non-finite values) while the model's outputs on it are garbage."""
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return
    nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
    raise CalibrationDataError(
        f"calibration input {spec.name!r} holds {nan} NaN and {inf} infinite values; "
        "replace them or drop those samples from the calibration data"
    )


def _check_array(spec: InputSpec, array: np.ndarray) -> np.ndarray:
    if array.dtype != spec.dtype:
        if array.dtype.kind == spec.dtype.kind or {array.dtype.kind, spec.dtype.kind} <= {"i", "u"}:
            array = array.astype(spec.dtype)
        else:
            raise CalibrationDataError(
                f"calibration input {spec.name!r} has dtype {array.dtype}, expected {spec.describe()}; "
                f"convert it with .astype({spec.dtype.name})"
            )
    if spec.shape is None:
        return array
    array = _to_rows(spec, array)
    if array.ndim != len(spec.shape):
        dims = ["?" if d is None else str(d) for d in spec.shape[1:]]
        off = len(spec.shape) - array.ndim
        off_by = f"{abs(off)} ax{'i' if abs(off) == 1 else 'e'}s {'missing' if off > 0 else 'too many'}"
        raise CalibrationDataError(
            f"calibration input {spec.name!r} has rank {array.ndim} (each sample {list(array.shape[1:])}), the "
            f"model's input rank {len(spec.shape)} ({spec.describe()}): {off_by}; give arrays "
            f"[{', '.join(['samples', *dims])}]"
        )
    for axis, (want, got) in enumerate(zip(spec.shape, array.shape)):
        if want is not None and axis > 0 and want != got:
            raise CalibrationDataError(
                f"calibration input {spec.name!r} has shape {list(array.shape)}, expected {spec.describe()} "
                f"(axis {axis} must be {want})"
            )
    return array


def _concat(feeds: list[Feed]) -> Feed:
    return {k: np.concatenate([f[k] for f in feeds]) if len(feeds) > 1 else feeds[0][k] for k in feeds[0]}


def _shape_key(feed: Feed) -> tuple:
    return tuple((k, v.shape[1:], v.dtype.str) for k, v in feed.items())


def _fixed_batch(inputs: list[InputSpec]) -> int | None:
    """The static batch size of the model, or None when the batch axis is dynamic."""
    sizes = {s.shape[0] for s in inputs if s.shape}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def _has_fixed_batch(inputs: list[InputSpec]) -> bool:
    return any(s.shape and s.shape[0] is not None for s in inputs)


def sample_rows(inputs: list[InputSpec]) -> dict[str, int]:
    """Rows (along axis 0) of each input that make one sample.

    An input's static first dimension, else the model's fixed batch when it has one,
    else 1: a sample of a fixed-shape input is one whole input.
    """
    common = _fixed_batch(inputs) or 1
    return {s.name: s.shape[0] if s.shape and s.shape[0] is not None else common for s in inputs}


def _samples(feed: Feed, units: Mapping[str, int], fixed: bool) -> Fraction:
    """Samples in a checked feed: rows of its first input over rows per sample.

    With a fixed batch every input must hold the same number of samples (rows may then
    arrive a part of a sample at a time); dynamic inputs may differ, as before.
    """
    counts = {name: Fraction(len(v), units[name]) for name, v in feed.items() if np.ndim(v)}
    if fixed and len(set(counts.values())) > 1:
        rows = {name: len(v) for name, v in feed.items() if np.ndim(v)}
        raise CalibrationDataError(
            f"calibration sample has inputs with different sample counts (rows {rows}, rows per sample "
            f"{dict(units)}); give every input the same number of samples"
        )
    return next(iter(counts.values()), Fraction(1))


def _take(feed: Feed, units: Mapping[str, int], samples: Fraction, start: Fraction = Fraction(0)) -> Feed:
    """Samples [start, start + samples) of every input of a checked feed."""
    return {k: v[int(start * units[k]) : int((start + samples) * units[k])] for k, v in feed.items()}


def _short_of_one_sample(inputs: list[InputSpec], feed: Feed, units: Mapping[str, int]) -> CalibrationDataError:
    """The error for data that never fills one whole input of a fixed batch."""
    spec = next(s for s in inputs if s.shape and len(feed[s.name]) < units[s.name])
    rows = len(feed[spec.name])
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

    `max_samples` counts samples as `sample_rows` defines them. A model with a fixed
    batch runs each whole input on its own; rows that fill no whole input are dropped, and
    data that fills none at all is an error naming the input and the shape it needs.
    `kind`: what the data is to the user, as errors call it ("calibration", "evaluation").
    """
    try:
        yield from _batches(source, inputs, batch_size, max_samples, purpose, max_batches)
    except CalibrationDataError as exc:
        if kind == "calibration":
            raise
        raise CalibrationDataError(re.sub(r"\bcalibration (input|sample|arrays)", rf"{kind} \1", str(exc))) from None


def _batches(
    source: Any, inputs: list[InputSpec], batch_size: int, max_samples: int | None,
    purpose: str, max_batches: int | None,
) -> Iterator[Feed]:
    if not isinstance(source, CalibrationSource):
        source = CalibrationSource(source)
    units = sample_rows(inputs)
    fixed = _has_fixed_batch(inputs)
    target = Fraction(1 if fixed else max(batch_size, 1))
    seen, batches, pending, pending_samples = Fraction(0), 0, [], Fraction(0)
    names = {spec.name for spec in inputs}
    for raw in source.feeds(inputs, purpose):
        feed = check_feed(raw, inputs)
        source.ignored.update(set(raw) - names)
        if max_samples is not None:
            if max_samples - seen <= 0:
                break
            feed = _take(feed, units, min(_samples(feed, units, fixed), max_samples - seen))
        samples = _samples(feed, units, fixed)
        seen += samples
        if pending and _shape_key(pending[0]) != _shape_key(feed):
            if not fixed:  # a fixed-batch model cannot run a partial input: drop it
                yield _concat(pending)
                batches += 1
                if batches == max_batches:
                    return
            pending, pending_samples = [], Fraction(0)
        pending.append(feed)
        pending_samples += samples
        while pending_samples >= target:
            merged = _concat(pending)
            yield _take(merged, units, target)
            batches += 1
            if batches == max_batches:
                return
            pending_samples -= target
            pending = [_take(merged, units, pending_samples, target)] if pending_samples else []
        if max_samples is not None and seen >= max_samples:
            break
    if pending and not fixed:
        yield _concat(pending)
    elif pending and not batches:
        raise _short_of_one_sample(inputs, _concat(pending), units)
