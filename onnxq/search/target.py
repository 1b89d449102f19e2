"""Accuracy targets (`top1>=float-0.5`, `cosine>=0.999`) and the metrics that score a model.

Every score comes from the model loaded in a default onnxruntime session (what deploys).
Built-in metrics: `top1` (percent of labels matched by the first output's argmax),
`cosine` (mean per-sample cosine of the first output against the float model's) and
`sqnr` (dB of the first output against the float model's). `custom` is a caller's
`evaluate(session) -> float`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxq.calibrate.data import CalibrationSource, iter_batches
from onnxq.calibrate.decoder import decoder_feeds
from onnxq.calibrate.session import run_on_data
from onnxq.config.accuracy import AccuracyTarget, parse_target  # noqa: F401 (parse_target: its old home, for importers)
from onnxq.config.spec import DEFAULT_LABELS
from onnxq.errors import CalibrationDataError, ConfigError, OnnxqError, closest_name
from onnxq.evaluate import (
    class_labels,
    joined,
    kept_positions,
    ragged,
    row_cosines,
    sqnr_db,
)
from onnxq.graph.selection import session_scored
from onnxq.sessions import session_inputs

# The score of the float model against itself, for metrics measured against it.
SELF_SCORE = {"cosine": 1.0, "sqnr": math.inf}

Evaluate = Callable[[ort.InferenceSession], float]


@dataclass(frozen=True)
class Scored:
    """A model's score and each evaluation sample's part in it, in the score's direction
    (top1: 100 where the label is matched; cosine: the sample's cosine; sqnr: minus the
    sample's noise energy), so two models' paired differences say whether one is better
    beyond the eval set's noise (`gain.py`); None where the metric is the caller's. `metric`
    names the built-in metric, which sets the least gain worth a rung (`gain.least_gain`)."""

    value: float
    samples: np.ndarray | None = None
    metric: str | None = None


@dataclass
class EvalSet:
    """The evaluation data, its labels and the float model's first output on it."""

    data: Any
    labels: np.ndarray | None
    max_samples: int | None
    batch_size: int = 16
    reference: np.ndarray | None = None
    # Elements of each batch in the joined first output, where batches differ in shape
    # (sequences of other lengths): each batch is then one sample of the score (`_per_batch`).
    ragged: list[int] | None = None
    # the float model's `inputs.recurrent_axes`: how its inputs are batched (a time-major
    # LSTM's on axis 1), which a session does not show
    recurrent: dict[str, int] | None = None

    def batches(self, session: ort.InferenceSession) -> Iterator[dict[str, np.ndarray]]:
        return iter_batches(self.data, session_inputs(session, self.recurrent), self.batch_size, self.max_samples,
                            kind="evaluation")

    def positions(self, session: ort.InferenceSession) -> np.ndarray | None:
        """Where a per-position first output ([samples, positions, ...]) is scored: the
        tokens each sample's attention mask keeps (`kept_positions`), as the output check
        scores them (MiniLM S8S8: 8.9 dB over every position, 12.8 dB over the kept ones);
        None where every position counts."""
        masks = [feed.get("attention_mask") for feed in self.batches(session)]
        if self.reference is None or any(np.ndim(m) != 2 for m in masks) or len({np.shape(m)[1] for m in masks}) != 1:
            return None  # no mask, or batches of different lengths (no one array of outputs either)
        return kept_positions(np.concatenate([np.asarray(m) for m in masks]), self.reference.shape)

    def first_output(self, session: ort.InferenceSession, user_model: bool = False) -> np.ndarray:
        """The scored output (the first float one, `selection.scored_index`) over the data; with `user_model` (the float model), a batch
        it cannot run on is the data's fault (`run_on_data`), else onnxq's."""
        name = session_scored(session)
        got = [(run_on_data(session, [name], feed, "evaluation") if user_model else session.run([name], feed))[0]
               for feed in self.batches(session)]
        self.ragged = [b.size for b in got] if ragged(got) else None
        return joined(got)


def load_eval_set(source: Any, labels_key: str, max_samples: int | None = None, model: Any = None,
                  providers: list[str] | None = None) -> EvalSet:
    """An evaluation set from a path or arrays: the `labels_key` array (when there is one)
    split off the model inputs. Token windows for a KV-cache decoder at path `model` become
    its full feeds, one prefill of each window (`calibrate/decoder.py`)."""
    labels = None
    if isinstance(source, str | os.PathLike) and Path(source).suffix == ".npz":
        if not Path(source).is_file():
            raise CalibrationDataError(f"evaluation data file not found: {source}")
        with np.load(source) as npz:
            source = {k: npz[k] for k in npz.files}
    if isinstance(source, dict) and labels_key in source:
        source = dict(source)
        labels = np.asarray(source.pop(labels_key))
    elif isinstance(source, dict) and labels_key != DEFAULT_LABELS:  # a key the user named, not there
        hint = closest_name(labels_key, sorted(source))
        raise CalibrationDataError(f"labels {labels_key!r} not in the evaluation data, whose arrays are "
                                   f"{', '.join(sorted(source))}" + (f"; did you mean {hint!r}?" if hint else
                                                                      "; give --labels the labels array's name"))
    feeds = decoder_feeds(model, source, providers, decode_steps=0)
    # a reader is rewound between reads only by the one source that counts them
    return EvalSet(source if feeds is source else CalibrationSource(feeds), labels, max_samples)


def _matched(out: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per sample, whether the first output's argmax is the label."""
    if out.ndim != 2:
        raise CalibrationDataError(f"top1 needs class scores [batch, classes] as the first output; "
                                   f"got shape {out.shape}; use --metric cosine or sqnr")
    return out.argmax(1) == class_labels(labels, len(out), out.shape[1])


def _top1(out: np.ndarray, labels: np.ndarray) -> float:
    return _top1_scored(out, labels).value


def _top1_scored(out: np.ndarray, labels: np.ndarray) -> Scored:
    matched = _matched(out, labels)
    return Scored(100.0 * float(np.mean(matched)), 100.0 * matched, "top1")


def _kept_only(ref: np.ndarray, out: np.ndarray, kept: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Both outputs with the positions the attention mask drops set to 0 (padding's values,
    inf included, left out); `kept` [samples, positions], None where every position counts."""
    if kept is None:
        return ref, out
    where = kept[(...,) + (None,) * (ref.ndim - 2)]
    return np.where(where, ref, 0), np.where(where, out, 0)


def _cosine(ref: np.ndarray, out: np.ndarray, kept: np.ndarray | None = None) -> Scored:
    """The mean over samples of each sample's cosine, over its `kept` positions where
    given ([samples, positions], True where the attention mask keeps a token)."""
    ref, out = _kept_only(ref, out, kept)
    cos = row_cosines(ref.reshape(len(ref), -1), out.reshape(len(out), -1))
    return Scored(float(np.mean(cos)), cos, "cosine")


def _checked(evaluate: Evaluate) -> Evaluate:
    """`evaluate` whose every score must be one finite number (None, NaN, a string or an
    array gave raw TypeErrors or a misleading "relative target" error)."""
    def score(session: ort.InferenceSession) -> float:
        got = evaluate(session)
        try:
            value = float(got)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value) or isinstance(got, bool | np.bool_):
            shown = repr(got) if not isinstance(got, np.ndarray) else f"an array of shape {got.shape}"
            raise ConfigError(f"evaluate= returned {shown[:80]}; it must return one finite number per model (a "
                              "float: higher is better for >=, lower for <=)")
        return value

    return score


def measurer(target: AccuracyTarget, evalset: EvalSet,
             evaluate: Evaluate | None) -> Callable[[ort.InferenceSession], Scored]:
    """The function that scores a session for `target`, with each sample's part (`Scored`)."""
    metric = target.metric
    if evaluate is not None and metric in (None, "custom"):
        checked = _checked(evaluate)
        return lambda session: Scored(checked(session))
    if evaluate is not None:  # scored otherwise, it would be called never, without a word
        raise ConfigError(f"evaluate= is given, but accuracy target {target.describe()!r} scores {metric}: write "
                          f"custom{target.describe().removeprefix(metric)} to score with evaluate, or leave it out")
    if metric == "custom":
        raise ConfigError(f"accuracy target {target.describe()!r} scores with your own function, and none was given: "
                          "pass quantize(..., evaluate=fn) from Python (fn(session) -> a number), or name a metric "
                          "(top1, cosine, sqnr)")
    if metric is None:
        given = target.describe().removeprefix("custom").removeprefix(">=")  # as written: no metric
        raise ConfigError(f"accuracy target {given!r} names no metric: write one in it (top1>={given}) or give "
                          "--metric top1|cosine|sqnr; a custom metric needs quantize(..., evaluate=fn) from Python")
    if metric == "top1":
        if evalset.labels is None:
            raise CalibrationDataError("metric top1 needs labels: an --eval-data .npz holding a "
                                       "'labels' array (or --labels KEY), or use --metric cosine")
        return lambda session: _top1_scored(_one_shape(evalset, evalset.first_output(session)), evalset.labels)
    compare = _cosine if metric == "cosine" else _sqnr

    kept: list[np.ndarray | None] = []  # the eval data's, read on the first call

    def score(session: ort.InferenceSession) -> Scored:
        if not kept:
            kept.append(evalset.positions(session))
        out = evalset.first_output(session)
        if evalset.ragged is not None:
            return _per_batch(metric, evalset.reference, out, evalset.ragged)
        return compare(evalset.reference, out, kept[0])

    return score


def _one_shape(evalset: EvalSet, out: np.ndarray) -> np.ndarray:
    """`out`, where the batches had one shape: top-1 scores each sample's class scores."""
    if evalset.ragged is not None:
        raise OnnxqError("metric top1 scores each sample's class scores, and the first output differs in shape "
                         "between evaluation batches (sequences of other lengths); give evaluation data of one "
                         "shape, or use --metric sqnr or cosine")
    return out


def _per_batch(metric: str, ref: np.ndarray, out: np.ndarray, sizes: list[int]) -> Scored:
    """The score of joined outputs from batches of other shapes (a speech set's utterances
    of other lengths), each batch one sample of it and of its paired test: sqnr over every
    element, each batch's part minus its noise energy; cosine the mean of each batch's."""
    cuts = np.cumsum(sizes)[:-1]
    refs, outs = np.split(ref.ravel(), cuts), np.split(out.ravel(), cuts)
    if metric == "sqnr":
        noise = np.array([float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(refs, outs)])
        return Scored(sqnr_db(ref, out), -noise, "sqnr")
    cos = np.array([float(row_cosines(r[None], o[None])[0])
                    for r, o in zip(refs, outs)])
    return Scored(float(np.mean(cos)), cos, "cosine")


def _sqnr(ref: np.ndarray, out: np.ndarray, kept: np.ndarray | None) -> Scored:
    value = sqnr_db(ref, out) if kept is None else sqnr_db(ref[kept], out[kept])
    ref, out = _kept_only(ref, out, kept)
    noise = ((ref.astype(np.float64) - out) ** 2).reshape(len(ref), -1).sum(axis=1)
    return Scored(value, -noise, "sqnr")


def float_score(target: AccuracyTarget, score: Evaluate, float_session: ort.InferenceSession,
                evalset: EvalSet) -> float:
    """The float model's own score (1.0 / inf for metrics measured against it; top1 from
    its outputs already in `evalset.reference`, not a second pass)."""
    if target.metric in SELF_SCORE:
        return SELF_SCORE[target.metric]
    if target.metric == "top1" and evalset.reference is not None and evalset.labels is not None:
        return _top1(evalset.reference, evalset.labels)
    return score(float_session)
