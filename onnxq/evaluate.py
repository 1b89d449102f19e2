"""Compare a quantized model against its float original on the same inputs.

Metrics: SQNR (dB) and cosine similarity of every output, top-1 agreement for outputs
that look like class scores, and top-1 accuracy when labels are given.

The quantized model is measured as it deploys: a default `onnxruntime.InferenceSession`
(all graph optimisations, so QDQ groups run as fused int8 kernels). `kernels="both"`
also runs it with reference kernels (optimisation level basic: Q/DQ run as written and
the arithmetic stays float), which isolates what the int8 kernels of this CPU add.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from tqdm import tqdm

from onnxq.calibrate.data import CalibrationSource, feed_samples, iter_batches
from onnxq.calibrate.decoder import LOGITS, DecoderFeeds, decoder_feeds, is_decoder, result_outputs
from onnxq.calibrate.inputs import recurrent_axes
from onnxq.calibrate.session import (
    check_providers,
    run_on_data,
    run_quantized,
)
from onnxq.errors import CalibrationDataError, ModelError, OnnxqError
from onnxq.graph.quantized import describe, integer_kernel, quantized_ops
from onnxq.graph.selection import scored_index, selected_outputs
from onnxq.perplexity import NextToken, scores_tokens
from onnxq.sessions import (
    deployed_session,
    extends,
    float_session,
    imports_extended,
    opened,
    session_inputs,
    structure,
)

KERNELS = ("deployed", "reference", "both")
# Deployed and reference figures further apart than this get a one-line warning.
KERNEL_GAP_DB = 3.0
KERNEL_GAP_TOP1 = 0.005


@dataclass
class OutputMetrics:
    name: str
    sqnr_db: float
    cosine: float
    top1_agreement: float | None = None
    # an integer or boolean output (class indices, a mask): the share of elements equal, which
    # is what it means; SQNR and cosine of indices are no signal figures
    equal: float | None = None
    # the selection op (NonMaxSuppression, TopK ...) whose picked and ordered rows it holds
    # (`graph/selection.py`): its figures do not measure the picks
    follows: str | None = None
    # such an output's rows over the samples, float and quantized, where the two models
    # picked different numbers of rows: no figures then
    rows_differ: tuple[int, int] | None = None


@dataclass
class Comparison:
    """Float against quantized; `reference` holds the same figures with reference kernels."""

    samples: int
    outputs: list[OutputMetrics] = field(default_factory=list)
    float_accuracy: float | None = None
    quant_accuracy: float | None = None
    kernels: str = "deployed"
    reference: Comparison | None = None
    ignored: list[str] = field(default_factory=list)  # data arrays that are no model input
    float_quantized: str | None = None  # the quantized ops of a "float" model (arguments swapped?)
    extended: bool = False  # the quantized model holds onnxq's extended ops (qdq-ext): no default session loads it
    # An LLM decoder on token windows: next-token perplexity of float and quantized, and agreement
    next_token: tuple[NextToken, NextToken] | None = None
    labels_unused: bool = False  # labels were given and no output is class scores to score them
    # integer kernels (QOperator: QLinearConv, QGemm, ...) whose reference run is the same kernels
    integer_kernels: bool = False

    def kernel_gap(self) -> str | None:
        """A warning when this CPU's int8 kernels lose much more than the QDQ arithmetic."""
        ref = self.reference
        if ref is None:
            return None
        worst_db = max((r.sqnr_db - d.sqnr_db for r, d in zip(ref.outputs, self.outputs) if d.equal is None),
                       default=0.0)  # an integer output has no SQNR
        top1 = [(r.top1_agreement or 0) - (d.top1_agreement or 0) for r, d in zip(ref.outputs, self.outputs)]
        if self.quant_accuracy is not None and ref.quant_accuracy is not None:
            top1.append(ref.quant_accuracy - self.quant_accuracy)
        if worst_db <= KERNEL_GAP_DB and max(top1, default=0) <= KERNEL_GAP_TOP1:
            return None
        return (f"warning: the deployed int8 kernels lose {worst_db:.1f} dB / {max(top1, default=0):.2%} "
                "top-1 more than the reference arithmetic (they saturate on this CPU); re-quantize "
                "with --target auto (the default) or --reduce-range")


def sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical)."""
    noise = float(np.sum((ref.astype(np.float64) - test) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(max(signal, 1e-30) / noise)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine of each row pair of `a` and `b` ([rows, values]): 1 where both rows are
    zero, 0 where one is (a model that outputs zeros where float did not has lost the
    signal) or where either is not finite (an overflow scores no agreement, not a perfect one)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.sum(a * b, axis=1) / (na * nb)
    cos = np.where((na == 0) & (nb == 0), 1.0, np.where((na > 0) & (nb > 0), cos, 0.0))
    return np.where(np.isfinite(cos), cos, 0.0)


def cosine(ref: np.ndarray, test: np.ndarray) -> float:
    """The cosine of the two arrays as one vector each, by `row_cosines`' rules."""
    a, b = ref.astype(np.float64).ravel(), test.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    cos = float(a @ b / (na * nb))
    return cos if np.isfinite(cos) else 0.0


def top1_agreement(ref: np.ndarray, test: np.ndarray) -> float | None:
    """How often the two agree on the largest score per row, for outputs that look like
    class scores ([N, classes] floats; not unit-length rows with negative entries, which
    are embeddings); None for other outputs."""
    tally = Top1Tally()
    tally.add(ref, test)
    return tally.result()


@dataclass
class Top1Tally:
    """`top1_agreement` over rows that arrive batch by batch (an LM head's logits are
    megabytes a sample: joining them held copies of them all)."""

    agree: int = 0
    rows: int = 0
    scores: bool = True  # every batch is [N, classes] floats
    negative: bool = False  # some score is negative
    unit: bool = True  # every row has unit length

    def add(self, ref: np.ndarray, test: np.ndarray) -> None:
        if ref.ndim != 2 or ref.shape[1] < 2 or not np.issubdtype(ref.dtype, np.floating) or not len(ref):
            self.scores = False
            return
        self.negative |= bool(ref.min() < 0)
        self.unit &= bool(np.allclose(np.linalg.norm(ref.astype(np.float64), axis=1), 1.0, atol=1e-3))
        self.agree += int(np.count_nonzero(ref.argmax(1) == test.argmax(1)))
        self.rows += len(ref)

    def result(self) -> float | None:
        if not self.scores or not self.rows or (self.negative and self.unit):
            return None  # not class scores; or unit-length rows with negative entries: embeddings
        return self.agree / self.rows


def class_labels(labels: Any, samples: int, classes: int | None = None) -> np.ndarray:
    """The first `samples` of `labels`, checked: one class index per sample, at least one
    for each sample evaluated, each a class of the `classes` the model scores (labels of
    another numbering would score 0% top-1 for float and quantized alike, and a relative
    target would pass)."""
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a column of indices
    if y.ndim == 1 and (y.dtype.kind == "b" or y.dtype.kind == "f" and np.array_equal(y, np.round(y))):
        y = y.astype(np.int64)  # binary labels, class indices saved as floats
    if y.ndim != 1 or y.dtype.kind not in "iu":
        hint = ("; for one-hot labels pass labels.argmax(1)" if y.ndim == 2 else
                "; give integer class indices (.astype(int64))" if y.ndim == 1 else "")
        raise CalibrationDataError(f"labels must be one class index per sample, got an array of shape {list(y.shape)} "
                                   f"and dtype {y.dtype}{hint}")
    if len(y) < samples:
        raise CalibrationDataError(f"{len(y)} labels for {samples} evaluation samples; give one label per sample")
    y = y[:samples]
    if classes is not None and y.size and (int(y.min()) < 0 or int(y.max()) >= classes):
        raise CalibrationDataError(f"labels run from {int(y.min())} to {int(y.max())}, but the model scores {classes} "
                                   f"classes (0 to {classes - 1}); give labels in the model's numbering")
    return y


def _metrics(
    refs: dict[str, np.ndarray], tests: dict[str, np.ndarray], labels: np.ndarray | None, kernels: str,
    samples: int | None = None, rows: Collection[str] = (), follows: Mapping[str, str] | None = None,
) -> Comparison:
    """`samples`: the samples compared, where outputs of different lengths were joined as
    rows (`joined`: the outputs named in `rows`) and their length is no longer the count;
    those get no top-1 agreement or accuracy (a row is no sample's class scores), nor do
    the outputs a selection op picks (`follows`)."""
    follows = follows or {}
    rows = {*rows, *follows}
    names = list(refs)
    result = Comparison(samples=len(refs[names[0]]) if samples is None else samples, kernels=kernels)
    # the class scores labels are scored on: the first float output (an sklearn classifier's
    # probabilities after its labels), as the search scores (`selection.scored_index`)
    scored = names[scored_index([refs[n].dtype.kind == "f" for n in names])] if names else None
    for n in names:
        r, t = refs[n], tests[n]
        if r.dtype.kind != "f":  # indices, flags, class names: equal or not, no signal figures
            result.outputs.append(OutputMetrics(n, float("nan"), float("nan"), equal=float(np.mean(r == t)),
                                                follows=follows.get(n)))
            continue
        metrics = OutputMetrics(n, sqnr_db(r, t), cosine(r, t), None if n in rows else top1_agreement(r, t),
                                follows=follows.get(n))
        if metrics.top1_agreement is not None and labels is not None and n == scored:
            y = class_labels(labels, len(r), r.shape[1] if r.ndim == 2 else None)
            result.float_accuracy = float(np.mean(r.argmax(1) == y))
            result.quant_accuracy = float(np.mean(t.argmax(1) == y))
        result.outputs.append(metrics)
    return result


@dataclass
class StreamedOutput:
    """SQNR and cosine of one output summed batch by batch, as `sqnr_db` and `cosine`
    compute them on the whole arrays (an LLM's logits are too many to hold)."""

    noise: float = 0.0
    signal: float = 0.0
    dot: float = 0.0
    tested: float = 0.0

    def add(self, ref: np.ndarray, test: np.ndarray) -> None:
        r, t = ref.astype(np.float64), test.astype(np.float64)
        self.noise += float(np.sum((r - t) ** 2))
        self.signal += float(np.sum(r * r))
        self.dot += float(np.sum(r * t))
        self.tested += float(np.sum(t * t))

    def metrics(self, name: str) -> OutputMetrics:
        sqnr = float("inf") if self.noise == 0 else 10.0 * np.log10(max(self.signal, 1e-30) / self.noise)
        denom = np.sqrt(self.signal * self.tested)
        return OutputMetrics(name, float(sqnr), float(self.dot / denom) if denom else 1.0)


def _progress(batches: Iterable[dict[str, np.ndarray]], enabled: bool | None) -> Iterable[dict[str, np.ndarray]]:
    if enabled is False:
        return batches
    return tqdm(batches, desc="compare", unit="batch", leave=False, disable=None)


def compare_models(
    float_model: str | os.PathLike | bytes,
    quant_model: str | os.PathLike | bytes,
    data: Any,
    labels: np.ndarray | None = None,
    max_samples: int | None = None,
    batch_size: int = 32,
    providers: list[str] | None = None,
    kernels: str = "deployed",
    progress: bool | None = None,
) -> Comparison:
    """Run both models on `data` (any calibration-data source) and compare their outputs.

    `kernels`: `deployed` (default session, what users get), `reference` (no fused int8
    kernels) or `both` (deployed, with the reference figures in `.reference`).
    """
    if kernels not in KERNELS:
        raise OnnxqError(f"unknown kernels {kernels!r}; use one of: {', '.join(KERNELS)}")
    providers = check_providers(providers or ["CPUExecutionProvider"])
    float_proto = structure(float_model)  # read once: for its opsets and its quantized ops
    ref = float_session(float_model, float_proto, providers)
    runs = {"deployed": kernels in ("deployed", "both"), "reference": kernels in ("reference", "both")}
    extended = imports_extended(quant_model)  # read once: a file is parsed whole
    sessions = {k: opened("quantized", lambda k=k: deployed_session(quant_model, providers, reference=k == "reference",
                                                                       extended=extended))
                for k, on in runs.items() if on}
    inputs = [i.name for i in ref.get_inputs()]
    names = result_outputs((o.name for o in ref.get_outputs()), inputs)
    if is_decoder(inputs):
        data = decoder_feeds(float_model, data, providers, decode_steps=0)  # token windows: full feeds
    _check_interface(ref, next(iter(sessions.values())))
    outputs: dict[str, dict[str, list[np.ndarray]]] = {k: {n: [] for n in names} for k in ("float", *sessions)}
    source = CalibrationSource(data)
    # An LLM on token windows: next-token perplexity, and the outputs' figures summed batch by
    # batch (a window's logits are T x vocabulary floats: SmolLM2's 256 x 49152 are 50 MB)
    streamed = isinstance(data, DecoderFeeds) and LOGITS in names
    tokens = {k: NextToken() for k in ("float", *sessions)} if streamed else None
    sums = {k: {n: StreamedOutput() for n in names} for k in sessions}
    samples = 0
    float_graph = ir.from_proto(float_proto).graph if float_proto is not None else None
    specs = session_inputs(ref, recurrent_axes(float_graph) if float_graph is not None else None)
    follows = selected_outputs(float_graph) if float_graph is not None else {}
    picked = {n: [0, 0] for n in names if n in follows}  # rows each model picked, float and quantized
    mismatched: set[str] = set()  # picked outputs of another shape in some batch: counted, not compared
    for feed in _progress(iter_batches(source, specs, batch_size, max_samples, kind="evaluation"), progress):
        got = {}
        for kind, session in (("float", ref), *sessions.items()):
            run = run_on_data(session, names, feed, "evaluation") if kind == "float" else \
                run_quantized(session, names, feed)
            got[kind] = dict(zip(names, run))
        for n in names:
            if n in picked:  # as many rows as each model picked: the counts are the figure where they differ
                shapes = {np.shape(got[k][n]) for k in ("float", *sessions)}
                picked[n][0] += len(got["float"][n]) if np.ndim(got["float"][n]) else 1
                picked[n][1] += max(len(got[k][n]) if np.ndim(got[k][n]) else 1 for k in sessions)
                if len(shapes) > 1:
                    mismatched.add(n)
                continue
            check_same_shape(n, got["float"][n], [got[k][n] for k in sessions])
        samples += feed_samples(feed, specs)  # of the inputs: an output may be [seq, N, ...] or unbatched
        if not streamed:
            for kind, values in got.items():
                for n, y in values.items():
                    outputs[kind][n].append(y)
            continue
        for kind in sessions:
            for n in names:
                sums[kind][n].add(got["float"][n], got[kind][n])
        ids = feed[data.inputs.ids]
        if scores_tokens(got["float"][LOGITS].shape, ids.shape):
            for kind, counter in tokens.items():
                counter.add(got[kind][LOGITS], ids, None if kind == "float" else got["float"][LOGITS])
    if streamed:
        results = {k: Comparison(samples, [sums[k][n].metrics(n) for n in names], kernels=k) for k in sessions}
    else:
        differ = {n: (picked[n][0], picked[n][1]) for n in names if n in mismatched}
        kept = [n for n in names if n not in differ]
        arrays = {k: {n: joined(per[n]) for n in kept} for k, per in outputs.items()}
        rows = {n for n in kept if ragged(outputs["float"][n])}  # joined as rows: no class scores per sample
        results = {k: _metrics(arrays["float"], arrays[k], labels, k, samples, rows, follows) for k in sessions}
        for result in results.values():
            result.outputs += [OutputMetrics(n, float("nan"), float("nan"), follows=follows[n], rows_differ=counts)
                               for n, counts in differ.items()]
    result = results.get("deployed") or results["reference"]
    result.reference = results.get("reference") if "deployed" in results else None
    result.labels_unused = labels is not None and result.float_accuracy is None
    if runs["reference"] and isinstance(quant_model, str | os.PathLike | bytes):  # what a reference run cannot unfuse
        proto = structure(quant_model)
        result.integer_kernels = proto is not None and any(integer_kernel(n) for n in proto.graph.node)
    result.ignored = sorted(source.ignored)
    result.float_quantized = _quantized_ops(float_proto)
    result.extended = extended
    if tokens is not None and tokens["float"].tokens:
        result.next_token = (tokens["float"], tokens["deployed" if "deployed" in tokens else "reference"])
    return result


def ragged(batches: list[np.ndarray]) -> bool:
    """Whether an output's batches differ beyond their first axis (token files of other
    lengths): `joined` then makes rows of them, which are no samples."""
    return len({b.shape[1:] for b in batches}) > 1


def joined(batches: list[np.ndarray]) -> np.ndarray:
    """An output's batches end to end; a scalar output (a loss, a count) one value a batch.
    Batches of different lengths (token sequences of another length per file) are joined
    as rows of their last axis, or flat where that differs too: figures summed over
    elements are the same, and the float and quantized outputs are joined alike (their
    batches' shapes match). They had raised numpy's concatenation error."""
    if not batches[0].ndim:
        return np.stack(batches)
    if not ragged(batches):
        return np.concatenate(batches)
    if batches[0].ndim > 1 and len({b.shape[-1] for b in batches}) == 1:
        return np.concatenate([b.reshape(-1, b.shape[-1]) for b in batches])
    return np.concatenate([b.ravel() for b in batches])


def _quantized_ops(proto: onnx.ModelProto | None) -> str | None:
    """What shows the model is quantized (`graph.quantized`), None for a float model (or
    one that cannot be read: the comparison is made, this is only a note)."""
    if proto is None:
        return None
    try:
        ops = quantized_ops(ir.serde.deserialize_model(proto))
    except Exception:  # noqa: BLE001
        return None
    return describe(ops) if ops else None


def run_model(model: str | os.PathLike, data: Any, max_samples: int | None = None,
              providers: list[str] | None = None, batch_size: int = 32) -> dict[str, np.ndarray]:
    """Every output of `model` over `data`, concatenated, in a default session (onnxq's
    extended ops registered for a qdq-ext model; `onnxq run`); token windows for a KV-cache
    decoder get its mask and empty cache built, as `compare` does (the present cache is
    left out of the outputs)."""
    providers = check_providers(providers or ["CPUExecutionProvider"])
    proto = structure(model)  # read once: for its extended ops and its recurrent inputs
    session = deployed_session(model, providers, extended=extends(proto))
    names = [o.name for o in session.get_outputs()]
    inputs = [i.name for i in session.get_inputs()]
    if is_decoder(inputs):
        data = decoder_feeds(model, data, providers, decode_steps=0)
        names = result_outputs(names, inputs)
    outputs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    recurrent = recurrent_axes(ir.from_proto(proto).graph) if proto is not None else None
    for feed in iter_batches(data, session_inputs(session, recurrent), batch_size, max_samples, kind="input"):
        for n, y in zip(names, run_on_data(session, names, feed, "input")):
            outputs[n].append(y)
    if not outputs[names[0]]:
        raise OnnxqError("the data holds no sample")
    return {n: joined(v) for n, v in outputs.items()}


def _check_interface(ref: ort.InferenceSession, quant: ort.InferenceSession) -> None:
    """The quantized model must take the float model's inputs and give its outputs (a
    quantized model of another model is a user mistake, not a crash in onnxruntime)."""
    same = "compare a quantized model with the float model it came from"
    have = {o.name for o in quant.get_outputs()}
    missing = [o.name for o in ref.get_outputs() if o.name not in have]
    if missing:
        raise ModelError(f"the quantized model has no output {missing[0]!r} (its outputs: {', '.join(sorted(have))}); "
                         + same)
    takes = {i.name: i for i in quant.get_inputs()}
    for spec in ref.get_inputs():
        other = takes.get(spec.name)
        if other is None:
            raise ModelError(f"the quantized model has no input {spec.name!r} (its inputs: "
                             f"{', '.join(sorted(takes))}); " + same)
        clash = len(other.shape) != len(spec.shape) or any(
            isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(spec.shape, other.shape))
        if clash or other.type != spec.type:
            raise ModelError(f"input {spec.name!r} is {other.type} {_dims(other.shape)} in the quantized model but "
                             f"{spec.type} {_dims(spec.shape)} in the float model; " + same)


def _dims(shape: list) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in shape) + "]"


def check_same_shape(name: str, ref: np.ndarray, tests: list[np.ndarray]) -> None:
    for test in tests:
        if test.shape != ref.shape:
            raise ModelError(f"output {name!r} has shape {list(test.shape)} in the quantized model but "
                             f"{list(ref.shape)} in the float model; compare a quantized model with the float "
                             "model it came from")


def _format_figures(c: Comparison, label: str) -> list[str]:
    lines = []
    for m in c.outputs:
        follows = (f" (the rows a {m.follows} picks and orders: near-equal candidates swapped change them with the "
                   "same picks, so these figures do not measure the picks)") if m.follows else ""
        if m.rows_differ is not None:
            lines.append(f"  {m.name}{label}: the {m.follows} picked {m.rows_differ[0]} rows in float and "
                         f"{m.rows_differ[1]} quantized over the samples: not compared row by row")
            continue
        if m.equal is not None:
            lines.append(f"  {m.name}{label}: {m.equal:.2%} of its elements equal (not a float output){follows}")
            continue
        extra = f", top-1 agreement {m.top1_agreement:.2%}" if m.top1_agreement is not None else ""
        lines.append(f"  {m.name}{label}: SQNR {m.sqnr_db:.1f} dB, cosine {m.cosine:.5f}{extra}{follows}")
    if c.float_accuracy is not None:
        lines.append(f"  top-1 accuracy{label}: float {c.float_accuracy:.2%}, quantized {c.quant_accuracy:.2%}")
    return lines


def kept_positions(mask: Any, leading: tuple[int, ...]) -> np.ndarray | None:
    """Where an output whose first axes are `leading` ([samples, positions]) is read: the
    positions a 0/1 `attention_mask` [samples, positions] keeps (padding's outputs go
    unread, and a quantized model may move them far). None where the mask is not such a
    mask of those axes (an additive mask, another shape, no mask): every position counts."""
    if mask is None or np.ndim(mask) != 2 or len(leading) < 3 or tuple(leading[:2]) != np.shape(mask):
        return None
    keep = np.asarray(mask)
    return keep != 0 if np.isin(keep, (0, 1)).all() else None


# How a qdq-ext model runs: its extended ops from onnxq.runtime, every other op onnxruntime's.
EXTENDED_SESSION = "onnxq.runtime, stock kernels elsewhere"


def format_comparison(c: Comparison) -> str:
    """Deployed figures first; reference-kernel figures labelled as such."""
    what = ("default onnxruntime session (deployed kernels)" if c.kernels == "deployed"
            else "reference kernels (no fused int8 kernels: not what a default session runs)")
    if c.extended and c.kernels == "deployed":
        what = f"session with onnxq's extended ops registered ({EXTENDED_SESSION})"
    lines = [f"compared on {c.samples} samples, quantized model in a {what}"]
    lines += _format_figures(c, "")
    if c.next_token is not None:
        base, quant = c.next_token
        lines.append(f"  next-token perplexity on {base.tokens} tokens: float {base.perplexity():.3f}, quantized "
                     f"{quant.perplexity():.3f} ({quant.perplexity() / base.perplexity() - 1:+.1%}); most likely "
                     f"next token as float's: {quant.agreement():.1%}")
    if c.ignored:
        lines.append(f"  note: left out {', '.join(c.ignored)} from the data (no model input; --labels KEY "
                     "scores top-1 accuracy against one)")
    if c.integer_kernels:
        lines.append("  note: the quantized model holds integer kernels (QOperator format), which have no reference "
                     "form: its reference figures run the same kernels")
    if c.labels_unused:
        lines.append("  note: labels given, but the first output is no class scores ([samples, classes]): top-1 "
                     "accuracy not scored; the figures above compare the outputs")
    if c.float_quantized:
        lines.append(f"  note: the first model, taken as the float one, is quantized ({c.float_quantized}): "
                     "give the float model first, then the quantized one")
    if c.reference is not None:
        lines += _format_figures(c.reference, " [reference kernels]")
        gap = c.kernel_gap()
        if gap:
            lines.append(gap)
    return "\n".join(lines)
