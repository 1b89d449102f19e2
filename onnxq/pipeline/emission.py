"""Stage 4 in the run: emit the plan, open the result as a deployment would, and keep in
float what onnxruntime refuses; and the trial emitter the algorithms measure with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import Config
from onnxq.emit import EmitResult, emit_model
from onnxq.emit.loadcheck import UNLOADABLE, Trial, find_culprits, model_loads, open_deployed
from onnxq.emit.trial import emit_trial
from onnxq.notes import Note, Topic
from onnxq.optimize.context import RunSettings, TrialEmitter
from onnxq.pipeline.calibration import within_ranges
from onnxq.plan import QuantPlan, plan_quantization
from onnxq.plan.params import WeightCache
from onnxq.target import TargetProfile


def trial_emitter(settings: RunSettings, statistics: Mapping[Statistic, Any]) -> TrialEmitter:
    """The emission the algorithms measure the model with: the run's format and Q/DQ
    domain, float8 centred with the calibration pass's `statistics` (measured before any
    algorithm ran), as the final emission will."""
    def emit(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
             weights: WeightCache) -> None:
        emit_trial(model, plan, ranges, weights=weights, qdq_domain=settings.qdq_domain,
                   extended=settings.extended, statistics=statistics)

    return emit


def emit_loadable(
    model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], config: Config,
    weights: WeightCache, keep_float: Mapping[str, str], target: TargetProfile,
    statistics: Mapping[Statistic, Any], prepack: bool = True,
) -> tuple[ir.Model, EmitResult, ort.InferenceSession | None, list[Note]]:
    """Emit, then open the result as a deployment would; if onnxruntime refuses it, keep
    the nodes responsible float (found by re-emitting from a copy) instead of writing it.
    Also returns the session that opened it (for the output check) and a note on the nodes
    kept float that way. `weights`: those the
    algorithms quantized; `statistics`: the calibration pass's, measured before any
    algorithm ran (float8 centring)."""
    pristine = model.clone()
    emitted = emit_model(model, plan, ranges, config, weights, target.runs_on_cpu(), statistics)
    providers = config.calibration.providers
    session = open_deployed(model, providers, prepack=prepack)
    if session is not None:
        return model, emitted, session, []
    order = [node.name for node in pristine.graph if node.name in plan.quantized_nodes]

    def trial(kept: set[str]) -> Trial:
        copy = pristine.clone()
        keep = {**keep_float, **{name: UNLOADABLE for name in kept}}
        new_plan = within_ranges(plan_quantization(copy, config, keep, target), ranges)
        result = emit_model(copy, new_plan, ranges, config, cpu=target.runs_on_cpu(), statistics=statistics)
        return Trial(copy, model_loads(copy, providers, prepack=prepack), result)

    final, culprits = find_culprits(order, trial)
    note = Note(Topic.FLOAT, f"{len(culprits)} nodes kept float because onnxruntime could not load them quantized: "
                + ", ".join(culprits[:5]) + (", ..." if len(culprits) > 5 else ""), tuple(culprits))
    return final.model, final.payload, open_deployed(final.model, providers, prepack=prepack), [note]
