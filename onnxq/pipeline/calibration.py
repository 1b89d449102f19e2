"""Stage 2 in the run: the calibrated ranges and statistics of the planned tensors, from
one pass over the data, a ranges file or statistics files; and the plan without what the
ranges cannot quantize."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from onnxq.calibrate.ranges_io import load_ranges, save_ranges
from onnxq.calibrate.rescale import calibrate_deferred
from onnxq.calibrate.runner import CalibrationResult, observe
from onnxq.calibrate.shards import load_stats, model_digest
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.emit.fidelity import FLOAT_DTYPES
from onnxq.emit.float8_center import centering_requests
from onnxq.notes import Note, Topic
from onnxq.numerics.qmath import MAX_QUANTIZABLE_RANGE
from onnxq.optimize.context import Deferred, Rescale, RunSettings
from onnxq.optimize.registry import Entry
from onnxq.optimize.runner import algorithm_requests, finish_deferred, without_another_read
from onnxq.plan import QuantPlan


def requests(model: ir.Model, plan: QuantPlan, algorithms: tuple[Entry, ...]) -> list[Statistic]:
    """Statistics the calibration pass collects besides ranges: the first algorithm's and
    the channel means that centre float8 activations at emission."""
    return list(dict.fromkeys([*algorithm_requests(model, plan, algorithms), *centering_requests(model, plan)]))


def file_requests(model: ir.Model, plan: QuantPlan, algorithms: tuple[Entry, ...]) -> list[Statistic]:
    """The statistics that statistics files hold (`calibrate_shard`, `calibration.stats`):
    those of the first algorithm a run without data can run (`without_another_read`),
    whether or not the run reading the files also has data, so the two agree."""
    return requests(model, plan, without_another_read(algorithms, "")[0])


def calibrate_or_load(
    model: ir.Model, plan: QuantPlan, settings: RunSettings, algorithms: tuple[Entry, ...],
    deferred: Deferred | None, check_samples: int = 0,
) -> tuple[CalibrationResult, list[Note]]:
    """Calibrate (collecting in the same pass the statistics the first algorithm and a
    deferred pass ask for, then finishing that pass), or take ranges from
    `calibration.load_ranges` or statistics from `calibration.stats`; save the ranges if
    asked. Also returns the deferred pass's report line. `check_samples`: the output
    check's; one calibration pass keeps the model's outputs on that many samples for it
    (`CapturedOutputs`)."""
    tensors = plan.calibrated_tensors()
    options: CalibrationConfig = settings.calibration
    data, progress = settings.data, settings.progress
    digest = model_digest(model) if options.load_ranges or options.save_ranges else None
    notes: list[Note] = []
    if options.load_ranges:
        ranges, samples = load_ranges(options.load_ranges, tensors, digest)
        result = CalibrationResult(ranges, samples, 0, 0)
    elif options.stats:
        wanted = file_requests(model, plan, algorithms)
        if tensors or wanted:
            result = load_stats(options.stats, model, tensors, wanted, options).result()
        else:  # nothing left to calibrate (an accuracy target's all-float candidate)
            result = CalibrationResult({}, 0, 0, 0)
    elif deferred is not None:
        def finish(found: Mapping[Statistic, Any]) -> dict[str, Rescale]:
            note, rescaled = finish_deferred(model, deferred, found)
            notes.append(note)
            return rescaled

        wanted = [*requests(model, plan, algorithms), *deferred.statistics]
        result = calibrate_deferred(model, tensors, data, options, progress, wanted, deferred.rescalable, finish)
    else:
        wanted = requests(model, plan, algorithms) if settings.access.readable else []
        outputs = [v.name for v in model.graph.outputs if isinstance(v.type, ir.TensorType) and v.dtype in FLOAT_TYPES]
        result = observe(model, tensors, data, options, progress, wanted, capture=(outputs, check_samples)).result()
    if options.save_ranges:
        save_ranges(options.save_ranges, result.ranges, tensors, result.num_samples, digest)
    return result, notes


# The output types the check compares.
FLOAT_TYPES = frozenset(FLOAT_DTYPES)


def drop_unquantizable(plan: QuantPlan, ranges: Mapping[str, tuple[float, float]]) -> tuple[QuantPlan, list[Note]]:
    """The plan without tensors whose range no integer grid can hold, and a note on them."""
    # `not <=`: a NaN range (inf - inf downstream of such a sentinel) goes too
    huge = {n for n, (lo, hi) in ranges.items() if not max(abs(lo), abs(hi)) <= MAX_QUANTIZABLE_RANGE}
    if not huge:
        return plan, []
    plan, dropped = plan.without(huge, f"calibrated range beyond +-{MAX_QUANTIZABLE_RANGE:g}")
    names = ", ".join(sorted(huge)[:3]) + (", ..." if len(huge) > 3 else "")
    return plan, [Note(Topic.FLOAT, f"{len(dropped)} tensors kept in float: range beyond +-{MAX_QUANTIZABLE_RANGE:g} "
                       f"(masking constants such as float min): {names}", tuple(sorted(huge)))]


def constant_inputs_note(model: ir.Model, ranges: Mapping[str, tuple[float, float]]) -> Note | None:
    """A warning where a float model input took one value over all the calibration data
    (all zeros): every range then fits that value, not the data the model will see, and
    the output check on those samples says nothing of it (the digits example on zeros:
    30 dB on them, 0.3 dB on real images)."""
    constant = [v.name for v in model.graph.inputs if v.name in ranges and ranges[v.name][0] == ranges[v.name][1]]
    if not constant:
        return None
    value = ranges[constant[0]][0]
    return Note(Topic.WARNING, f"warning: calibration input {', '.join(map(repr, constant))} holds one value ({value:g}) in every "
                f"sample: the ranges fit no real data; calibrate on representative samples", tuple(constant))


def within_ranges(plan: QuantPlan, ranges: Mapping[str, tuple[float, float]]) -> QuantPlan:
    """A re-made plan without what `ranges` cannot quantize: unquantizable ranges and
    tensors nobody calibrated."""
    plan, _ = drop_unquantizable(plan, ranges)
    missing = set(plan.calibrated_tensors()) - set(ranges)
    return plan.without(missing, "not calibrated")[0] if missing else plan
