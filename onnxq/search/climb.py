"""Climb the ladder's algorithm rungs: recipe changes first, before any layer is raised.

Each rung (`rungs.py`) is applied on top of the rungs kept so far, the model re-quantized
(calibration included: CLE and SmoothQuant change the weights the ranges come from) and
scored in a default session; the rung is kept where the score improves beyond the eval
set's noise (`gain.py`), and the climb stops once the target is met. The precision rungs
then start from the best recipe found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onnxq.config.spec import Config
from onnxq.errors import OnnxqError
from onnxq.pipeline.run import run_pipeline
from onnxq.search.base import with_calibration
from onnxq.search.gain import rung_gain
from onnxq.search.rungs import AlgorithmRung, skip_reason, with_rung
from onnxq.search.target import Scored


@dataclass(frozen=True)
class RungTrial:
    """What one algorithm rung did: its score (None: not tried, `why` says why), whether it
    met the target, whether it was kept (it improved the score beyond the noise) and its
    quantization time."""

    rung: str
    score: float | None
    met: bool
    kept: bool
    seconds: float
    why: str


@dataclass
class Climb:
    """The best recipe after the algorithm rungs, its pipeline result and score."""

    config: Config
    result: Any
    scored: Scored
    trials: list[RungTrial]

    @property
    def score(self) -> float:
        return self.scored.value

    def notes(self, stats: bool, ranges: bool = False) -> list[str]:
        """What the summary must say beyond the rungs' lines: a kept rung calibrated on the
        data instead of the statistics files (or, after a pass, the ranges file) the recipe named."""
        files = ("the statistics files" if stats else
                 "the ranges file" if ranges and not self.config.calibration.load_ranges else None)
        if files and any(t.kept for t in self.trials):
            return ["accuracy target: the algorithm rungs kept change the weights the ranges come from, so the "
                    f"model is calibrated on the calibration data, not on {files}"]
        return []


def climb_algorithms(model: Any, config: Config, data: Any, progress: bool | None, rungs: list[AlgorithmRung],
                     start: Any, start_scored: Scored, score_model: Callable[[Any], Scored],
                     higher_is_better: bool, met: Callable[[float], bool], min_gain: float | None = None) -> Climb:
    """Try each rung on top of the kept ones until `met` (module doc). `start` is the
    pipeline result of `config` and `start_scored` its score; `score_model(ir_model)`
    scores a quantized model; `min_gain`: `rung_gain`'s."""
    climb = Climb(config, start, start_scored, [])
    for rung in rungs:
        if met(climb.score):
            break
        why = skip_reason(rung, climb.config, set(climb.result.plan.quantized_nodes.values()))
        if why is None and data is None:
            why = "needs calibration data to quantize again (pass calibration_data)"
        if why is not None:
            climb.trials.append(RungTrial(rung.name, None, False, False, 0.0, why))
            continue
        candidate = with_rung(climb.config, rung)
        if candidate.calibration.stats:  # the files hold the first recipe's ranges: calibrate on the data
            candidate = with_calibration(candidate, stats=None)
        if candidate.calibration.load_ranges and candidate.pre_quant_opt_config != climb.config.pre_quant_opt_config:
            # a pass before calibration (CLE, SmoothQuant) rewrites what the ranges file measured
            candidate = with_calibration(candidate, load_ranges=None)
        began = time.perf_counter()
        try:
            result = run_pipeline(model, None, candidate, data, progress, keep_state=True)
        except OnnxqError as error:  # a rung this model cannot take: say so, climb on
            climb.trials.append(RungTrial(rung.name, None, False, False, time.perf_counter() - began,
                                          f"failed: {error}"))
            continue
        scored = score_model(result.ir_model)
        meets = met(scored.value)
        not_kept = rung_gain(scored, climb.scored, higher_is_better, meets, min_gain)
        climb.trials.append(RungTrial(rung.name, scored.value, meets, not_kept is None, time.perf_counter() - began,
                                      rung.what if not_kept is None else f"{rung.what}; {not_kept}"))
        if not_kept is None:
            climb.config, climb.result, climb.scored = candidate, result, scored
    return climb
