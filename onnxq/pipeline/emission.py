"""Stage 4 in the run: emit the plan, open the result as a deployment would, and keep in
float what onnxruntime refuses; and the trial emitter the algorithms measure with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import Config
from onnxq.emit import EmitResult, emit_model
from onnxq.emit.loadcheck import (
    UNLOADABLE,
    Trial,
    find_culprits,
    load_error,
    model_loads,
    open_deployed,
)
from onnxq.emit.trial import emit_trial
from onnxq.graph import layout
from onnxq.graph.edit import set_constant
from onnxq.graph.fold import constant_array
from onnxq.graph.upcast import Upcast, restore_half_weights
from onnxq.notes import Note, Topic
from onnxq.optimize.bias_layers import bias_add
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


# A quantized layer's float bias before the algorithms corrected it: the node holding it
# (the layer, or the Add after a MatMul), its input index, and its value (None: it had none).
Biases = Mapping[str, tuple[str, int, np.ndarray | None]]
BIASED = frozenset({"Conv", "ConvTranspose", "Gemm"})


def layer_biases(model: ir.Model, plan: QuantPlan) -> dict[str, tuple[str, int, np.ndarray | None]]:
    """The float bias of every quantized Conv, ConvTranspose and Gemm (input 2) and MatMul
    (the constant of the Add that alone reads its output), copied before the algorithms
    (bias correction, AdaRound's re-fit) rewrite them for the rounding of their layer."""
    biases: dict[str, tuple[str, int, np.ndarray | None]] = {}
    for node in model.graph:
        if node.name not in plan.quantized_nodes:
            continue
        if node.op_type in BIASED:
            value = node.inputs[2] if len(node.inputs) > 2 else None
            array = constant_array(value) if value is not None else None
            if value is None or array is not None:
                biases[node.name] = (node.name, 2, None if array is None else array.copy())
        elif node.op_type == "MatMul" and (w := constant_array(node.inputs[1])) is not None and w.ndim == 2 \
                and (found := bias_add(node, layout.out_channels(node, w.shape))) is not None:
            add, index = found  # bias correction's own reading of a MatMul's bias
            biases[node.name] = (add.name, index, constant_array(add.inputs[index]).copy())
    return biases


def _restore_biases(model: ir.Model, biases: Biases, names: set[str]) -> None:
    """Give the layers `names` (now kept float) their biases as they were before the
    algorithms: a correction for rounding they no longer have would only add error."""
    nodes = {node.name: node for node in model.graph}
    for name in names & set(biases):
        holder, index, array = biases[name]
        node = nodes.get(holder)
        current = constant_array(node.inputs[index]) if node is not None and index < len(node.inputs) \
            and node.inputs[index] is not None else None
        if current is None:
            continue
        if array is None and index == len(node.inputs) - 1:  # a bias bias correction added: gone again
            node.resize_inputs(index)
            continue
        set_constant(model.graph, node, index, np.zeros_like(current) if array is None else array, f"{holder}_bias")


def emit_loadable(
    model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], config: Config,
    weights: WeightCache, keep_float: Mapping[str, str], target: TargetProfile,
    statistics: Mapping[Statistic, Any], prepack: bool = True, biases: Biases | None = None,
    upcast: Upcast | None = None,
) -> tuple[ir.Model, EmitResult, ort.InferenceSession | None, list[Note]]:
    """Emit, then open the result as a deployment would; if onnxruntime refuses it, keep
    the nodes responsible float (found by re-emitting from a copy, the other nodes' learned
    roundings kept, the float nodes' `biases` as before the algorithms: `layer_biases`)
    instead of writing it. Also returns the session that opened it (for the output check)
    and a note on the nodes kept float that way. `weights`: those the algorithms quantized;
    `statistics`: the calibration pass's, measured before any algorithm ran (float8
    centring); `upcast`: a half model's load, whose weights left float are stored in their
    type again (`graph/upcast.py`)."""
    pristine = model.clone()
    emitted = emit_model(model, plan, ranges, config, weights, target.runs_on_cpu(), statistics)
    halves = restore_half_weights(model, upcast.weights) if upcast is not None else 0
    said_half = [Note(Topic.LOAD, upcast.note(halves))] if upcast is not None else []
    providers = config.calibration.providers
    session = open_deployed(model, providers, prepack=prepack)
    if session is not None:
        return model, emitted, session, said_half
    said = load_error(model, providers, prepack=prepack)
    order = [node.name for node in pristine.graph if node.name in plan.quantized_nodes]

    def trial(kept: set[str]) -> Trial:
        copy = pristine.clone()
        _restore_biases(copy, biases or {}, kept)
        keep = {**keep_float, **{name: UNLOADABLE for name in kept}}
        new_plan = within_ranges(plan_quantization(copy, config, keep, target), ranges)
        result = emit_model(copy, new_plan, ranges, config, weights, target.runs_on_cpu(), statistics)
        if upcast is not None:
            restore_half_weights(copy, upcast.weights)
        return Trial(copy, model_loads(copy, providers, prepack=prepack), result)

    final, culprits = find_culprits(order, trial, lambda m: load_error(m, providers, prepack=prepack))
    note = Note(Topic.FLOAT, f"{len(culprits)} nodes kept float because onnxruntime could not load them quantized: "
                + ", ".join(culprits[:5]) + (", ..." if len(culprits) > 5 else "")
                + (f" (onnxruntime: {said})" if said else ""), tuple(culprits))
    return final.model, final.payload, open_deployed(final.model, providers, prepack=prepack), [*said_half, note]
