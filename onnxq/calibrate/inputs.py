"""The model inputs calibration data must provide (`model_inputs`), how many rows of each
make one sample (`sample_rows`), and feeds checked against them (`check_feed`: dtype,
rank, static dimensions, finite values).

Arrays hold rows on the input's batch axis: axis 0, unless the names of the model's
dynamic dimensions put it elsewhere (`batch_axes`: a recurrent model's time-major input
[t, b, 40] and its initial state [layers, b, 64] are batched on axis 1). For an input with
a fixed batch B (such as [1,3,32,32], or [3,32,32] whose first axis is not a batch at all)
one sample is one whole input of B rows: an array of exactly the input's shape is one
sample, a stack of N of them (shape [N, *input shape]) is N samples, and B rows given one
by one make one sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
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
    batch_axis: int = 0  # where its samples lie (`batch_axes`)
    # its batch axis as the model's shape gives it: a dimension's name, a static size, or
    # None where unknown (`shared_batch`)
    batch_name: str | int | None = None

    @property
    def batch_dim(self) -> int | None:
        """The static size of its batch axis; None where dynamic or where it has none."""
        return self.shape[self.batch_axis] if self.shape and len(self.shape) > self.batch_axis else None

    @property
    def batch_dynamic(self) -> bool:
        return self.shape is not None and len(self.shape) > self.batch_axis and self.shape[self.batch_axis] is None

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
    graph = model.graph
    axes = batch_axes({v.name: _dims(v.shape) for v in graph.inputs}, [_dims(v.shape) for v in graph.outputs],
                      recurrent_axes(graph))
    specs = []
    for value in graph.inputs:
        shape = None
        if value.shape is not None:
            shape = tuple(d if isinstance(d, int) else None for d in value.shape)
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        axis = axes.get(value.name, 0)
        specs.append(InputSpec(value.name, dtype, shape, _kind(value.type), axis, axis_name(_dims(value.shape), axis)))
    return specs


def sample_counts(feed: Mapping[str, Any], inputs: list[InputSpec]) -> dict[str, Fraction]:
    """Samples each input of `feed` holds: its rows on its batch axis over the rows a
    sample takes (`sample_rows`)."""
    units = sample_rows(inputs)
    return {s.name: Fraction(rows_of(np.asarray(feed[s.name]), s.batch_axis), units[s.name])
            for s in inputs if s.name in feed and np.ndim(feed[s.name])}


def axis_name(dims: Dims, axis: int) -> str | int | None:
    """Dimension `axis` of `dims` as the model gives it (name, size or None)."""
    return dims[axis] if axis < len(dims) else None


def shared_batch(inputs: list[InputSpec]) -> bool:
    """Whether the model's shapes make the inputs' dynamic batch axes one dimension: the
    same name wherever they give one (an unnamed one agrees with any; static sizes are
    fixed batches, `sample_rows`). Where they do not (a graph's nodes [n, 16] beside its
    edges [2, e], bags' ids [total] beside their offsets [N], a tf2onnx model's [unk__1, 8]
    beside [unk__2, 4]), a feed whose inputs hold other numbers of samples runs whole
    (`whole_feed`)."""
    return len({s.batch_name for s in inputs if isinstance(s.batch_name, str)}) <= 1  # sizes: fixed batches


def unbatchable(inputs: list[InputSpec]) -> bool:
    """Whether an input's batch axis has a static size other than 1 that no other input
    shares (a graph's edges [2, e] beside its nodes [n, 16]): axis 0 is then no
    batch, so one file of arrays with other row counts is one feed, not a mistake."""
    sizes = [s.batch_name for s in inputs]
    return any(s.batch_dynamic for s in inputs) and any(
        isinstance(n, int) and n != 1 and sizes.count(n) < len(sizes) for n in sizes)


def whole_feed(feed: Mapping[str, Any], inputs: list[InputSpec]) -> bool:
    """Whether `feed` runs whole, as one sample: its inputs hold different numbers of
    samples where the model's shapes give them no shared batch axis (`shared_batch`).
    Such inputs cannot be cut into samples or merged: the feed is what the model takes in
    one run. Bags of one id each (as many ids as offsets) look like samples and are
    batched as such: give such data one bag per feed, or the model no such coincidence."""
    return not shared_batch(inputs) and len(set(sample_counts(feed, inputs).values())) > 1


Dims = list[int | str | None]


def _dims(shape: ir.Shape | None) -> Dims:
    """A shape's dimensions: ints, the names of named dynamic ones, None for the others."""
    if shape is None:
        return []
    return [d if isinstance(d, int) else (getattr(d, "value", None) or None) for d in shape]


# Recurrent ops and the input slots whose batch axis their layout sets: X (0), initial_h
# (5), initial_c (6) on axis 1 at layout 0 (time-major) and 0 at layout 1; sequence_lens (4)
# is [batch].
_RECURRENT = ("LSTM", "GRU", "RNN")


def recurrent_axes(graph: ir.Graph) -> dict[str, int]:
    """Batch axes of graph inputs a recurrent node reads directly, from its layout."""
    inputs = {v.name for v in graph.inputs}
    found: dict[str, int] = {}
    for node in graph:
        recurrent = node.op_type in _RECURRENT and node.domain in ("", "ai.onnx")
        if not recurrent and (node.domain, node.op_type) != ("com.microsoft", "DynamicQuantizeLSTM"):
            continue  # (the dynamic recipe's LSTM: the same inputs, time-major)
        layout = node.attributes.get_int("layout", 0)
        for slot, value in enumerate(node.inputs):
            if value is not None and value.name in inputs and slot in (0, 4, 5, 6):
                found[value.name] = 0 if slot == 4 or layout == 1 else 1
    return found


def batch_axes(inputs: Mapping[str, Dims], outputs: list[Dims], recurrent: Mapping[str, int] | None = None,
               ) -> dict[str, int]:
    """Each input's batch axis, where the model's shapes say it is not axis 0.

    Axis 0 stays the batch while it can be one: the same name, the same size or an unnamed
    dimension on every input (a batch-1 export [1, t, 40] with its mask [1, t] keeps it).
    It moves where a recurrent node reads the input directly as time-major
    (`recurrent_axes`); where axis 0 cannot be the batch ([b, t, 40] beside its state
    [4, b, 64]), to the one name every input has exactly once (b), unless an input's
    axis 0 is a batch of 1 and that name is no batch's ([1, t, 4] beside [t]: a batch-1
    export, `BATCH_NAMES`); and where axis 0 is a name the outputs carry and another
    name every input has is carried by more of them ([t, b, 40] with outputs [t, b, 12]
    and [1, b, 64]; MiniLM's [batch, sequence] stays, its embeddings being [batch, 384];
    [batch, seq] with an output [batch_size, seq, 4] stays). Where the shapes do not
    settle it: axis 0."""
    named = {name: [d if isinstance(d, str) else None for d in dims] for name, dims in inputs.items() if dims}
    if not named:
        return {}
    firsts = {tuple(dims[:1]) for dims in inputs.values() if dims}
    consistent = len(firsts) == 1 or any(first == (None,) for first in firsts)
    candidates = [c for c in dict.fromkeys(d for dims in named.values() for d in dims if d)
                  if all(dims.count(c) == 1 for dims in named.values())]

    def axes(c: str) -> dict[str, int]:
        return {name: dims.index(c) for name, dims in named.items()}

    fits = [c for c in candidates if recurrent and all(
        name not in named or (axis < len(named[name]) and named[name][axis] == c) for name, axis in recurrent.items())]
    if len(fits) == 1 and any(axes(fits[0]).values()):
        return axes(fits[0])
    counts = {c: sum(c in dims for dims in outputs) for c in candidates}
    if consistent:
        first = next(iter(named.values()))[0]
        beyond = [c for c in candidates if c != first and counts[c] > counts.get(first, 0)]
        if first is None or first not in candidates or not counts[first] or not beyond:
            return {}
        best = max(counts[c] for c in beyond)
        winners = [c for c in beyond if counts[c] == best]
        return axes(winners[0]) if len(winners) == 1 else {}
    if len(candidates) > 1:
        best = max(counts.values())
        candidates = [c for c in candidates if counts[c] == best]
    if len(candidates) != 1 or ((1,) in firsts and candidates[0].lower() not in BATCH_NAMES):
        return {}
    return axes(candidates[0])


# Names exporters give a batch axis: where an input's axis 0 is a batch of 1, only such a
# name moves the batch elsewhere (a GRU's state [1, b, 64] beside [b, t, 40]; not [t] beside
# a batch-1 export's [1, t, 4]).
BATCH_NAMES = frozenset({"b", "n", "bs", "batch", "batch_size", "batchsize", "nbatch", "num_batch", "batches",
                         "batch_dim", "n_batch"})


def axes_of(inputs: list[InputSpec]) -> dict[str, int]:
    """Each input's batch axis, by name."""
    return {s.name: s.batch_axis for s in inputs}


def rows_of(array: np.ndarray, axis: int) -> int:
    """Rows of `array` on its batch `axis`."""
    return array.shape[axis] if array.ndim > axis else len(array)


def take_rows(array: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of `array` on its batch `axis` (a view); a scalar is every
    sample's."""
    return array[(slice(None),) * axis + (slice(start, stop),)] if np.ndim(array) else array


def as_scalars(feed: Feed, inputs: list[InputSpec]) -> Feed:
    """`feed` with the one value a batch holds for each scalar input as the 0-d array
    the model takes (a stack of per-sample timesteps is cut to [1])."""
    scalars = [s.name for s in inputs if s.shape == () and np.ndim(feed.get(s.name)) == 1]
    if not scalars:
        return feed
    return {k: v.reshape(()) if k in scalars and v.size == 1 else v for k, v in feed.items()}


def _kind(value_type: ir.TypeProtocol | None) -> str:
    if isinstance(value_type, ir.SequenceType):
        return "sequence"
    if isinstance(value_type, ir.OptionalType):
        return "optional"
    return "tensor"


def _fixed_batch(inputs: list[InputSpec]) -> int | None:
    """The static batch size of the model, or None when the batch axis is dynamic."""
    sizes = {s.batch_dim for s in inputs if s.shape}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def feed_rows(feed: Feed, axes: Mapping[str, int] | None = None) -> int:
    """Rows in a batch: of its first input with a batch axis, on that axis (`axes`, default
    0; 1 where every input is a scalar, which runs one sample at a time)."""
    return next((rows_of(v, (axes or {}).get(k, 0)) for k, v in feed.items() if np.ndim(v)), 1)


def whole_feeds_note(inputs: list[InputSpec]) -> str:
    """What the summary says where feeds ran whole (`whole_feed`)."""
    dims = ", ".join(f"{s.name} {s.batch_name if s.batch_name is not None else '?'}" for s in inputs if s.shape)
    return ("calibration data: each file or feed ran whole and counts as one sample: the model's inputs share no "
            f"batch axis ({dims}), so their rows cannot be cut into samples or merged")


def feed_samples(feed: Feed, inputs: list[InputSpec]) -> int:
    """Samples in a batch: its rows on the batch axis over the rows one sample takes (an
    unbatched [3, H, W] image is one sample of 3 rows); a feed that runs whole
    (`whole_feed`) is one."""
    if whole_feed(feed, inputs):
        return 1
    units = sample_rows(inputs)
    first = next((s for s in inputs if s.name in feed and np.ndim(feed[s.name])), None)
    if first is None:
        return 1
    return max(rows_of(np.asarray(feed[first.name]), first.batch_axis) // max(units[first.name], 1), 1)


def sample_rows(inputs: list[InputSpec]) -> dict[str, int]:
    """Rows (along its batch axis) of each input that make one sample.

    An input's static batch dimension, else the model's fixed batch when it has one,
    else 1: a sample of a fixed-shape input is one whole input. A scalar input (a
    timestep) has one value per sample: a stack of them is [samples].
    """
    common = _fixed_batch(inputs) or 1
    return {s.name: 1 if s.shape == () else d if (d := s.batch_dim) is not None else common for s in inputs}


def to_rows(spec: InputSpec | None, array: np.ndarray) -> np.ndarray:
    """`array` with its rows on the input's batch axis.

    A lone sample without the batch axis gains it; a stack of N whole inputs of a fixed
    batch B (shape [N, B, ...]) becomes its N*B rows, every B of which make one input again.
    """
    if spec is None or spec.shape is None or not spec.shape:
        return array
    axis = spec.batch_axis
    if axis and array.ndim == len(spec.shape) - 1:  # one sample of an input batched on another axis
        return np.expand_dims(array, axis)
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
        if array.dtype.kind == spec.dtype.kind or {array.dtype.kind, spec.dtype.kind} <= {"i", "u"} or (
                spec.dtype.kind == "O" and array.dtype.kind == "U"):  # numpy's strings: a string input's objects
            array = array.astype(spec.dtype)
        else:
            fix = "decode its bytes with np.char.decode(array, 'utf-8')" if array.dtype.kind == "S" and \
                spec.dtype.kind == "O" else f"convert it with .astype({spec.dtype.name})"  # bytes match no string
            raise CalibrationDataError(
                f"calibration input {spec.name!r} has dtype {array.dtype}, expected {spec.describe()}; {fix}"
                + (" and scale it as the model expects (images: /255, then its mean and std)"
                   if array.dtype == np.uint8 and spec.dtype.kind == "f" else "")
            )
    if spec.shape is None:
        return array
    if spec.shape == ():  # a scalar, or a stack of one per sample
        if array.ndim > 1 or (array.ndim == 1 and not len(array)):
            raise CalibrationDataError(
                f"calibration input {spec.name!r} is a scalar (one value a run), but the data has shape "
                f"{list(array.shape)}; give one value per sample: a 0-d array in each file or feed, or "
                "[samples] in one .npz or dict")
        return array
    array = to_rows(spec, array)
    if array.ndim == len(spec.shape) + 1 and spec.shape[0] is not None:  # a stack of unbatched inputs
        _check_static_dims(spec, array.shape[1:], range(len(spec.shape)))
    axis = min(spec.batch_axis, max(array.ndim - 1, 0))
    if array.ndim != len(spec.shape):
        dims = ["?" if d is None else str(d) for d in spec.shape]
        dims[spec.batch_axis] = "samples"
        off = len(spec.shape) - array.ndim
        off_by = f"{abs(off)} ax{'i' if abs(off) == 1 else 'e'}s {'missing' if off > 0 else 'too many'}"
        raise CalibrationDataError(
            f"calibration input {spec.name!r} has rank {array.ndim} (each sample {_sample(array.shape, axis)}), "
            f"the model's input rank {len(spec.shape)} ({spec.describe()}): {off_by}; give arrays "
            f"[{', '.join(dims)}]"
        )
    _check_static_dims(spec, array.shape, [a for a in range(len(spec.shape)) if a != spec.batch_axis],
                       _sample(array.shape, axis))
    return array


def _sample(shape: tuple[int, ...], axis: int) -> list[int]:
    """A batch's shape without its batch `axis`: one sample's."""
    return [d for i, d in enumerate(shape) if i != axis]


def _check_static_dims(spec: InputSpec, shape: tuple[int, ...], axes: Any, sample: list[int] | None = None) -> None:
    """Each of `axes` of `shape` as the input's static dimension there; `sample`: the
    sample's shape the error gives (default `shape`)."""
    for axis in axes:
        want = spec.shape[axis]
        if want is not None and want != shape[axis]:
            raise CalibrationDataError(
                f"calibration input {spec.name!r} has samples of shape {sample or list(shape)}, expected "
                f"{spec.describe()} "
                f"(axis {axis} must be {want})" + _layout_hint(shape, spec.shape)
            )
