"""What a run returns: the quantized model with its summary, and, when asked, the state
emission started from, to emit again under another config (an accuracy target's trials)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir

from onnxq.calibrate.observers import observer_class
from onnxq.calibrate.runner import observe
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import Config
from onnxq.optimize.context import RunSettings
from onnxq.optimize.registry import Entry
from onnxq.optimize.runner import run_algorithms
from onnxq.pipeline.calibration import within_ranges
from onnxq.pipeline.emission import emit_loadable, layer_biases, trial_emitter
from onnxq.plan import QuantPlan, plan_quantization
from onnxq.plan.edges import with_edges
from onnxq.plan.strategies.static import FLOAT_TYPES
from onnxq.report import Summary
from onnxq.target import TargetProfile


@dataclass
class PipelineState:
    """What emission started from, kept when asked (`keep_state`): the float model after
    the passes and calibration, and everything needed to emit it again under another
    config with the same ranges (a mixed-precision trial) or to analyse against it. The
    model, ranges and statistics are its own copies, so nothing the run goes on to change
    reaches them; `emit` adds to its ranges the tensors a new plan needs calibrated. The
    calibration data handle (in `settings`) is the run's."""

    float_model: ir.Model
    ranges: dict[str, tuple[float, float]]
    statistics: dict[Statistic, Any]
    settings: RunSettings
    keep_float: Mapping[str, str]
    target: TargetProfile
    algorithms: tuple[Entry, ...]
    edges: list[str] = dataclasses.field(default_factory=list)  # the run's edge layers (`plan/edges.py`)

    def emit(self, config: Config) -> ir.Model:
        """The model emitted under `config` (node overrides of the original one) with the
        calibrated ranges: tensors the new plan needs but nobody calibrated stay float."""
        model = self.float_model.clone()
        # The run's edge layers, not recomputed: a trial's promotions to float would move them.
        config, _ = with_edges(config, model, self.edges)
        plan = plan_quantization(model, config, self.keep_float, self.target)
        missing = {n: spec for n, spec in plan.calibrated_tensors().items() if n not in self.ranges}
        if missing and self.settings.access.readable:
            # A tensor no plan calibrated before (the input of a node whose producer was
            # raised to float): calibrate it as a run of this config would, and with it, where
            # its observer reduces inside the session (a reduction each, no memory), every
            # other float tensor such a trial could ask, where the config observes every tensor
            # alike (`_observed_alike`): one tensor at a time, CoaT-lite's search ran 60
            # calibration passes, 238 of its 850 s.
            spec = next(iter(missing.values()))
            if observer_class(spec.calib_method).min_max_only and _observed_alike(config):
                missing = {**{n: spec for n in float_tensors(model.graph) if n not in self.ranges}, **missing}
            self.ranges.update(observe(model, missing, self.settings.data, self.settings.calibration,
                                       False).result().ranges)
        plan = within_ranges(plan, self.ranges)
        statistics = dict(self.statistics)
        biases = layer_biases(model, plan)
        done = run_algorithms(model, plan, self.ranges, self.algorithms, self.settings,
                              trial_emitter(self.settings, statistics), statistics)
        model, _, _, _ = emit_loadable(model, done.plan, self.ranges, config, done.weights, self.keep_float,
                                    self.target, self.statistics, biases=biases)
        return model


def float_tensors(graph: ir.Graph) -> list[str]:
    """The main graph's float activations a static recipe reads (`static.FLOAT_TYPES`): its
    inputs and its nodes' outputs."""
    values = [*graph.inputs, *(v for node in graph for v in node.outputs)]
    return [v.name for v in values if v.name and v.dtype in FLOAT_TYPES and not v.is_initializer()]


def _observed_alike(config: Config) -> bool:
    """Whether no node or op-type override of `config` sets how activations are observed
    (a method, its options or bins): every tensor is then observed as any other, and one
    that a trial needs anew may be calibrated beside another's ask. An override's entropy
    would otherwise take the first ask's method."""
    overrides = [*config.layer_quant_config.values(), *config.layer_type_quant_config.values()]
    return not any(getattr(tensors, field) is not None for q in overrides
                   for tensors in (q.input_tensors, q.output_tensors) if tensors is not None
                   for field in ("calib_method", "calib_options", "num_bins"))


@dataclass
class QuantizationResult:
    """The quantized model, the summary, and the calibrated range of every tensor."""

    ir_model: ir.Model
    summary: Summary
    ranges: dict[str, tuple[float, float]]
    plan: QuantPlan
    state: PipelineState | None = None
    # The config `quantize()` was given, as it read it (a default preset picked for the
    # model where it named none); an accuracy target's promotions are in the summary's;
    # the latency plan puts the config it chose here (`search/latency.py`).
    config: Config | None = None

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        return ir.to_proto(self.ir_model)
