"""`analyze_models`: where a quantized model loses accuracy, tensor by tensor and layer by layer.

One pass over the data runs three sessions side by side, batch by batch, and keeps only
running sums (memory does not grow with the number of samples):

- the float model, with each layer of the quantized model copied beside it and fed from
  float tensors (`isolate.py`): the error each layer adds on its own;
- the quantized model with its quantized tensors exposed: the error each tensor carries
  with everything before it quantized too (exposing a tensor keeps onnxruntime from
  fusing the Q/DQ around it, so these figures use reference arithmetic there);
- the quantized model in a default session, as it deploys: the error of the outputs.

Weight-only kernels (MatMulNBits) are isolated the same way, in passes over groups of them
(`grouped.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from tqdm import tqdm

from onnxq.analyze.accumulate import AgreementStats, ErrorStats, RangeStats
from onnxq.analyze.grouped import kernel_layers, measure_in_groups
from onnxq.analyze.impact import (
    IMPACT_OUTPUT_BYTES,
    IMPACT_SAMPLES,
    RANK_PASSES,
    impact_order,
    layers_to_measure,
    noise_db,
)
from onnxq.analyze.isolate import PREFIX, IsolatedLayer, add_isolated_layers, with_only
from onnxq.analyze.qgraph import QuantizedActivation, bounded, layers, quantized_activations
from onnxq.analyze.rescaled import rescaled_layers
from onnxq.calibrate.data import CalibrationSource, feed_samples, iter_batches
from onnxq.calibrate.decoder import decoder_feeds, result_outputs
from onnxq.calibrate.inputs import recurrent_axes
from onnxq.calibrate.session import check_providers, exposed_session, run_quantized
from onnxq.errors import ModelError
from onnxq.evaluate import (
    check_same_shape,
    joined,
)
from onnxq.graph.edit import values_by_name
from onnxq.graph.load import load_model, read_model
from onnxq.graph.quantized import describe, extended_ops, integer_kernel, quantized_ops
from onnxq.graph.save import weight_bytes, write_text_atomic
from onnxq.graph.selection import (
    FLOAT_TYPES,
    first_output_pick,
    scored_output,
    selected_outputs,
    session_scored,
)
from onnxq.sessions import deployed_options, deployed_session, session_inputs

ModelLike = str | os.PathLike | onnx.ModelProto | ir.Model
# How the layer table is ordered: by each layer's effect on the model's output when it
# alone is quantized (the accuracy search's rule), or by its channels' own noise (fast).
RANKS = ("output", "noise")


@dataclass
class TensorReport:
    """One quantized activation: its error with every tensor before it quantized too, and
    how its float values sit in the range its Q/DQ represents."""

    name: str
    dtype: str
    sqnr_db: float
    cosine: float
    max_abs_error: float
    used_range: tuple[float, float]
    calibrated_range: tuple[float, float]
    saturation: float  # fraction of float values outside the calibrated range
    histogram: dict[str, list[float]] = field(default_factory=dict)  # edges, counts


@dataclass
class LayerReport:
    """One layer: the error it adds alone (`own_*`) and with its prefix quantized (`prefix_*`)."""

    name: str
    op_type: str
    own_sqnr_db: float
    own_cosine: float
    own_max_abs_error: float
    prefix_sqnr_db: float | None
    prefix_cosine: float | None
    relative_noise: float  # noise / signal of the layer alone
    # mean over its output channels of each channel's noise / signal, alone ('ch noise'):
    # the order of the layers the output ranking did not measure
    channel_noise: float
    # SQNR of the model's first output with this layer alone quantized ('output dB'): the
    # ranking key (`impact.py`, the accuracy search's rule); None where not measured
    output_sqnr_db: float | None = None


@dataclass
class OutputReport:
    name: str
    sqnr_db: float
    cosine: float
    max_abs_error: float
    top1_agreement: float | None = None


@dataclass
class Analysis:
    """Per-tensor and per-layer figures, worst first; outputs as a default session runs them."""

    samples: int
    tensors: list[TensorReport]
    layers: list[LayerReport]
    outputs: list[OutputReport]
    notes: list[str] = field(default_factory=list)
    method: str = ("layers alone: integer kernels as deployed; tensors with prefix: tensors exposed, "
                   "their Q/DQ unfused (reference arithmetic); outputs: default onnxruntime session")
    ranked_samples: int | None = None  # the samples the output ranking ran on (its first ones)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; an infinite SQNR (no error at all) becomes null."""
        return json_safe(self)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            write_text_atomic(path, text)
        return text


def json_safe(value: Any) -> Any:
    """JSON-safe data: dataclasses as dicts, tuples as lists, numpy scalars as Python
    numbers, NaN and infinities as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "item") and not isinstance(value, str | bytes):  # numpy scalar
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def _float_reference(float_model: ModelLike, quant: ir.Model, normalised: bool) -> ir.Model:
    """The float model normalised as the quantizer saw it (same opset, constants folded; a
    float16 model float32 inside, as the analysis quantizes its tensors, `graph/upcast.py`)."""
    if normalised and isinstance(float_model, ir.Model):
        return float_model.clone()
    opset = quant.opset_imports.get("", 13)
    model, _ = load_model(float_model, opset, upcast=lambda _model: True)
    return model


def analyze_models(
    float_model: ModelLike,
    quant_model: ModelLike,
    data: Any,
    *,
    max_samples: int | None = None,
    batch_size: int = 8,
    providers: list[str] | None = None,
    progress: bool | None = None,
    normalised: bool = False,
    layers_only: bool = False,
    rank: str = "output",
) -> Analysis:
    """Measure `quant_model` against `float_model` on `data` (any calibration-data source).

    `normalised`: `float_model` is the model the quantizer emitted from (after its
    passes), so tensors rescaled by a pass (CLE) still match by name. `layers_only`:
    measure only the layers alone (one session; what a sensitivity ranking needs), in the
    order of their channels' noise; otherwise the layers are ranked by what each alone does
    to the model's output (`impact.py`), re-reading the first IMPACT_SAMPLES samples;
    `rank="noise"` keeps the channels' noise order without that (a model per measured
    layer: MiniLM's 47 measured layers cost about 30 s more than the pass itself).
    """
    if rank not in RANKS:
        raise ValueError(f"rank must be one of {', '.join(RANKS)}, got {rank!r}")
    providers = check_providers(providers or ["CPUExecutionProvider"])
    data = decoder_feeds(float_model, data, providers, decode_steps=0)  # an LLM's token windows: its full feeds
    quant = read_model(quant_model)
    reference = _float_reference(float_model, quant, normalised)
    pristine = None if layers_only or rank == "noise" else reference.clone()  # the float model for the output ranking
    swapped = None if normalised else quantized_ops(reference)  # before the isolated layers are added to it
    if not normalised and not quantized_ops(quant) and not extended_ops(quant):  # nothing per layer or tensor
        raise ModelError(("the arguments look swapped: the first model is quantized, the second is not; give the float "
                          "model first, then the quantized one") if swapped else
                         "the second model has no QuantizeLinear/DequantizeLinear or integer kernel, so no layer or "
                         "tensor to analyze; give the quantized model onnxq wrote (for output figures alone: onnxq "
                         "compare)")
    _same_outputs(reference, quant)
    float_values = values_by_name(reference.graph)
    quantized = [] if layers_only else quantized_activations(quant)
    activations = [a for a in quantized if a.name in float_values]
    found = layers(quant)
    kernels = [] if layers_only else kernel_layers(quant)  # the search ranks the plan's Q/DQ nodes only
    clean = reference.clone() if kernels else None  # before the Q/DQ layers' copies are added to it
    floats = {v.name for v in reference.graph.outputs if v.dtype in FLOAT_TYPES}  # labels, names: no signal
    graph_outputs = [] if layers_only else [n for n in result_outputs((v.name for v in reference.graph.outputs),
                                                                      (v.name for v in reference.graph.inputs))
                                            if n in floats]
    picked = selected_outputs(reference.graph)  # before the layers' copies are added to it
    recurrent = recurrent_axes(reference.graph)  # how its inputs are batched, which a session does not show
    isolated, skipped = add_isolated_layers(reference, quant, found)
    notes = []
    if skipped:
        notes.append(f"{len(skipped)} layers not isolated (their inputs or output have no counterpart in the "
                     f"float model): {', '.join(skipped[:6])}" + (", ..." if len(skipped) > 6 else ""))
    dynamic = Counter(n.op_type for n in quant.graph if n.op_type in DYNAMIC_KERNELS)
    if dynamic:
        notes.append(f"{dynamic.total()} dynamically quantized layers ({', '.join(sorted(dynamic))}) are not measured "
                     "one by one (only Q/DQ and weight-only layers are); the output figures include them")
    if not found and any(integer_kernel(n) for n in quant.graph):
        notes.append("the quantized model holds integer kernels (QOperator format), whose layers and tensors "
                     "are not measured: analyze the Q/DQ model (quantize without --format qoperator)")
    rescaled = [] if normalised else rescaled_layers(reference, quant)
    if rescaled:
        notes.insert(0, f"{len(rescaled)} layers' weights are rescaled per channel against the float model's "
                        f"({', '.join(rescaled[:3])}{', ...' if len(rescaled) > 3 else ''}: cross-layer "
                        "equalization, SmoothQuant or AWQ), so their tensors differ from the float model's by "
                        "those factors: the per-layer and per-tensor figures measure the rescaling too; the "
                        "output figures do not")
    if swapped:  # as `compare` says it
        notes.insert(0, f"the first model, taken as the float one, is quantized ({describe(swapped)}): give the "
                        "float model first, then the quantized one")
    missing = len(quantized) - len(activations)
    if missing:
        notes.append(f"{missing} quantized tensors have no tensor of the same name in the float model "
                     "(added by a pass, or the models differ): not compared")

    ref_names = list(dict.fromkeys([a.name for a in activations] + [i.reference for i in isolated]
                                   + [i.output for i in isolated] + graph_outputs))
    quant_values = values_by_name(quant.graph)
    prefix_names = {} if layers_only else {i.layer.name: i.layer.quantized_output or i.layer.output
                                           for i in isolated}
    test_names = list(dict.fromkeys([a.dequantized for a in activations]
                                    + [n for n in prefix_names.values() if n in quant_values]))

    tensor_err = {a.name: ErrorStats() for a in activations}
    ranges = {a.name: RangeStats(a.low, a.high, a.step) for a in activations}
    own = {i.layer.name: ErrorStats() for i in isolated}
    prefix = {i.layer.name: ErrorStats() for i in isolated}
    out_err = {n: ErrorStats() for n in graph_outputs}
    agreement = {n: AgreementStats() for n in graph_outputs}
    samples = 0
    with contextlib.ExitStack() as stack:
        ref_session = stack.enter_context(
            exposed_session(reference, ref_names, providers, options=deployed_options()))
        test_session = stack.enter_context(exposed_session(quant, test_names, providers)) if test_names else None
        deployed = None
        if not layers_only:
            deployed = deployed_session(quant, providers)
        out_names = [] if deployed is None else [o.name for o in deployed.get_outputs()]
        specs = session_inputs(ref_session, recurrent)
        probe = next(iter(iter_batches(data, specs, 1, 1, kind="evaluation")), None) if _rereadable(data) else None
        if probe is not None:  # one sample's exposed tensors size the batch: the pass returns them all at once
            held = sum(a.nbytes for a in run_quantized(ref_session, ref_names, probe, PREFIX))
            held += sum(a.nbytes for a in run_quantized(test_session, test_names, probe)) if test_session else 0
            batch_size = max(1, min(batch_size, EXPOSED_BYTES // max(held, 1)))
        for feed in _progress(iter_batches(data, specs, batch_size, max_samples, kind="evaluation"), progress):
            ref = dict(zip(ref_names, run_quantized(ref_session, ref_names, feed, PREFIX)))
            test = dict(zip(test_names, run_quantized(test_session, test_names, feed))) if test_session else {}
            out = dict(zip(out_names, run_quantized(deployed, out_names, feed))) if deployed is not None else {}
            for a in activations:
                seen = bounded(ref[a.name], a.bounds)
                tensor_err[a.name].update(seen, bounded(test[a.dequantized], a.bounds))
                ranges[a.name].update(seen)
            for i in isolated:
                edges, seen = i.layer.bounds, bounded(ref[i.reference], i.layer.bounds)
                own[i.layer.name].update(seen, bounded(ref[i.output], edges))
                name = prefix_names.get(i.layer.name)
                if name in test and test[name].shape == ref[i.reference].shape:
                    prefix[i.layer.name].update(seen, bounded(test[name], edges))
            for n in graph_outputs:
                if n in out and n in picked and np.shape(out[n]) != np.shape(ref[n]):
                    continue  # other numbers of picks: no row-by-row figures
                if n in out:
                    check_same_shape(n, ref[n], [out[n]])
                    out_err[n].update(ref[n], out[n])
                    agreement[n].update(ref[n], out[n])
            samples += feed_samples(feed, specs)
        del ref_session, test_session, deployed  # their weights' copies, before any other pass

    tensor_reports = [_tensor_report(a, tensor_err[a.name], ranges[a.name]) for a in activations]
    layer_reports = [_layer_report(i, own[i.layer.name], prefix[i.layer.name]) for i in isolated]
    if clean is not None:
        if _rereadable(data):
            grouped = measure_in_groups(clean, quant, kernels, data, providers, batch_size, max_samples)
            layer_reports += [_layer_report(i, grouped.own[i.layer.name], grouped.prefix[i.layer.name])
                              for i in grouped.isolated]
            if grouped.skipped:
                notes.append(f"{len(grouped.skipped)} weight-only layers not isolated (their input or output has no "
                             f"counterpart in the float model): {', '.join(grouped.skipped[:3])}"
                             + (", ..." if len(grouped.skipped) > 3 else ""))
            if not quantized:  # computed above: `clean` exists only where `layers_only` is off
                notes.append("no activation is quantized (weight-only kernels): the tensor table is empty")
        else:
            notes.append(f"{len(kernels)} weight-only layers not measured one by one: they take passes over groups "
                         "of them, and the data can be read only once (pass a path, a dict of arrays or a list of "
                         "feeds)")
        del clean
    tensor_reports.sort(key=lambda t: (t.sqnr_db, t.name))
    layer_reports.sort(key=_noise_order)
    ranked_samples = None
    first_picked = first_output_pick(reference.graph)
    if graph_picked := [n for n in graph_outputs if n in picked]:
        several = len(graph_picked) > 1
        notes.append(f"output{'s' if several else ''} {', '.join(map(repr, graph_picked))} hold{'' if several else 's'} "
                     f"the rows a {picked[graph_picked[0]]} picks and orders: near-equal candidates swapped change them "
                     "row by row with the same picks, so their figures do not measure the picks (batches where the "
                     "models picked other numbers of rows are left out)")
    if pristine is not None and layer_reports:
        if first_picked is not None:
            notes.append(f"layers ranked by their channels' noise, not by the output: the scored output, "
                         f"{scored_output(reference.graph).name!r}, holds the rows a {first_picked} picks and orders")
        elif _rereadable(data):
            layer_reports, ranked_samples = _by_output(layer_reports, pristine, quant, data, providers, batch_size,
                                                       max_samples, progress, samples)
        else:
            notes.append("layers ranked by their channels' noise, not by the output: the data can be read only "
                         "once (pass a path, a dict of arrays or a list of feeds)")
    outputs = [OutputReport(n, e.sqnr_db, e.cosine, e.max_abs, None if n in picked else agreement[n].rate)
               for n, e in out_err.items() if e.count]
    first = next((o for o in outputs if o.name == graph_outputs[0]), None) if graph_outputs else None
    if first is not None and any(r.output_sqnr_db is not None for r in layer_reports):
        layer_reports, dropped = _consistent(layer_reports, first.sqnr_db, set(rescaled))
        if dropped:
            notes.append(f"{len(dropped)} layers scored far worse alone than the whole model ({first.sqnr_db:.1f} "
                         f"dB at '{first.name}'): {', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}; "
                         "their weights were rescaled against the float model (cross-layer equalization, "
                         "SmoothQuant or AWQ) and the model with only them quantized measures the rescaling, so "
                         "they follow by ch noise; analyze against the float model the quantizer emitted from "
                         "(quantize --report) to rank them")
    return Analysis(samples, tensor_reports, layer_reports, outputs, notes, ranked_samples=ranked_samples)


# Kernels not isolated: those that quantize their activations at run time (several nodes
# each). Weight-only ones are measured in groups (`grouped.py`).
DYNAMIC_KERNELS = ("MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM")


def _same_outputs(reference: ir.Model, quant: ir.Model) -> None:
    """The quantized model must give the float model's outputs, as `compare` requires (a
    model of other outputs ranked its layers by an output the quantized one lacked)."""
    have = {v.name for v in quant.graph.outputs}
    missing = [v.name for v in reference.graph.outputs if v.name not in have]
    if missing:
        raise ModelError(f"the quantized model has no output {missing[0]!r} (its outputs: {', '.join(sorted(have))}); "
                         "analyze a quantized model with the float model it came from")


def _noise_order(r: LayerReport) -> tuple[float, str]:
    """The layers' order without the output ranking: the channels' noise, worst first."""
    return -r.channel_noise, r.name


# A layer alone cannot cost the output much more than all the layers together: its output
# dB this far under the whole model's means the single-layer model measures a rescaling
# (digits CNN after CLE: conv3 alone 11.6 dB in a model at 39.0 dB, 45.1 without CLE).
ALONE_MARGIN_DB = 6.0


def _consistent(reports: list[LayerReport], whole_db: float,
                rescaled: Collection[str] = ()) -> tuple[list[LayerReport], list[str]]:
    """`reports` with the measured layers whose output dB is `ALONE_MARGIN_DB` under the
    whole model's `whole_db`, or that are `rescaled` and whose own error exceeds their
    output (own SQNR below 0 dB: the rescaling measured, not the rounding; MobileNet-v1
    XINT8 after CLE ranked such a layer first at 5.6 dB, 5.2 under the whole model, alone
    -41 dB, and keeping it float gained 0.05 dB), unmeasured again and moved among the
    unmeasured (by ch noise); their names."""
    bad = [r for r in reports if r.output_sqnr_db is not None and (
        r.output_sqnr_db < whole_db - ALONE_MARGIN_DB or (r.name in rescaled and r.own_sqnr_db < 0))]
    if not bad:
        return reports, []
    for r in bad:
        r.output_sqnr_db = None
    measured = [r for r in reports if r.output_sqnr_db is not None]
    rest = sorted((r for r in reports if r.output_sqnr_db is None), key=_noise_order)
    return measured + rest, [r.name for r in bad]


# The bytes of exposed tensors one batch of the analysis's pass may hold: every layer's
# reference and isolated output and every quantized tensor come back at once (CoaT-lite
# Tiny, 355 layers of [8, 3137, 64] at batch 8: 6.7 GB, the accuracy search's peak),
# measured on one probe sample.
EXPOSED_BYTES = 1 << 30


def _rereadable(data: Any) -> bool:
    """Whether `data` can be read again after the analysis's pass."""
    return (data if isinstance(data, CalibrationSource) else CalibrationSource(data)).replayable


def _by_output(reports: list[LayerReport], float_model: ir.Model, quant: ir.Model, data: Any,
               providers: list[str], batch_size: int, max_samples: int | None,
               progress: bool | None, analysed: int | None = None) -> tuple[list[LayerReport], int]:
    """`reports` (in their channels' noise order) ranked by what each layer alone does to
    the first output (`impact.impact_order`, as the accuracy search ranks them: the model
    with only that layer quantized, `isolate.with_only`, on the first IMPACT_SAMPLES
    samples in a default session), with each measured layer's `output_sqnr_db` set, and the
    number of samples that ranking ran on."""
    by_name = {r.name: r for r in reports}
    found = {layer.name: layer for layer in [*layers(quant), *kernel_layers(quant)]}
    samples = min(max_samples or IMPACT_SAMPLES, IMPACT_SAMPLES)
    names = [r.name for r in reports]
    limit = layers_to_measure(weight_bytes(float_model), analysed, samples)
    recurrent = recurrent_axes(float_model.graph)
    bar = tqdm(total=min(limit, len(names)), desc="rank layers", unit="layer", leave=False,
               disable=True if progress is False else None)

    fed: list[int] = []  # rows fed per run of the first output (the same on every model)

    def first_output(session: Any) -> np.ndarray:
        name, got = session_scored(session), []
        fed.append(0)
        specs = session_inputs(session, recurrent)
        for feed in iter_batches(data, specs, batch_size, samples, kind="evaluation"):
            got.append(run_quantized(session, [name], feed)[0])
            fed[-1] += feed_samples(feed, specs)  # of the inputs: an output may be a scalar or [seq, N, ...]
            if sum(g.nbytes for g in got) >= IMPACT_OUTPUT_BYTES:  # an LLM's logits: 50 MB a window
                break
        return joined(got)

    def session_with_only(name: str) -> Any:
        bar.update(1)
        return deployed_session(with_only(float_model, quant, found[name]), providers)

    try:
        order = impact_order(names, names, first_output, deployed_session(float_model, providers),
                             session_with_only, limit)
    finally:
        bar.close()
    for name, noise in order:
        by_name[name].output_sqnr_db = noise_db(noise)
    return [by_name[name] for name, _ in order], (fed[0] if fed else 0)


def _tensor_report(a: QuantizedActivation, err: ErrorStats, rng: RangeStats) -> TensorReport:
    return TensorReport(
        a.name, a.dtype, err.sqnr_db, err.cosine, err.max_abs,
        (rng.used_min, rng.used_max), (a.low, a.high), rng.saturation,
        {"edges": [float(e) for e in rng.edges], "counts": [int(c) for c in rng.counts]},
    )


def _layer_report(i: IsolatedLayer, own: ErrorStats, prefix: ErrorStats) -> LayerReport:
    return LayerReport(
        i.layer.name, i.layer.op_type, own.sqnr_db, own.cosine, own.max_abs,
        prefix.sqnr_db if prefix.count else None, prefix.cosine if prefix.count else None,
        own.relative_noise, own.channel_relative_noise,
    )


def _progress(batches: Iterable[dict[str, np.ndarray]], enabled: bool | None) -> Iterable[dict[str, np.ndarray]]:
    if enabled is False:
        return batches
    return tqdm(batches, desc="analyze", unit="batch", leave=False, disable=None)


def tail_name(name: str, width: int) -> str:
    """`name` in `width` characters: its end, marked as cut where it is longer."""
    return name if len(name) <= width else "\u2026" + name[-width + 1:]


# Name columns widen to the names shown, up to this many characters: names are pasted into
# --exclude and layer_quant_config, and cut ones of different layers printed alike
# (MiniLM: "…/intermediate/intermediate_act_fn/Mul_1" three times).
NAME_WIDTH = (40, 100)


def _name_width(names: list[str]) -> int:
    return max(NAME_WIDTH[0], min(NAME_WIDTH[1], max((len(n) for n in names), default=0)))


def _fmt_db(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.1f}"


def _layer_order(a: Analysis) -> str:
    """What the layer table is sorted by, in words."""
    measured = sum(r.output_sqnr_db is not None for r in a.layers)
    if not measured:
        return "by ch noise, the mean over output channels of noise/signal with the layer alone quantized"
    rest = "" if measured == len(a.layers) else (f" ({measured} measured, within {RANK_PASSES} passes' worth of the "
                                                 "data or the model's weight budget; the rest by ch noise)")
    on = f" on the first {a.ranked_samples} samples" if a.ranked_samples else ""
    return (f"by output dB, the SQNR of the model's first output{on} with only that layer quantized, as the "
            f"accuracy search ranks them{rest}")


def format_analysis(a: Analysis, top: int = 15) -> str:
    """The worst layers and tensors first, as a terminal table."""
    lines = [f"analysed on {a.samples} samples ({a.method})"]
    lines.extend(f"warning: {n}" for n in a.notes if "rescaled per channel" in n)
    for o in a.outputs:
        extra = f", top-1 agreement {o.top1_agreement:.2%}" if o.top1_agreement is not None else ""
        lines.append(f"output {o.name}: SQNR {_fmt_db(o.sqnr_db)} dB, cosine {o.cosine:.5f}{extra}")
    lines.append(f"layers, most sensitive first ({min(top, len(a.layers))} of {len(a.layers)}): {_layer_order(a)}")
    w = _name_width([r.name for r in a.layers[:top]])
    ow = max([14, *(len(r.op_type) for r in a.layers[:top])])  # GatherBlockQuantized had pushed the columns out
    lines.append(f"  {'layer':<{w}} {'op':<{ow}} {'output dB':>9} {'alone dB':>9} {'w/ prefix dB':>13} {'ch noise':>9} "
                 f"{'cosine':>9}")
    for r in a.layers[:top]:
        lines.append(f"  {tail_name(r.name, w):<{w}} {r.op_type:<{ow}} {_fmt_db(r.output_sqnr_db):>9} "
                     f"{_fmt_db(r.own_sqnr_db):>9} {_fmt_db(r.prefix_sqnr_db):>13} {r.channel_noise:>9.3g} "
                     f"{r.own_cosine:>9.5f}")
    lines.append(f"tensors, worst first ({min(top, len(a.tensors))} of {len(a.tensors)}):")
    w = _name_width([t.name for t in a.tensors[:top]])
    lines.append(f"  {'tensor':<{w}} {'dB':>6} {'cosine':>9} {'max err':>9} {'used range':>22} "
                 f"{'calibrated':>22} {'clipped':>8}")
    for t in a.tensors[:top]:
        used = f"[{t.used_range[0]:.3g}, {t.used_range[1]:.3g}]"
        cal = f"[{t.calibrated_range[0]:.3g}, {t.calibrated_range[1]:.3g}]"
        lines.append(f"  {tail_name(t.name, w):<{w}} {_fmt_db(t.sqnr_db):>6} {t.cosine:>9.5f} {t.max_abs_error:>9.3g} "
                     f"{used:>22} {cal:>22} {t.saturation:>8.2%}")
    lines.extend(f"note: {n}" for n in a.notes if "rescaled per channel" not in n)
    return "\n".join(lines)

