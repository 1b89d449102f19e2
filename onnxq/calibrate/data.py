"""Calibration data sources, checked against the model's inputs and streamed in batches.

Accepted sources: a directory of .npy/.npz files, one .npz (arrays keyed by input name,
samples on axis 0), one .npy (single-input models), a mapping of input name to array,
any iterable of feed dicts, and onnxruntime's `CalibrationDataReader` protocol (an
object with `get_next()`). Nothing is read ahead beyond one batch.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
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

    @property
    def batch_dynamic(self) -> bool:
        return self.shape is not None and len(self.shape) > 0 and self.shape[0] is None

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
        specs.append(InputSpec(value.name, dtype, shape))
    return specs


def _from_reader(reader: Any) -> Iterator[Mapping[str, Any]]:
    while (item := reader.get_next()) is not None:
        yield item


def _split_rows(arrays: Mapping[str, np.ndarray]) -> Iterator[Feed]:
    """Yield one sample at a time from arrays that hold samples on axis 0."""
    counts = {name: len(a) for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise CalibrationDataError(
            f"calibration arrays have different sample counts {counts}; give each input the same number of samples"
        )
    n = next(iter(counts.values()), 0)
    for i in range(n):
        yield {name: a[i : i + 1] for name, a in arrays.items()}


def _read_file(path: Path, inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Arrays of one .npz (keyed by input name) or .npy (single-input models) file."""
    if path.suffix == ".npy" and len(inputs) != 1:
        raise CalibrationDataError(
            f"{path.name}: .npy files only work for single-input models; use .npz keyed by input name "
            f"({', '.join(s.name for s in inputs)})"
        )
    if path.suffix not in (".npy", ".npz"):
        raise CalibrationDataError(f"unsupported calibration file {path.name}; use .npz, .npy or a directory of them")
    try:
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
            yield _read_file(f, inputs)
        return
    arrays = _read_file(path, inputs)
    yield from _split_rows({k: _with_batch_axis(k, v, inputs) for k, v in arrays.items()})


def _with_batch_axis(name: str, array: np.ndarray, inputs: list[InputSpec]) -> np.ndarray:
    """Arrays in a single file hold samples on axis 0; a lone sample gains that axis."""
    spec = next((s for s in inputs if s.name == name), None)
    if spec is not None and spec.shape is not None and array.ndim == len(spec.shape) - 1:
        return array[None]
    return array


def raw_feeds(source: Any, inputs: list[InputSpec]) -> Iterator[Mapping[str, Any]]:
    """Turn any accepted source into an iterator of (unchecked) feed dicts."""
    if source is None:
        raise CalibrationDataError("static quantization needs calibration data; pass --calib-data PATH")
    if isinstance(source, str | os.PathLike):
        return _from_path(Path(source), inputs)
    if hasattr(source, "get_next"):
        return _from_reader(source)
    if isinstance(source, Mapping):
        return _split_rows({k: _with_batch_axis(k, np.asarray(v), inputs) for k, v in source.items()})
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
    """Validate one feed against the model inputs; returns arrays with a batch axis."""
    if not isinstance(feed, Mapping):
        raise CalibrationDataError(
            f"calibration sample is a {type(feed).__name__}, expected a dict of input name -> array"
        )
    names = {s.name for s in inputs}
    extra = sorted(set(feed) - names)
    if extra:
        raise CalibrationDataError(
            f"calibration data has {extra[0]!r}, which is not a model input; model inputs: {', '.join(sorted(names))}"
        )
    out: Feed = {}
    for spec in inputs:
        if spec.name not in feed:
            raise CalibrationDataError(
                f"calibration data is missing input {spec.name!r} (expected {spec.describe()}); "
                f"given: {', '.join(sorted(feed)) or 'nothing'}"
            )
        out[spec.name] = _check_array(spec, np.asarray(feed[spec.name]))
    return out


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
    if array.ndim == len(spec.shape) - 1:
        array = array[None]
    if array.ndim != len(spec.shape):
        raise CalibrationDataError(
            f"calibration input {spec.name!r} has shape {list(array.shape)} (rank {array.ndim}), "
            f"expected {spec.describe()} (rank {len(spec.shape)})"
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


def _rows(feed: Feed) -> int:
    return len(next(iter(feed.values()))) if feed else 1


def _shape_key(feed: Feed) -> tuple:
    return tuple((k, v.shape[1:], v.dtype.str) for k, v in feed.items())


def _fixed_batch(inputs: list[InputSpec]) -> int | None:
    """The static batch size of the model, or None when the batch axis is dynamic."""
    sizes = {s.shape[0] for s in inputs if s.shape}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def iter_batches(
    source: Any, inputs: list[InputSpec], batch_size: int, max_samples: int | None,
    purpose: str = "calibration",
) -> Iterator[Feed]:
    """Validated batches of up to `batch_size` samples (the model's fixed batch if it has one)."""
    if not isinstance(source, CalibrationSource):
        source = CalibrationSource(source)
    fixed = _fixed_batch(inputs)
    target = fixed or max(batch_size, 1)
    seen, pending, pending_rows = 0, [], 0
    for raw in source.feeds(inputs, purpose):
        feed = check_feed(raw, inputs)
        if max_samples is not None:
            room = max_samples - seen
            if room <= 0:
                break
            if _rows(feed) > room:
                feed = {k: v[:room] for k, v in feed.items()}
        seen += _rows(feed)
        if pending and _shape_key(pending[0]) != _shape_key(feed):
            yield _concat(pending)
            pending, pending_rows = [], 0
        pending.append(feed)
        pending_rows += _rows(feed)
        while pending_rows >= target:
            merged = _concat(pending)
            yield {k: v[:target] for k, v in merged.items()}
            rest = {k: v[target:] for k, v in merged.items()}
            pending_rows -= target
            pending = [rest] if pending_rows else []
        if max_samples is not None and seen >= max_samples:
            break
    if pending:
        if fixed is not None and pending_rows != fixed:
            return  # a partial batch cannot run on a fixed-batch model; drop it
        yield _concat(pending)
