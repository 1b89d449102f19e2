"""Check the emitted model against the float one on a few calibration samples.

A recipe can be far worse on one model than on others (float8 activations through a deep
CNN, per-tensor weights on depthwise layers); the summary says so at once, measured as the
model deploys (a default onnxruntime session), rather than leaving it to a later
`onnxq compare`. The float outputs come from the calibration session, which computes
them on its first batches anyway (`calibrate/capture.py`); where no
calibration ran (weight-only and dynamic recipes, statistics or ranges files, a deferred
pass), from the user's model (their file, or the model they passed), opened after
emission when the pipeline's float weights are gone, one sample at a time. Either is held
up to `REFERENCE_BYTES`; the figures are on samples the ranges were calibrated on, so they
flatter held-out data a little.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.access import Access, data_access, refusal
from onnxq.calibrate.capture import CapturedOutputs
from onnxq.calibrate.data import CalibrationSource, InputSpec, iter_batches
from onnxq.calibrate.decoder import PRESENT
from onnxq.calibrate.session import refusal as ort_refusal
from onnxq.evaluate import (
    EXTENDED_SESSION,
    Top1Tally,
    kept_positions,
)
from onnxq.sessions import deployed_options, imports_extended, open_any

REFERENCE_BYTES = 64 << 20
# Worst-output SQNR below which the summary warns: the outputs are then off by more than
# a third of their magnitude (MobileNet v1: float8 activations 6.5 dB, int8 24 dB).
WARN_DB = 10.0
# The output types the check compares, as the model and as onnxruntime's session name them.
FLOAT_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)
FLOAT_OUTPUTS = tuple(f"tensor({t.name.lower()})" for t in FLOAT_DTYPES)


@dataclass
class Reference:
    """Feeds and the float model's floating-point outputs on them: `samples` samples, one
    a feed or whole calibration batches."""

    feeds: list[dict[str, np.ndarray]]
    outputs: list[list[np.ndarray]]
    names: list[str]
    samples: int = 0
    capped: bool = False  # the memory cap, not the data or the samples asked, ended it


@dataclass
class Fidelity:
    """The worst output's figures over the checked samples."""

    samples: int
    output: str
    outputs: int
    sqnr_db: float
    cosine: float
    top1_agreement: float | None
    extended: bool = False  # a qdq-ext model: its extended ops ran through onnxq.runtime
    # algorithms that fitted the weights to these samples (`registry.fits_data`): the figures
    # then read that fit (per-tensor MobileNet after AdaRound: 21.5 dB here, 12 dB on
    # held-out images), and the line says so
    fitted_by: tuple[str, ...] = ()
    asked: int = 0  # the samples asked for, where the float outputs' memory cap held fewer
    # the selection op (NonMaxSuppression, TopK ...) whose picked and ordered rows the
    # reported output holds, where every output does (`graph/selection.py`): its figures
    # are then no measure of it, and no warning is given on them
    follows: str | None = None

    def line(self) -> str:
        which = f"worst of {self.outputs} outputs, '{self.output}'" if self.outputs > 1 else f"output '{self.output}'"
        top1 = f", top-1 agreement {self.top1_agreement:.0%}" if self.top1_agreement is not None else ""
        session = f"extended ops registered: {EXTENDED_SESSION}" if self.extended else "default onnxruntime session"
        fitted = (f"; {', '.join(self.fitted_by)} fitted the model to these samples, so this reads the fit: held-out "
                  "data (`onnxq compare FLOAT QUANT --data HELD_OUT`) gives the deployed figure") if self.fitted_by else ""
        capped = (f" of the {self.asked} asked: the float outputs held for it stop at {REFERENCE_BYTES >> 20} MB"
                  if self.samples < self.asked else "")
        follows = (f"; '{self.output}' holds the rows a {self.follows} picks and orders: near-equal candidates "
                   "swapped change it row by row with the same picks, so these figures do not measure it (score "
                   "the picks your own way, by IoU say)") if self.follows else ""
        return (f"check on {self.samples} calibration samples{capped} ({session}): {which}: "
                f"SQNR {self.sqnr_db:.1f} dB, cosine {self.cosine:.4f}{top1}{fitted}{follows}")

    def warning(self) -> str | None:
        if self.sqnr_db >= WARN_DB or self.follows:
            return None
        return (f"output '{self.output}' is far from the float model's (SQNR {self.sqnr_db:.1f} dB); "
                "`onnxq analyze FLOAT QUANT --data DATA` names the tensors that lose it, and "
                "--accuracy-target (e.g. 'sqnr>=20') raises the sensitive layers")


def float_reference(model: str | os.PathLike | bytes | ir.Model, inputs: list[InputSpec], data: CalibrationSource,
                    samples: int, providers: list[str]) -> Reference | None:
    """The float `model`'s outputs on the first `samples` samples of `data`, batched as
    `inputs` (the model's, as calibration read them) say; None when there is nothing to
    check (no samples asked, no data, data that can be read only once, no floating-point
    output) or the float model cannot run: the check never stops a run."""
    found = reference_or_failure(model, inputs, data, samples, providers)
    return found if isinstance(found, Reference) else None


def reference_or_failure(model: str | os.PathLike | bytes | ir.Model, inputs: list[InputSpec],
                         data: CalibrationSource, samples: int, providers: list[str]) -> Reference | str | None:
    """`float_reference`, or onnxruntime's refusal where the float model failed to open or
    to run on the samples (the check says why it was skipped)."""
    if samples <= 0 or not data_access(data).rereadable:
        return None
    try:
        return _reference(model, inputs, data, samples, providers)
    except Exception as exc:  # noqa: BLE001  onnxruntime and the data raise several unrelated types
        return ort_refusal(str(exc) or type(exc).__name__)


def _reference(model: str | os.PathLike | bytes | ir.Model, inputs: list[InputSpec], data: CalibrationSource,
               samples: int, providers: list[str]) -> Reference | None:
    session = _lean_session(model, providers)
    names = [o.name for o in session.get_outputs() if o.type in FLOAT_OUTPUTS]
    if not names:
        return None
    reference, held = Reference([], [], names), 0
    for feed in iter_batches(data, inputs, 1, samples, purpose="the output check"):
        outputs = session.run(names, feed)
        reference.feeds.append(feed)
        reference.outputs.append(outputs)
        held += sum(a.nbytes for a in outputs) + sum(np.asarray(a).nbytes for a in feed.values())
        if held >= REFERENCE_BYTES:
            reference.capped = True
            break
    reference.samples = len(reference.feeds)
    return reference if reference.feeds else None


def _lean_session(model: str | os.PathLike | bytes | ir.Model, providers: list[str]) -> ort.InferenceSession:
    """The float model in a session that holds its weights once: no prepacked copies, no
    arena kept at its peak (an LLM's float session otherwise costs twice its file)."""
    options = deployed_options(extended=imports_extended(model))
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = False
    return open_any(model, options, providers)


def measure(session: ort.InferenceSession, reference: Reference,
            follows: Mapping[str, str] | None = None) -> Fidelity | str | None:
    """The quantized model (`session`) against `reference`; the output with the lowest
    SQNR is the one reported (a decoder's KV-cache outputs only where it has no other;
    outputs that `follows` a selection op only where every output does). A
    model that loads but fails to run gives a warning instead;
    outputs whose shapes depend on the data (and differ) are not compared, and positions
    where the float output is not finite, or that the feed's attention mask hides, are left
    out."""
    # A decoder's KV-cache outputs (present.N.key|value) feed the next step, not the user: the
    # logits are what its check reports (SmolLM2 W4 headlined present.29.value at 5.8 dB).
    cache = [PRESENT.match(n) is not None for n in reference.names]
    reported = [i for i, is_cache in enumerate(cache) if not is_cache or all(cache)]
    tallies = {i: _Tally() for i in reported}
    for feed, outputs in zip(reference.feeds, reference.outputs):
        try:
            tests = session.run(reference.names, feed)
        except Exception as exc:  # noqa: BLE001  onnxruntime raises several unrelated types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            return f"warning: the quantized model loads but failed to run on a calibration sample: {first}"
        for i, tally in tallies.items():  # each batch's outputs summed as they come: none are held
            tally.add(feed, np.asarray(outputs[i]), np.asarray(tests[i]))
    follows = follows or {}
    measured = [f for i, tally in tallies.items()
                if (f := tally.figures(reference.names[i], len(reported), reference.samples)) is not None]
    judged = [f for f in measured if f.output not in follows] or measured
    worst = min(judged, key=lambda f: f.sqnr_db, default=None)
    if worst is None or worst.output not in follows:
        return worst
    return dataclasses.replace(worst, follows=follows[worst.output], top1_agreement=None)  # rows, not class scores


def _unmasked(feed: dict[str, np.ndarray], ref: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A per-position output ([batch, sequence, ...]) at the positions the feed's
    `attention_mask` keeps (`kept_positions`; MiniLM S8S8: 9.3 dB over every position,
    Spearman within 0.1 of float)."""
    keep = kept_positions(feed.get("attention_mask"), ref.shape)
    return (ref, test) if keep is None else (ref[keep], test[keep])


# Values per float64 slice of the check's sums (8 MB each side).
CHUNK = 1 << 20


@dataclass
class _Tally:
    """One output's figures summed batch by batch in float64: SQNR and cosine over the
    positions `_unmasked` keeps where the float output is finite, top-1 agreement over the
    whole outputs. Joined, eight samples of a 32000-word LM head's logits (8 MB each) held
    700 MB of float64 copies, 5x the rest of that model's quantize."""

    signal: float = 0.0
    noise: float = 0.0
    dot: float = 0.0
    energy: float = 0.0
    overflow: bool = False  # the quantized model is not finite where float is
    reshaped: bool = False  # a batch's quantized output has another shape (data-dependent)
    trailing: set = dataclasses.field(default_factory=set)  # each batch's shape but the first axis
    top1: Top1Tally = dataclasses.field(default_factory=Top1Tally)

    def add(self, feed: dict[str, np.ndarray], ref: np.ndarray, test: np.ndarray) -> None:
        if ref.shape != test.shape:
            self.reshaped = True
            return
        self.trailing.add(ref.shape[1:] if ref.ndim else None)
        self.top1.add(ref, test)
        kept_ref, kept_test = (a.ravel() for a in _unmasked(feed, ref, test))
        for start in range(0, kept_ref.size, CHUNK):  # float64 copies of a slice at a time
            r = kept_ref[start:start + CHUNK].astype(np.float64)
            t = kept_test[start:start + CHUNK].astype(np.float64)
            finite = np.isfinite(r)
            if not finite.all():
                r, t = r[finite], t[finite]
            if not np.all(np.isfinite(t)):
                self.overflow = True
                return
            diff = r - t
            self.noise += float(diff @ diff)
            self.signal += float(r @ r)
            self.dot += float(r @ t)
            self.energy += float(t @ t)

    def figures(self, name: str, outputs: int, samples: int) -> Fidelity | None:
        """None where the shapes depend on the data (not compared)."""
        if self.reshaped:
            return None
        if self.overflow:
            sqnr, cos = -float("inf"), 0.0
        else:
            sqnr = float("inf") if self.noise == 0 else 10.0 * float(np.log10(max(self.signal, 1e-30) / self.noise))
            if self.signal == 0 or self.energy == 0:  # a model that outputs zeros where float did not lost it all
                cos = 1.0 if self.signal == self.energy else 0.0
            else:
                cos = self.dot / (np.sqrt(self.signal) * np.sqrt(self.energy))
                cos = float(cos) if np.isfinite(cos) else 0.0
        # batches of any size count together where the rest of their shapes agree; a scalar has no top-1
        top1 = self.top1.result() if len(self.trailing) == 1 and None not in self.trailing else None
        return Fidelity(samples, name, outputs, sqnr, cos, top1)


# The check by default: this many samples, on models up to this many bytes of weights
# (above, the float session it opens costs about the model's size again: +0.8 GB on a
# 135M-parameter LLM); an explicit check_samples runs it on any model.
CHECK_SAMPLES, CHECK_AUTO_BYTES = 8, 256 << 20


def samples_to_check(asked: int | None, model_bytes: int, data: CalibrationSource,
                     ranges_from: str | None = None, file_bytes: int = 0) -> tuple[int, str | None]:
    """Samples the check runs on (0: none), with a note when the data cannot be read again,
    the model's size alone skips it, or activations calibrated from `ranges_from` (statistics
    or ranges files) left no samples to run (none when the user turned the check off).
    `file_bytes`: the float model's size as the summary gives it, said in the note (the
    weights in memory can be more: a tied table's folded transpose; LLM trial)."""
    access = data_access(data)
    if not access.rereadable:
        if access is Access.ONCE and asked != 0:  # unless the user turned the check off
            return 0, f"output check skipped: {refusal(access)} (the data is a {type(data.source).__name__})"
        if asked and access is Access.NONE:  # asked for, with no data to run: say so
            return 0, (f"output check skipped: calibration.check_samples {asked} runs on calibration samples, and "
                       "none were given; pass calibration_data")
        # on a model past CHECK_AUTO_BYTES data alone would not run it (big-model trial)
        also = (f" and calibration.check_samples {CHECK_SAMPLES} (on a model past {CHECK_AUTO_BYTES >> 20} MB of "
                "weights the check is asked for)" if model_bytes > CHECK_AUTO_BYTES
                else "")
        if ranges_from and asked is None and access is Access.NONE:
            return 0, (f"output check skipped: the activations' ranges came from {ranges_from}, with no samples "
                       f"to run; pass calibration_data as well{also} to check the output against float")
        if access is Access.NONE and asked is None:  # a data-free recipe (W8_DYNAMIC, weight-only) said nothing
            return 0, (f"output not checked: no data given; pass calibration_data{also} to check it against float "
                       f"on {CHECK_SAMPLES} samples")
        return 0, None
    if asked is not None:
        return asked, None
    if model_bytes <= CHECK_AUTO_BYTES:
        return CHECK_SAMPLES, None
    return 0, (f"output check skipped: the float model ({(file_bytes or model_bytes) / 1e6:.0f} MB) would be opened in a "
               f"second session to check against, about its size again in memory; calibration.check_samples "
               f"{CHECK_SAMPLES} runs it")


def check_outputs(source: str | os.PathLike | onnx.ModelProto | ir.Model, inputs: list[InputSpec],
                  session: ort.InferenceSession, data: CalibrationSource, samples: int,
                  providers: list[str], extended: bool = False,
                  captured: CapturedOutputs | None = None,
                  follows: Mapping[str, str] | None = None) -> Fidelity | str | None:
    """The emitted model (open in `session`) against the float model on the first
    `samples` samples: its outputs as calibration `captured` them where it kept that many
    (no second float session), else the user's model (`source`, opened only now: the float
    weights the pipeline loaded are gone, so the check adds one float session to the
    quantized model, not two copies); `extended`: the emitted model holds onnxq's extended
    ops (the figures say how it ran); `follows`: the outputs a selection op picks
    (`graph/selection.py`)."""
    if captured is not None and samples > 0 and (captured.samples >= samples or captured.complete or captured.spent):
        reference: Reference | None = Reference(captured.feeds, captured.outputs, captured.names, captured.samples,
                                                capped=captured.spent and not captured.complete)
    else:
        float_model = source.SerializeToString() if isinstance(source, onnx.ModelProto) else source
        found = reference_or_failure(float_model, inputs, data, samples, providers)
        if isinstance(found, str):  # say why (the check never stops a run)
            try:
                _lean_session(float_model, providers)
            except Exception as exc:  # noqa: BLE001  onnxruntime raises several unrelated types
                return (f"output check skipped: onnxruntime cannot open the float model as given "
                        f"({ort_refusal(str(exc) or type(exc).__name__)}); the quantized model itself loads")
            return f"output check skipped: the float model failed on a calibration sample ({found})"
        reference = found
    checked = None if reference is None else measure(session, reference, follows)
    asked = samples if reference is not None and reference.capped and reference.samples < samples else 0
    return dataclasses.replace(checked, extended=extended, asked=asked) if isinstance(checked, Fidelity) else checked
