"""`quantize_to_target`: quantize, then raise the most sensitive layers until a target is met.

1. Quantize with the config as given (the ladder's types widen the opset up front, so
   every trial and the final model share one opset), keeping the calibrated state.
2. Score the float model and the all-quantized model in default sessions; done if met.
3. Climb the ladder's algorithm rungs (`climb.py`: CLE, per-channel weights, AdaRound...,
   each re-quantizing the whole model, kept where the score improves); done if met. They
   cost the deployed model nothing, so they go before any layer is raised.
4. Rank layers by the output error of the model with each alone quantized
   (`sensitivity.py`; the analysis's per-layer error orders what its budget leaves).
5. Bisect the number of top-ranked layers to promote up the precision rungs (`bisect.py`);
   each trial re-emits the calibrated model under the promoted config, with no new
   calibration.
6. The result is an ordinary config (node overrides, opset pinned): the final model is
   quantized from it, so saving that config and running it again gives the same bytes.
   Where no model meets the target, it is the best model scored, or the cheapest as good
   within the eval set's noise (`unmet.py`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from tqdm import tqdm

from onnxq.analyze import analyze_models
from onnxq.analyze.impact import layers_to_measure, noise_db
from onnxq.calibrate.access import FIXES, data_access
from onnxq.calibrate.data import CalibrationSource, axes_of
from onnxq.calibrate.inputs import recurrent_axes, take_rows, whole_feed
from onnxq.config.spec import Config, MixedPrecisionConfig
from onnxq.emit.latency import fixed_batches, median_ms
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.save import check_output_path, weight_bytes
from onnxq.graph.selection import first_output_pick, scored_output
from onnxq.notes import Note, Topic, notes
from onnxq.pipeline.prepare import required_opset
from onnxq.pipeline.run import run_pipeline, write_output
from onnxq.plan import QuantPlan
from onnxq.plan.rules import OP_RULES, OutputMode
from onnxq.report import MixedPrecisionSummary, Promotion
from onnxq.search.base import search_base_config, with_calibration
from onnxq.search.bisect import Trial, bisect_promotions
from onnxq.search.climb import Climb, RungTrial, climb_algorithms
from onnxq.search.ladder import applicable, effective, with_promotions
from onnxq.search.rungs import algorithm_rungs, precision_rungs
from onnxq.search.sensitivity import impact_order
from onnxq.search.target import (
    SELF_SCORE,
    EvalSet,
    Scored,
    float_score,
    load_eval_set,
    measurer,
    parse_target,
)
from onnxq.search.unmet import Candidate, Choice, choose_unmet, raised_words
from onnxq.sessions import deployed_session, session_inputs

# Rungs that keep a raised layer in an integer type: its tensors are the ones statistics files
# hold; the float types calibrate others (`_writable`, the final model's calibration).
INTEGER_RUNGS = ("int8", "int16")
# Layers ranked on at most this many samples (one analysis pass).
SENSITIVITY_SAMPLES = 64


def _eval_set(mp: MixedPrecisionConfig, calibration_data: Any, custom: bool, model: Any,
              providers: list[str]) -> tuple[EvalSet, list[str]]:
    """The evaluation data with its labels split off; the calibration data if none is given."""
    if mp.eval_data is None:
        what = "ranks layers" if custom else "ranks layers and scores models"
        note = (f"no eval_data given: the search {what} on the calibration data "
                "(pass mixed_precision.eval_data for a held-out set)")
        return load_eval_set(calibration_data, mp.labels, mp.max_samples, model, providers), [note]
    return load_eval_set(mp.eval_data, mp.labels, mp.max_samples, model, providers), []


def promotion_order(layers: list[Any], plan: Any) -> list[tuple[str, float]]:
    """Every quantized node a rung can raise, most sensitive first. A Relu/Clip fused to the
    op before it is not a unit of its own: its error counts for that op, which takes it
    along when raised; a data-movement op (MaxPool, Slice, Pad, ...) passes on its input's
    parameters whatever its own config says, so it is raised by raising its producer, never
    alone. Nodes the analysis could not isolate come last, in graph order."""
    def raisable(node: str) -> bool:
        rule = OP_RULES.get(plan.quantized_nodes[node])
        return rule is None or rule.output is not OutputMode.SHARED or rule.quantize_constant_data

    worst: dict[str, float] = {}
    for r in layers:
        node = plan.fused_activations.get(r.name, r.name)
        if node in plan.quantized_nodes and raisable(node):
            worst[node] = max(worst.get(node, 0.0), r.channel_noise)
    ranked = sorted(worst.items(), key=lambda item: -item[1])
    rest = [(n, float("nan")) for n in plan.quantized_nodes
            if n not in worst and n not in plan.fused_activations and raisable(n)]
    return ranked + rest


def sensitivity_order(base: Any, config: Config, evalset: EvalSet, float_session: Any, top: str,
                      progress: bool | None = None) -> list[tuple[str, float]]:
    """The quantized layers of `base` (a pipeline result with its state), most harmful
    first: by the output noise of the model with each alone quantized and the others at
    rung `top` (`sensitivity.py`), the analysis's per-layer error ordering what its
    budget leaves (and its candidates: fused activations go with their op)."""
    providers = config.calibration.providers
    mp_samples = config.mixed_precision.max_samples or SENSITIVITY_SAMPLES
    analysis = analyze_models(base.state.float_model, base.ir_model, evalset.data, normalised=True,
                              max_samples=min(SENSITIVITY_SAMPLES, mp_samples), providers=providers,
                              progress=progress, layers_only=True)
    local = [name for name, _ in promotion_order(analysis.layers, base.plan)]

    def session_with_only(name: str) -> Any:
        promoted = effective({n: top for n in local if n != name}, base.plan)  # as the search will raise them
        return deployed_session(base.state.emit(with_promotions(config, promoted)), providers)

    picked = first_output_pick(base.state.float_model.graph) is not None  # no row-by-row noise to rank by
    limit = 0 if picked else layers_to_measure(weight_bytes(base.state.float_model))
    return impact_order(local, local, evalset, float_session, session_with_only, limit)


def _progress_bar(progress: bool | None, layers: int) -> Any:
    """A bar over the models the search scores (about log2(layers) + rungs of them)."""
    return tqdm(desc="search", unit="model", leave=False, disable=True if progress is False else None,
                total=max(1, layers).bit_length() + 2)


def slower_than_float(promotions: dict[str, str], after_ms: float, float_ms: float,
                      before_ms: float | None = None) -> Note | None:
    """A warning where the model the target needed runs slower than float (batch 1), with
    the likely cause: layers raised to int16, which onnxruntime's CPU runs as float ops
    between Q/DQ (a ResNet-20 with 37 layers at int16: 1.90 against float's 0.43 ms); or,
    where raising made it no slower than the all-quantized model (`before_ms`), that model
    itself (ResNet-20 W4A8: int4 convolutions have no CPU kernel, 1.13 -> 0.81 ms raised)."""
    if not promotions or _no_slower(after_ms, float_ms):
        return None
    int16 = sum(rung == "int16" for rung in promotions.values())
    if before_ms is not None and _no_slower(after_ms, before_ms):
        why = (f"the all-quantized model is slower already ({before_ms:.2f} ms; raising layers did not slow it): "
               "its kernels, not the raised layers")
    elif int16:
        why = (f"{int16} layer{'' if int16 == 1 else 's'} raised to int16 run{'s' if int16 == 1 else ''} as float "
               "ops between Q/DQ (no int16 kernels on the CPU); --ladder without int16 raises layers to float instead")
    else:
        why = "the raised layers add Q/DQ boundaries"
    return Note(Topic.WARNING, f"warning: the model the target needed runs slower than float at batch 1 "
                f"({after_ms:.2f} against {float_ms:.2f} ms): {why}")


# Times within this factor of float's count as no slower (the runs' own spread), and so
# do times within this many milliseconds: a call's own jitter, which on the bundled
# digits model (0.02 ms a run) made a raised layer read as "slower than float".
FASTER_THAN_FLOAT = 1.03
SAME_TIME_MS = 0.05


def _no_slower(ms: float, than_ms: float) -> bool:
    """Whether `ms` is no slower than `than_ms`, within the runs' spread and a call's jitter."""
    return ms <= max(FASTER_THAN_FLOAT * than_ms, than_ms + SAME_TIME_MS)


def _scored_name(graph: Any, builtin: bool) -> str:
    """Which output a built-in metric scored, where it is not the first (a classifier's
    probabilities after its labels: `selection.scored_index`)."""
    scored = scored_output(graph)
    return f", output {scored.name!r}" if builtin and scored is not None and scored is not graph.outputs[0] else ""


def _scorable(target: Any, float_model: Any) -> None:
    """Refuse a sqnr or cosine target on a first output whose rows a selection op picks
    (a detector's boxes after NonMaxSuppression): row-by-row figures do not measure the
    picks, and the models may pick different numbers of rows (it had raised numpy's
    broadcasting error)."""
    op = first_output_pick(float_model.graph)
    if op is not None and target.metric in ("sqnr", "cosine"):
        raise ConfigError(
            f"accuracy target {target.describe()!r} scores the model's first float output, "
            f"{scored_output(float_model.graph).name!r}, whose rows a {op} "
            "picks and orders: row-by-row figures do not measure the picks, and the quantized model may pick other "
            "rows; score the picks with your own function (Python: quantize(..., evaluate=fn) with a "
            "'custom>=VALUE' target, fn(session) -> mAP or mean IoU)")


def _first_sample(evalset: EvalSet, session: Any) -> dict[str, np.ndarray]:
    """One sample of the eval data: one row, or an input's fixed batch of them."""
    feed = next(iter(evalset.batches(session)))
    specs = session_inputs(session, evalset.recurrent)
    if whole_feed(feed, specs):  # inputs of no shared batch axis: the feed is one sample
        return feed
    fixed, axes = fixed_batches(specs), axes_of(specs)
    return {k: take_rows(v, axes.get(k, 0), 0, fixed.get(k, 1)) for k, v in feed.items()}


# Why a precision rung of the ladder raised none of the ranked layers (`ladder.effective`).
IDLE_RUNG = {
    "int8": "no ranked layer has weights under 8 bits",
    "int16": "no ranked layer has 8-bit activations to widen (16-bit already, quantized at run time, or "
             "constants only)",
    "": "it changes none of the ranked layers",
}


def quantize_to_target(
    model: Any, output: str | os.PathLike | None, config: Config, calibration_data: Any,
    progress: bool | None, evaluate: Any, keep_state: bool = False,
) -> Any:
    """Quantize `model` to meet `config.mixed_precision.target` with the fewest promotions."""
    start = time.perf_counter()
    mp = config.mixed_precision
    target = parse_target(mp.target)
    if output is not None:
        check_output_path(output, model if isinstance(model, str | os.PathLike) else None)
    if calibration_data is None and mp.eval_data is None:
        raise CalibrationDataError("an accuracy target needs data to rank layers and score models; pass "
                                   "mixed_precision.eval_data (or calibration_data)")
    source = CalibrationSource(calibration_data)
    access = data_access(source)
    if calibration_data is not None and not access.rereadable:
        raise CalibrationDataError(f"an accuracy target reads the calibration data more than once, but "
                                   f"{type(calibration_data).__name__} data can be read only once; "
                                   f"{FIXES[access]}")
    base_config = search_base_config(config)
    evalset, said = _eval_set(mp, calibration_data, evaluate is not None and target.metric in (None, "custom"),
                              model, config.calibration.providers)
    providers = config.calibration.providers

    base = run_pipeline(model, None, base_config, calibration_data, progress, keep_state=True)
    state = base.state
    _scorable(target, state.float_model)
    evalset.recurrent = recurrent_axes(state.float_model.graph)
    float_session = deployed_session(state.float_model, providers)
    measure = measurer(target, evalset, evaluate)

    def score(session: Any) -> float:
        return measure(session).value

    # the float model's outputs (what cosine and sqnr compare against), and the data checked on it
    evalset.reference = evalset.first_output(float_session, user_model=True)
    reference_score = float_score(target, score, float_session, evalset)
    base_session = deployed_session(base.ir_model, providers)
    base_scored = measure(base_session)
    base_score = base_scored.value

    def met(value: float) -> bool:
        return target.met(value, reference_score)

    climb = climb_algorithms(model, base_config, calibration_data, progress, algorithm_rungs(mp.ladder), base,
                             base_scored, lambda ir_model: measure(deployed_session(ir_model, providers)),
                             target.higher_is_better, met, mp.rung_min_gain)
    if climb.result is not base:  # promotions are priced against the recipe the rungs left
        base_session = deployed_session(climb.result.ir_model, providers)
    base, base_config, climbed_score = climb.result, climb.config, climb.score
    said.extend(climb.notes(bool(config.calibration.stats), bool(config.calibration.load_ranges)))
    state = base.state
    rungs = applicable(precision_rungs(mp.ladder), base.plan)
    order: list[tuple[str, float]] = []
    if not met(climbed_score) and rungs:
        order = sensitivity_order(base, base_config, evalset, float_session, rungs[-1], progress)
        if order:  # the rungs that raise one of them (int16 leaves float-input MatMuls as they are)
            rungs = [r for r in rungs if effective({n: r for n, _ in order}, base.plan)]
    if order:  # the ladder's precision rungs that raise none of the ranked layers, said as algorithm rungs are
        climb.trials.extend(RungTrial(r, None, False, False, 0.0, IDLE_RUNG.get(r, IDLE_RUNG[""]))
                            for r in precision_rungs(mp.ladder) if r not in rungs)

    bar = _progress_bar(progress, len(order))
    trial_scores: list[Scored] = []  # each trial's, in the order `bisect_promotions` records them

    def score_of(promotions: dict[str, str]) -> float:
        raised = with_promotions(base_config, effective(promotions, base.plan))  # as the result will be
        trial_scores.append(measure(deployed_session(state.emit(raised), providers)))
        bar.update(1)
        bar.set_postfix_str(f"{len(promotions)} raised: {trial_scores[-1].value:.4g}")
        return trial_scores[-1].value

    try:
        outcome = bisect_promotions([name for name, _ in order], rungs, score_of, met, climbed_score)
    finally:
        bar.close()
    choice = None
    if not outcome.met:  # the best model scored, not the first one (`unmet.py`)
        writable = partial(_writable, config=base_config, calibration_data=calibration_data)
        choice = choose_unmet(_candidates(climb, order, outcome.trials, trial_scores, base.plan, writable),
                              target.higher_is_better, mp.rung_min_gain)
        outcome.promotions = choice.written.promotions
    outcome.promotions = effective(outcome.promotions, base.plan)  # the same model, the no-ops left out
    final_config = with_promotions(base_config, outcome.promotions)
    to_float = [name for name, rung in outcome.promotions.items() if rung not in INTEGER_RUNGS]
    if to_float and final_config.calibration.stats:
        # The files hold the base plan's tensors; layers raised to a float type drop some of
        # them (raised to int8 weights or int16 activations, the same observers serve).
        if calibration_data is None:
            raise CalibrationDataError(
                f"the accuracy target raises {len(to_float)} layers to a float type, and the final model then "
                "calibrates other tensors than the statistics files hold: pass calibration_data as well")
        final_config = with_calibration(final_config, stats=None)
        said.append("accuracy target: the final model, with layers raised, is calibrated on the calibration data "
                     "(the statistics files hold the first model's plan)")
    if config.calibration.measure_latency:  # measured once, on the model returned (not on every trial)
        final_config = with_calibration(final_config, measure_latency=True)
    # The ladder's types widened the opset for every trial; a final model that keeps none of
    # them is written at the opset its own types need (segmentation trial: an int8-only
    # model at opset 21, where 17 runs on older onnxruntimes), quantized once more if need be.
    unpinned = dataclasses.replace(final_config, opset=config.opset)
    written = dict(base.ir_model.opset_imports).get("", final_config.opset)  # the trials' opset
    lowered = max(required_opset(unpinned), base.summary.opset[0] if base.summary.opset else 0) < written
    if lowered:
        final_config = unpinned
    if outcome.promotions or lowered:
        result = run_pipeline(model, output, final_config, calibration_data, progress, keep_state)
    else:
        result = base
        write_output(result.summary, model, base.ir_model, output, data=source, providers=providers,
                     measure_latency=config.calibration.measure_latency)
    final_session = deployed_session(result.ir_model, providers)
    final_score = score(final_session) if outcome.promotions or lowered else climbed_score
    feed = _first_sample(evalset, final_session)
    ranks = dict(order)
    before_ms, after_ms, float_ms = median_ms([base_session, final_session, float_session], feed)
    result.summary.mixed_precision = MixedPrecisionSummary(
        target=target.describe(),
        met=target.met(final_score, reference_score),
        float_score=reference_score,
        base_score=base_score,
        final_score=final_score,
        promotions=[Promotion(n, r, ranks.get(n, math.nan), noise_db(ranks.get(n, math.nan)))
                    for n, r in outcome.promotions.items()],
        ranked_layers=len(order),
        evaluations=((target.metric not in SELF_SCORE) + 1 + sum(t.score is not None for t in climb.trials)
                     + len(outcome.trials) + bool(outcome.promotions)),
        trials=[{**dataclasses.asdict(t), "promoted": len(effective({n: t.rung for n, _ in order[:t.promoted]},
                                                                     base.plan))} for t in outcome.trials],
        rungs=[dataclasses.asdict(t) for t in climb.trials],
        algorithm_score=climbed_score,
        size_before=weight_bytes(base.ir_model),
        size_after=weight_bytes(result.ir_model),
        latency_ms_before=before_ms,
        latency_ms_after=after_ms,
        seconds=time.perf_counter() - start,
        config=final_config,
        scored_on=("the eval data" if mp.eval_data is not None else
                   "the custom evaluate" if evaluate is not None else "the calibration data") + _scored_name(
                       base.state.float_model.graph, evaluate is None),
        best_score=None if choice is None else choice.best.scored.value,
        written=("the model with the layers the search raised" if outcome.promotions else
                 "the model with no layer raised") if choice is None else choice.written.what,
    )
    result.config = final_config  # what ran: the report's settings, --save-config
    result.summary.notes.extend(notes(Topic.SEARCH, said))
    if (slower := slower_than_float(outcome.promotions, after_ms, float_ms, before_ms)) is not None:
        result.summary.notes.append(slower)
    result.summary.rest_as("search", time.perf_counter() - start)
    if not result.summary.mixed_precision.met:
        if rungs and not order:
            how = ("and no layer could be raised: none computes in a quantized type (the loss is in what the "
                   "search does not rank, such as weights stored in a float type)")
        elif rungs:
            how = f"even with every ranked layer raised to {rungs[-1]}"
        else:
            how = ("by the algorithm rungs, and the ladder has no precision rung for this recipe (int8 for 4-bit "
                   "weights, int16, fp16, bf16, float)")
        written = (_written_words(choice, final_score, mp.rung_min_gain) if choice is not None else
                   f"the model written scores {final_score:.4g}")  # a model that met it in the search
        result.summary.notes.append(Note(Topic.SEARCH, f"accuracy target {target.describe()} not met {how}; {written}"))
    return result


def _writable(rung: str, config: Config, calibration_data: Any) -> bool:
    """Whether the search can write a model with layers raised to `rung`: raised to a
    float type, it calibrates other tensors than statistics files hold (`--stats`), which
    needs the calibration data."""
    return rung in INTEGER_RUNGS or calibration_data is not None or not config.calibration.stats


def _candidates(climb: Climb, order: list[tuple[str, float]], trials: list[Trial], scores: list[Scored],
                plan: QuantPlan, writable: Callable[[str], bool]) -> list[Candidate]:
    """What a search that missed its target may write, cheapest first (`unmet.py`): the
    all-quantized model after the kept algorithm rungs, then each trial it can write, in
    the ladder's order (`trials` and their `scores` as the bisection recorded them)."""
    kept = [t.rung for t in climb.trials if t.kept]
    found = [Candidate("the all-quantized model" + (f" with {', '.join(kept)}" if kept else ""), {}, climb.scored)]
    names = [name for name, _ in order]
    for trial, scored in zip(trials, scores, strict=True):
        promotions = {name: trial.rung for name in names[:trial.promoted]}
        if writable(trial.rung):
            words = raised_words(trial.rung, len(effective(promotions, plan)), len(names), trial.promoted)
            found.append(Candidate(words, promotions, scored))
    return found


def _written_words(choice: Choice, final_score: float, min_gain: float | None) -> str:
    """What a search that missed its target wrote, for its note: the best score reached, by
    which model, and the model written where it is another (as good within the eval set's
    noise, or `rung_min_gain`, and cheaper: `unmet.py`)."""
    if choice.written is choice.best:
        best = choice.best.scored.value
        again = "" if final_score == best else f" (it scores {final_score:.4g} as written: calibrated again)"
        return f"the best score reached is {best:.4g}, by {choice.best.what}, and that model is written{again}"
    within = ("the eval set's noise or the least gain worth a rung (0.1 dB on SQNR)" if min_gain is None
              else f"rung_min_gain {min_gain:g}")
    return (f"the best score reached is {choice.best.scored.value:.4g}, by {choice.best.what}; written: "
            f"{choice.written.what}, {final_score:.4g}, as good within {within} and cheaper")
