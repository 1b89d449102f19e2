"""Climb the ladder's algorithm rungs: recipe changes first, before any layer is raised.

Each rung (`rungs.py`) is applied on top of the rungs kept so far, the model re-quantized
(calibration included: CLE and SmoothQuant change the weights the ranges come from) and
scored in a default session; the rung is kept where the score improves, and the climb stops
once the target is met. The precision rungs then start from the best recipe found.
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
from onnxq.search.rungs import AlgorithmRung, skip_reason, with_rung


@dataclass(frozen=True)
class RungTrial:
    """What one algorithm rung did: its score (None: not tried, `why` says why), whether it
    met the target, whether it was kept (it improved the score) and its quantization time."""

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
    score: float
    trials: list[RungTrial]

    def notes(self, stats: bool) -> list[str]:
        """What the summary must say beyond the rungs' lines: a kept rung calibrated on the
        data instead of the statistics files the recipe named."""
        if stats and any(t.kept for t in self.trials):
            return ["accuracy target: the algorithm rungs kept change the weights the ranges come from, so the "
                    "model is calibrated on --calib-data, not on the statistics files"]
        return []


def climb_algorithms(model: Any, config: Config, data: Any, progress: bool | None, rungs: list[AlgorithmRung],
                     start: Any, start_score: float, score_model: Callable[[Any], float],
                     better: Callable[[float, float], bool], met: Callable[[float], bool]) -> Climb:
    """Try each rung on top of the kept ones until `met` (module doc). `start` is the
    pipeline result of `config` and `start_score` its score; `score_model(ir_model)`
    scores a quantized model."""
    climb = Climb(config, start, start_score, [])
    for rung in rungs:
        if met(climb.score):
            break
        why = skip_reason(rung, climb.config, set(climb.result.plan.quantized_nodes.values()))
        if why is None and data is None:
            why = "needs calibration data to quantize again (pass --calib-data)"
        if why is not None:
            climb.trials.append(RungTrial(rung.name, None, False, False, 0.0, why))
            continue
        candidate = with_rung(climb.config, rung)
        if candidate.calibration.stats:  # the files hold the first recipe's ranges: calibrate on the data
            candidate = with_calibration(candidate, stats=None)
        began = time.perf_counter()
        try:
            result = run_pipeline(model, None, candidate, data, progress, keep_state=True)
        except OnnxqError as error:  # a rung this model cannot take: say so, climb on
            climb.trials.append(RungTrial(rung.name, None, False, False, time.perf_counter() - began,
                                          f"failed: {error}"))
            continue
        score = score_model(result.ir_model)
        kept = better(score, climb.score)
        climb.trials.append(RungTrial(rung.name, score, met(score), kept, time.perf_counter() - began,
                                      rung.what if kept else f"{rung.what}; no better"))
        if kept:
            climb.config, climb.result, climb.score = candidate, result, score
    return climb
