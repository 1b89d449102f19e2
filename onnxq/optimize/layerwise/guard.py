"""The model-level check after layer-wise reconstruction: keep the learned weights only
if the whole model's outputs are at least as close to the float model's as with nearest
rounding, on calibration samples.

Each layer's own error always drops (a layer that does not improve keeps nearest
rounding), but the errors of many layers can still add up worse than nearest rounding's
where the quantized model is far from the float one: MobileNet with per-tensor weights,
whose depthwise layers lose whole channels, is such a case (its output SQNR falls when
every layer's own error falls). The check runs on every `validation_every`-th
calibration batch; with `hold_out` the statistics never saw them, so a model that fits
its calibration samples rather than the data fails it too. It costs one pass of three
models over those batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.session import check_providers, session_options
from onnxq.graph.selection import selected_outputs


def output_sqnr(reference: onnx.ModelProto, models: list[onnx.ModelProto], batches: Iterable[Mapping[str, Any]],
                providers: list[str]) -> list[float]:
    """SQNR in dB of each model's outputs (all outputs together, each sample's mean
    removed) against `reference`'s."""
    providers = check_providers(providers)

    def session(model: onnx.ModelProto) -> ort.InferenceSession:
        # onnxruntime's default level: the quantized models run the fused int8 kernels a
        # deployment runs, and every model the blocked-layout convolutions (MobileNet-v1's
        # per-tensor AdaRound: the check 2.1 s at the basic level, 1.0 s at this one). The
        # decision is then this CPU's, as the target's kernel probe already is.
        options = session_options(level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers)

    ref = session(reference)
    others = [session(m) for m in models]
    # outputs a selection op picks (a detector's boxes after NonMaxSuppression) only where
    # there are no others: their rows follow near-equal scores, and their count may differ
    picked = selected_outputs(ir.from_proto(reference).graph)
    names = [o.name for o in ref.get_outputs() if o.name not in picked] or [o.name for o in ref.get_outputs()]
    signal = 0.0
    noise = [0.0] * len(models)
    compared = False
    for feed in batches:
        expected = [_centred(e) for e in ref.run(names, feed)]
        got = [[_centred(g) for g in other.run(names, feed)] for other in others]
        # an output whose shape differs between the models in this batch (other numbers of picks) is left out
        kept = [j for j, e in enumerate(expected) if e is not None and all(g[j].shape == e.shape for g in got)]
        compared = compared or bool(kept)
        signal += sum(float(np.sum(np.square(expected[j]))) for j in kept)
        for i, outputs in enumerate(got):
            noise[i] += sum(float(np.sum(np.square(outputs[j] - expected[j]))) for j in kept)
    if not compared:  # no batch's outputs could be compared (every one picked other rows): no figure
        return [float("nan")] * len(models)
    return [float("inf") if n == 0 else 10 * np.log10(max(signal, 1e-30) / n) for n in noise]


def _centred(value: object) -> np.ndarray | None:
    """A float output less each sample's mean (None for other outputs): an offset shared
    by all of a sample's values (a logit bias) carries no information, and a model
    whose outputs collapse onto it must not score well."""
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
        return None
    v = value.astype(np.float64)
    return v - (v.mean(axis=tuple(range(1, v.ndim)), keepdims=True) if v.ndim > 1 else v.mean())


def keep_learned(nearest: onnx.ModelProto, learned: onnx.ModelProto, reference: onnx.ModelProto,
                 batches: Iterable[Mapping[str, Any]], providers: list[str]) -> tuple[bool, float, float]:
    """(whether the learned model is at least as close as nearest rounding's, its output
    SQNR, nearest rounding's); not where no output could be compared (NaN figures)."""
    near_db, learned_db = output_sqnr(reference, [nearest, learned], batches, providers)
    return learned_db >= near_db, learned_db, near_db
