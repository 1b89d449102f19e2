"""The model as emission will lay it out, for algorithms that measure it before the end
of the pipeline: empirical bias correction, AdaRound/AdaQuant's quantized inputs and
their model-level check. QDQ (`emit_qdq`; qdq-ext's own rounding and types where the
config asks for it), and float8 activations laid out and centred per
channel as `emit_model` does: measured without the centring, the means fit another model
(empirical bias correction on MobileNet FP8_E4M3: 13.1 -> 6.9 dB)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from onnxq.emit.float8 import make_float8_deployable
from onnxq.emit.float8_center import center_float8
from onnxq.emit.qdq import emit_qdq
from onnxq.numerics.qmath import is_float8
from onnxq.plan import QuantPlan
from onnxq.plan.params import WeightCache


def emit_trial(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], *,
               weights: WeightCache, qdq_domain: str, extended: bool, statistics: Mapping[Any, Any]) -> None:
    """Rewrite `model` in place as emission will (QDQ or qdq-ext; float8 laid out and
    centred), with the run's Q/DQ domain and format, the weights the algorithms quantized
    so far, and the calibration pass's `statistics` (float8 channel means)."""
    emit_qdq(model, plan, dict(ranges), qdq_domain, weights, extended)
    if any(is_float8(t.spec.dtype) for t in plan.tensors.values()):
        make_float8_deployable(model)
        center_float8(model, statistics)
