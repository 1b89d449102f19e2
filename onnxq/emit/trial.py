"""The model as emission will lay it out, for algorithms that measure it before the end
of the pipeline: empirical bias correction, AdaRound/AdaQuant's quantized inputs and
their model-level check. The same Q/DQ steps as `emit_model` (`qdq_layout.py`), with the
run's Q/DQ domain, format and statistics given by the caller."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.emit.qdq_layout import lay_out_qdq
from onnxq.plan import QuantPlan
from onnxq.plan.params import WeightCache


def emit_trial(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], *,
               weights: WeightCache, qdq_domain: str, extended: bool,
               statistics: Mapping[Statistic, np.ndarray | None]) -> None:
    """Rewrite `model` in place as emission will (QDQ or qdq-ext; float8 laid out and
    centred): `weights` those the run's algorithms quantized, `qdq_domain` and `extended`
    the run's Q/DQ domain and format, `statistics` the calibration pass's (float8 channel
    means)."""
    lay_out_qdq(model, plan, dict(ranges), qdq_domain, weights, extended, statistics)
