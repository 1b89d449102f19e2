"""The report of one `quantize()` run: analyse the result against the float model it was
emitted from (after the passes, so rescaled tensors still match), then write the HTML."""

from __future__ import annotations

import os
from typing import Any

from onnxq.analyze.analysis import analyze_models
from onnxq.analyze.html import write_html_report
from onnxq.analyze.labelled import accuracy_note
from onnxq.config.spec import Config
from onnxq.notes import Topic, notes
from onnxq.search.target import load_eval_set

# The per-layer analysis of a report runs on at most this many samples.
REPORT_SAMPLES = 256


def report_quantization(path: str | os.PathLike, result: Any, config: Config, data: Any,
                        progress: bool | None = None, held_out: bool = True) -> None:
    """Analyse `result` (a `QuantizationResult` with its state kept) on `data`; write the
    report. `held_out` False: `data` is the calibration data, and the report says so (its
    figures read better than on data the quantizer did not fit to)."""
    state = result.state
    evalset = load_eval_set(data, config.mixed_precision.labels, model=result.summary.source,
                            providers=config.calibration.providers)
    analysis = analyze_models(state.float_model, result.ir_model, evalset.data, normalised=True,
                              max_samples=REPORT_SAMPLES, providers=config.calibration.providers,
                              progress=progress)
    if evalset.labels is not None:  # labelled data: the accuracy users judge a model by, beside agreement
        analysis.notes.insert(0, accuracy_note(state.float_model, result.ir_model, evalset.data, evalset.labels,
                                               max_samples=REPORT_SAMPLES, providers=config.calibration.providers))
    if not held_out:
        analysis.notes.insert(0, _calibration_data_note(result))
    result.summary.notes.extend(notes(Topic.REPORT, [f"report: {n}" for n in analysis.notes]))
    write_html_report(path, analysis=analysis, summary=result.summary, config=config,
                      title=f"onnxq report: {result.summary.source}")


def _calibration_data_note(result: Any) -> str:
    """What measuring on the calibration data means for this recipe: a fit (an algorithm
    chose weights on it), calibrated ranges, or nothing fitted at all (round-to-nearest
    weights; LLM trial: the note had said the quantizer fitted to it)."""
    fitted = result.summary.fitted_by  # not those that found nothing to change
    if fitted:
        return (f"measured on the calibration data, which {', '.join(fitted)} fitted the weights to, so held-out "
                "figures read lower; pass mixed_precision.eval_data for a held-out set")
    if result.summary.calibrated_tensors:
        return ("measured on the calibration data, which the activation ranges were calibrated on, so held-out "
                "figures can read lower; pass mixed_precision.eval_data for a held-out set")
    return ("measured on the calibration data; nothing in this recipe was fitted to it (mixed_precision.eval_data "
            "gives a held-out set)")
