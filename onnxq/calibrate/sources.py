"""Calibration data sources, turned into feed dicts one sample or feed at a time: a
directory of .npy/.npz files, one .npz (arrays keyed by input name, samples on axis 0),
one .npy (single-input models), a mapping of input name to array, any iterable of feed
dicts, and onnxruntime's `CalibrationDataReader` protocol (an object with `get_next()`);
`CalibrationSource` reads one again where it can. Nothing is read ahead."""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from onnxq.calibrate.inputs import (
    Feed,
    InputSpec,
    axes_of,
    check_array,
    check_finite,
    sample_counts,
    sample_rows,
    take_rows,
    to_rows,
    unbatchable,
)
from onnxq.errors import CalibrationDataError, OnnxqError


def _from_reader(reader: Any) -> Iterator[Mapping[str, Any]]:
    return _guarded(iter(reader.get_next, None), f"the {type(reader).__name__}'s get_next()")


def _guarded(items: Iterator[Any], what: str) -> Iterator[Any]:
    """`items`, with an exception the user's own code raises (a reader, a generator)
    turned into one line saying where it came from and at which sample or batch."""
    count = 0
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except OnnxqError:
            raise
        except Exception as exc:  # noqa: BLE001  the user's code may raise anything
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise CalibrationDataError(f"{what} raised {type(exc).__name__} on item {count + 1}"
                                       + (f": {first}" if first else "") + "; fix it, or pass the data as arrays "
                                       "(an .npz, a dict or a list of feeds)") from exc
        count += 1
        yield item


def _split_rows(arrays: Mapping[str, np.ndarray], inputs: list[InputSpec], chunk: int = 1) -> Iterator[Feed]:
    """Yield `chunk` samples at a time from arrays that hold samples on their input's
    batch axis (axis 0 for arrays that are no model input; the last part may hold fewer).

    A sample is one row, or for an input with a fixed batch B its B rows; a last part
    that fills no whole sample is still yielded, for iter_batches to drop or report. A
    rank-0 array goes with every sample as it is. Arrays of different sample counts are a
    mistake, named, unless an input's batch axis is no batch at all (`inputs.unbatchable`:
    a graph's edges [2, e] beside its nodes [n, 16]): they are then one feed, run whole.
    `chunk`: the batch the reader merges
    samples into, so that it takes each batch as it comes (ResNet-20's 200 images one
    at a time: 4 ms of merging and checking, a fortieth of its quantize).
    """
    units = sample_rows(inputs)
    axes = axes_of(inputs)
    names = {spec.name for spec in inputs}
    if not any(name in names for name in arrays):  # no model input among them: the feed check names what is missing
        yield dict(arrays)
        return
    counts = sample_counts(arrays, inputs) or {"": Fraction(1)}
    if len(set(counts.values())) > 1:
        if unbatchable(inputs):
            yield dict(arrays)
            return
        shown = {name: str(n) for name, n in counts.items()}
        once = next((s for s in inputs if s.shape and s.batch_dim == 1 and counts.get(s.name) == 1), None)
        how = (f"{once.name!r} takes one value per sample: repeat it, stacked [samples, "
               f"{', '.join(map(str, once.shape))}]" if once is not None else
               "where the inputs are no batch of samples, a graph's nodes and edges or bags' ids and offsets, give one "
               "feed per file of a folder or per item of a list")
        raise CalibrationDataError(
            f"calibration arrays have different sample counts {shown}; give each input the same number of samples "
            f"({how})")
    n = math.ceil(next(iter(counts.values()), 0))
    chunk = max(chunk, 1)
    for i in range(0, n, chunk):
        yield {name: take_rows(a, axes.get(name, 0), i * units.get(name, 1), (i + chunk) * units.get(name, 1))
               if np.ndim(a) else a for name, a in arrays.items()}


def _read_file(path: Path, inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Arrays of one .npz (keyed by input name) or .npy (single-input models) file."""
    if path.suffix == ".npy" and len(inputs) != 1:
        names = [s.name for s in inputs]
        raise CalibrationDataError(
            f"{path.name}: .npy files only work for single-input models; use .npz keyed by input name "
            f"({', '.join(names[:6])}{f', ... {len(names)} in all' if len(names) > 6 else ''})"
        )
    if path.suffix not in (".npy", ".npz"):  # calibration and evaluation data alike
        raise CalibrationDataError(f"unsupported data file {path.name}; use .npz, .npy or a directory of them")
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
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # dtype=object: loading it would run pickled code
            raise CalibrationDataError(
                f"cannot read calibration file {path}: it holds object arrays, which onnxq does not unpickle; "
                "save strings as numpy strings (np.array(texts), dtype <U) instead of dtype=object") from None
        raise _unreadable(path, exc) from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> CalibrationDataError:
    """The error for a data file numpy cannot read."""
    return CalibrationDataError(
        f"cannot read calibration file {path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        "; check that it is a complete .npy/.npz written by numpy"
    )


def _from_path(path: Path, inputs: list[InputSpec], chunk: int = 1) -> Iterator[Mapping[str, Any]]:
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
    yield from _split_rows(_arrays_to_rows(arrays, inputs), inputs, chunk)


def _checked_file(path: Path, arrays: dict[str, np.ndarray], inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """`arrays` of file `path`, checked as a whole (`_checked_arrays`); an error names the file."""
    try:
        return _checked_arrays(arrays, inputs)
    except CalibrationDataError as exc:
        raise CalibrationDataError(f"{path.name}: {exc}") from None


def _checked_arrays(arrays: Mapping[str, Any], inputs: list[InputSpec]) -> Mapping[str, Any]:
    """`arrays` (samples on axis 0), their type, shape and values checked as a whole, so
    that an error gives the arrays' shapes (not one sample's) and counts every NaN, and a
    dict is read as its .npz would be: one sample's rows split from a stack of a smaller
    rank were each taken for a lone sample (a [128, 8, 8] stack for a [?, 1, 8, 8] input)."""
    specs = {s.name: s for s in inputs}
    for name, array in arrays.items():
        if name in specs:
            check_finite(specs[name], check_array(specs[name], np.asarray(array)))
    return arrays


def _arrays_to_rows(arrays: Mapping[str, Any], inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    specs = {s.name: s for s in inputs}
    return {k: to_rows(specs.get(k), np.asarray(v)) for k, v in arrays.items()}


def raw_feeds(source: Any, inputs: list[InputSpec], chunk: int = 1) -> Iterator[Mapping[str, Any]]:
    """Turn any accepted source into an iterator of (unchecked) feed dicts; arrays are
    cut `chunk` samples at a time (`_split_rows`)."""
    if source is None:
        raise CalibrationDataError("static quantization needs calibration data; pass calibration_data (a path, "
                                   "a dict of arrays, feeds or a reader)")
    if isinstance(source, str | os.PathLike):
        return _from_path(Path(source), inputs, chunk)
    if hasattr(source, "get_next"):
        return _from_reader(source)
    if isinstance(source, Mapping):
        return _split_rows(_arrays_to_rows(_checked_arrays(source, inputs), inputs), inputs, chunk)
    if isinstance(source, Iterable):
        return _guarded(iter(source), f"the calibration {type(source).__name__}")
    raise CalibrationDataError(
        f"unsupported calibration data of type {type(source).__name__}; pass a path, a dict of arrays, "
        "an iterable of feed dicts or an object with get_next()"
    )


class CalibrationSource:
    """Calibration data that may be read several times (calibration, then algorithms).

    Paths, dicts of arrays and sequences can be re-read; a reader with `rewind()` is
    rewound before each read; a one-shot iterator or reader can be read once, and a second read is a
    clear error rather than silently empty data.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self.reads = 0
        # Arrays in the data that are no model input (a `labels` array): left out, named
        # in the summary.
        self.ignored: set[str] = set()
        # Feeds run whole, each one sample, where the inputs share no batch axis
        # (`inputs.whole_feed`): the summary says so.
        self.whole = 0

    @property
    def replayable(self) -> bool:
        s = self.source
        return isinstance(s, str | os.PathLike | Mapping | list | tuple) or hasattr(s, "rewind")

    def feeds(self, inputs: list[InputSpec], purpose: str = "calibration", chunk: int = 1,
              ) -> Iterator[Mapping[str, Any]]:
        if self.reads and not self.replayable:
            raise CalibrationDataError(
                f"{purpose} needs another pass over the calibration data, but a "
                f"{type(self.source).__name__} can be read only once; pass a path, a dict of arrays or a list of feeds"
            )
        if hasattr(self.source, "rewind"):  # the first read too: a reader another tool read to its end
            self.source.rewind()
        self.reads += 1
        return raw_feeds(self.source, inputs, chunk)


def empty_data(data: Any) -> CalibrationDataError:
    """The error for calibration data that gave no sample; a reader (`get_next()`) that
    another tool already read to its end is the usual cause, and is named."""
    source = getattr(data, "source", data)
    if hasattr(source, "get_next") and not hasattr(source, "rewind"):
        return CalibrationDataError(f"calibration data is empty: the {type(source).__name__} gave no sample (only "
                                    "empty batches, or it was already read to its end); pass a fresh reader, or give "
                                    "it rewind()")
    return CalibrationDataError("calibration data is empty; give at least one sample")
