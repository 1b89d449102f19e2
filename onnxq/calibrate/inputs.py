"""The model inputs calibration data must provide (`model_inputs`), how many rows of each
make one sample (`sample_rows`), and feeds checked against them (`check_feed`: dtype,
rank, static dimensions, finite values).

Arrays hold rows on the model's axis 0. For an input with a fixed batch B (such as
[1,3,32,32], or [3,32,32] whose first axis is not a batch at all) one sample is one whole
input of B rows: an array of exactly the input's shape is one sample, a stack of N of them
(shape [N, *input shape]) is N samples, and B rows given one by one make one sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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


def _fixed_batch(inputs: list[InputSpec]) -> int | None:
    """The static batch size of the model, or None when the batch axis is dynamic."""
    sizes = {s.shape[0] for s in inputs if s.shape}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def feed_rows(feed: Feed) -> int:
    """Rows in a batch: of its first input with a batch axis (1 where every input is a
    scalar, which runs one sample at a time)."""
    return next((len(v) for v in feed.values() if np.ndim(v)), 1)


def sample_rows(inputs: list[InputSpec]) -> dict[str, int]:
    """Rows (along axis 0) of each input that make one sample.

    An input's static first dimension, else the model's fixed batch when it has one,
    else 1: a sample of a fixed-shape input is one whole input.
    """
    common = _fixed_batch(inputs) or 1
    return {s.name: s.shape[0] if s.shape and s.shape[0] is not None else common for s in inputs}


def to_rows(spec: InputSpec | None, array: np.ndarray) -> np.ndarray:
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
        out[spec.name] = check_array(spec, np.asarray(feed[spec.name]))
        check_finite(spec, out[spec.name])
    return out


def _given(feed: Mapping[str, Any], inputs: list[InputSpec]) -> str:
    names = {spec.name for spec in inputs}
    extra = [repr(k) for k in sorted(feed) if k not in names]
    if not feed:
        return "given: nothing"
    if not extra:
        return f"given: {', '.join(repr(k) for k in sorted(feed))}"
    return f"it has {', '.join(extra)}, which {'is not a model input' if len(extra) == 1 else 'are no model inputs'}"


def check_finite(spec: InputSpec, array: np.ndarray) -> None:
    """NaN or infinity in a float input would be calibrated around silently (observers
    skip non-finite values) while the model's outputs on it are garbage."""
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return
    nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
    raise CalibrationDataError(
        f"calibration input {spec.name!r} holds {nan} NaN and {inf} infinite values; "
        "replace them or drop those samples from the calibration data"
    )


def _layout_hint(got: tuple[int, ...], want: tuple[int | None, ...]) -> str:
    """The transpose that makes channels-last images the model's channels-first ones."""
    if len(got) == 4 and want[1] is not None and got[3] == want[1] != got[1]:
        return "; channels last: .transpose(0, 3, 1, 2) makes them channels first"
    return ""


def check_array(spec: InputSpec, array: np.ndarray) -> np.ndarray:
    if array.dtype != spec.dtype:
        if array.dtype.kind == spec.dtype.kind or {array.dtype.kind, spec.dtype.kind} <= {"i", "u"}:
            array = array.astype(spec.dtype)
        else:
            raise CalibrationDataError(
                f"calibration input {spec.name!r} has dtype {array.dtype}, expected {spec.describe()}; "
                f"convert it with .astype({spec.dtype.name})"
                + (" and scale it as the model expects (images: /255, then its mean and std)"
                   if array.dtype == np.uint8 and spec.dtype.kind == "f" else "")
            )
    if spec.shape is None:
        return array
    array = to_rows(spec, array)
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
                f"calibration input {spec.name!r} has samples of shape {list(array.shape[1:])}, expected "
                f"{spec.describe()} "
                f"(axis {axis} must be {want})" + _layout_hint(array.shape, spec.shape)
            )
    return array
