"""The HTML report: self-contained, deterministic, and every number it shows is the embedded JSON's.

The example digits model is quantized and analysed once; a second page carries a hand-made
mixed-precision summary. A headless Chromium (Debian's, else playwright's own) loads both
pages and checks for console errors, network requests, rendered charts and shown numbers.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxq.analyze import analyze_models
from onnxq.analyze.html import format_value, report_data, value_at, write_html_report
from onnxq.config import get_preset
from onnxq.errors import OnnxqError
from onnxq.quantize import quantize
from onnxq.report import MixedPrecisionSummary, Promotion, Summary

pytest.importorskip("matplotlib")

MODELS = Path(__file__).resolve().parent.parent / "models"
LONG = "/model/layers.0/attn/MatMul_with_a_rather_long_name_to_wrap"
CELL = re.compile(r'<td class="\w+" data-key="([^"]*)" data-value="([^"]*)">(.*?)</td>')
EXTERNAL = re.compile(r"""\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//"""
                      r"""|url\(\s*["']?\s*(?:https?:)?//""", re.I)
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(analysis, summary, config) of the quantized example model."""
    tmp = tmp_path_factory.mktemp("quantized")
    result = quantize(MODELS / "digits_cnn.onnx", tmp / "q.onnx", None, MODELS / "digits_calib.npz",
                      progress=False)
    data = dict(np.load(MODELS / "digits_eval.npz"))
    data.pop("labels")
    analysis = analyze_models(MODELS / "digits_cnn.onnx", tmp / "q.onnx", data, progress=False)
    return analysis, result.summary, get_preset("U8S8")


def _mixed_summary() -> Summary:
    trials = [{"promoted": 6, "rung": "int16", "score": 97.75, "met": True},
              {"promoted": 3, "rung": "int16", "score": 97.25, "met": True},
              {"promoted": 1, "rung": "int16", "score": 96.5, "met": False},
              {"promoted": 2, "rung": "int16", "score": 97.0, "met": True}]
    mp = MixedPrecisionSummary(
        target="top1>=float-0.5", met=True, float_score=97.5, base_score=95.25, final_score=97.0,
        promotions=[Promotion(LONG, "int16", 0.0123), Promotion("conv<b>&2", "int16", 4.5e-4)],
        ranked_layers=6, evaluations=7, trials=trials, size_before=120_000, size_after=150_500,
        latency_ms_before=0.51234, latency_ms_after=0.6, seconds=3.25)
    return Summary(source="m.onnx", output="q.onnx", mixed_precision=mp)


@pytest.fixture(scope="module")
def report(inputs, tmp_path_factory) -> Path:
    analysis, summary, config = inputs
    return write_html_report(tmp_path_factory.mktemp("report") / "report.html", analysis=analysis,
                             summary=summary, config=config)


@pytest.fixture(scope="module")
def mixed_report(tmp_path_factory) -> Path:
    return write_html_report(tmp_path_factory.mktemp("mixed") / "mixed.html",
                             summary=_mixed_summary(), title="mixed </script> <b>")


def _embedded(text: str) -> dict:
    blob = re.search(r'<script type="application/json" id="onnxq-data">(.*?)</script>', text, re.S)
    assert blob is not None
    return json.loads(blob.group(1))


def _check_cells(text: str, data: dict) -> set[str]:
    """Each data-key cell holds the JSON value at its key and shows it formatted; the keys."""
    cells = CELL.findall(text)
    assert len(cells) == text.count("data-key="), "a data-key cell the pattern missed"
    for key, raw, shown in cells:
        key, value = html.unescape(key), json.loads(html.unescape(raw))
        assert value == value_at(data, key), key
        assert html.unescape(shown) == format_value(key, value), key
    return {html.unescape(k) for k, _, _ in cells}


def _check_page(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>")
    assert '<meta charset="utf-8">' in text
    assert "How to read this report" in text
    assert not EXTERNAL.search(text), EXTERNAL.search(text)
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert text.count("</script>") == 1


def test_report_is_self_contained_and_matches_data(report, inputs):
    text = report.read_text(encoding="utf-8")
    _check_page(text)
    data = _embedded(text)
    assert data == report_data(*inputs)
    assert data == json.loads(json.dumps(data, allow_nan=False))
    for section in ("settings", "summary", "outputs", "layers", "tensors"):
        assert f'<section id="{section}">' in text
    # the settings' 'preset: none' had read as "no preset" beside the summary's U8S8
    assert "&#x27;preset: none&#x27; means this document needs no preset under it" in text
    assert 'id="mixed-precision"' not in text
    assert text.count("<svg") == 2  # the layer SQNR bars and the range plots
    keys = _check_cells(text, data)
    analysis = inputs[0]
    assert analysis.layers and analysis.tensors
    for i in range(len(analysis.layers)):
        assert {f"layers.{i}.{f}" for f in ("own_sqnr_db", "prefix_sqnr_db", "own_cosine")} <= keys
    for i in range(len(analysis.tensors)):
        assert {f"tensors.{i}.{f}" for f in ("sqnr_db", "calibrated_range", "saturation")} <= keys
    assert "outputs.0.sqnr_db" in keys


def test_report_is_deterministic_and_atomic(report, inputs, tmp_path):
    analysis, summary, config = inputs
    again = write_html_report(tmp_path / "again.html", analysis=analysis, summary=summary,
                              config=config)
    assert again.read_bytes() == report.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again.html"]  # no temp file left


def test_mixed_precision_section(mixed_report):
    text = mixed_report.read_text(encoding="utf-8")
    _check_page(text)
    data = _embedded(text)
    assert data == report_data(None, _mixed_summary(), None)
    assert 'id="mixed-precision"' in text and 'id="layers"' not in text
    assert data["mixed_precision"]["threshold"] == pytest.approx(97.0)
    assert "config" not in data["mixed_precision"]
    keys = _check_cells(text, data)
    assert {f"mixed_precision.trials.{i}.score" for i in range(4)} <= keys
    assert {"mixed_precision.promotions.1.node", "mixed_precision.size_after",
            "mixed_precision.final_score", "mixed_precision.met"} <= keys
    assert text.count("<svg") == 1  # score against promoted layers
    assert "conv&lt;b&gt;&amp;2" in text and "conv<b>" not in text
    assert "<title>mixed &lt;/script&gt; &lt;b&gt;</title>" in text


def test_non_finite_values_become_null(inputs, tmp_path):
    analysis = inputs[0]
    layers = [dataclasses.replace(analysis.layers[0], own_sqnr_db=math.inf), *analysis.layers[1:]]
    tensors = [dataclasses.replace(analysis.tensors[0], cosine=math.nan), *analysis.tensors[1:]]
    odd = dataclasses.replace(analysis, layers=layers, tensors=tensors)
    text = write_html_report(tmp_path / "r.html", analysis=odd).read_text(encoding="utf-8")
    data = _embedded(text)
    assert data["layers"][0]["own_sqnr_db"] is None and data["tensors"][0]["cosine"] is None
    _check_cells(text, data)
    assert format_value("layers.0.own_sqnr_db", None) == "\u2014"


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(OnnxqError, match="needs matplotlib"):
        write_html_report(tmp_path / "r.html", summary=_mixed_summary())
    assert not list(tmp_path.iterdir())


def _launch(playwright):
    try:
        if Path("/usr/bin/chromium").exists():
            return playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                              args=BROWSER_ARGS)
        return playwright.chromium.launch(headless=True, args=BROWSER_ARGS)
    except Exception as e:  # no browser installed, or it cannot start here
        pytest.skip(f"no Chromium could be launched: {str(e).splitlines()[0]}")


def _check_in_browser(browser, path: Path, charts: int) -> None:
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.resolve().as_uri(), wait_until="load")
    assert errors == []
    assert all(u.startswith(("file:", "data:")) for u in requests), requests
    data = _embedded(path.read_text(encoding="utf-8"))
    assert page.evaluate("JSON.parse(document.getElementById('onnxq-data').textContent)") == data
    figures = page.locator("figure.chart svg, figure.chart img")
    assert figures.count() == charts
    for i in range(charts):
        box = figures.nth(i).bounding_box()
        assert box is not None and box["width"] > 0 and box["height"] > 0
    cells = page.eval_on_selector_all(
        "[data-key]", "els => els.map(e => [e.dataset.key, e.dataset.value, e.innerText])")
    assert cells
    for key, raw, shown in cells:
        value = value_at(data, key)
        assert json.loads(raw) == value, key
        assert shown.strip() == format_value(key, value), key
    page.close()


def test_report_in_browser(report, mixed_report):
    sync_api = pytest.importorskip("playwright.sync_api")
    try:
        manager = sync_api.sync_playwright().start()
    except Exception as e:
        pytest.skip(f"playwright cannot start: {e}")
    try:
        browser = _launch(manager)
        try:
            _check_in_browser(browser, report, charts=2)
            _check_in_browser(browser, mixed_report, charts=1)
        finally:
            browser.close()
    finally:
        manager.stop()


def test_labelled_eval_data_puts_top1_in_the_report(tmp_path):
    """With labels in the eval data, the report (and the run's summary) gives float and
    quantized top-1 on the samples it measures, as compare does on the same data."""
    import onnxq
    from onnxq.evaluate import compare_models

    config = onnxq.compose_config("U8S8", None, {"mixed_precision": {"eval_data": str(MODELS / "digits_eval.npz")}})
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            str(MODELS / "digits_calib.npz"), progress=False, report=tmp_path / "r.html")
    (line,) = [t for t in result.summary.note_texts if "top-1 against the labels" in t]
    data = dict(np.load(MODELS / "digits_eval.npz"))
    labels = data.pop("labels")
    same = compare_models(str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), data, labels, max_samples=256)
    assert f"on {same.samples} samples: float {same.float_accuracy:.2%}, quantized {same.quant_accuracy:.2%}" in line
    assert line.removeprefix("report: ") in html.unescape((tmp_path / "r.html").read_text())
    assert "report" in result.summary.stage_seconds  # its time in the time line


def test_a_report_on_the_calibration_data_says_so(tmp_path):
    """Without evaluation data the report measured the calibration data and said only
    "Measured on 128 samples" (trust trial); its note says which data, and with evaluation
    data given it says nothing of the kind."""
    import onnxq

    data = str(MODELS / "digits_calib.npz")
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, "U8S8", data, progress=False,
                            report=tmp_path / "r.html")
    assert any(t.startswith("report: measured on the calibration data") for t in result.summary.note_texts)
    assert "measured on the calibration data" in (tmp_path / "r.html").read_text()
    config = onnxq.compose_config("U8S8", None, {"mixed_precision": {"eval_data": str(MODELS / "digits_eval.npz")}})
    held = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, config, data, progress=False,
                          report=tmp_path / "h.html")
    assert not any("calibration data" in t for t in held.summary.note_texts if t.startswith("report:"))


def test_a_report_on_data_read_once_is_written(tmp_path):
    """A reader without rewind() is read to its end by calibration; the report then ran on
    nothing and must say so, not raise 'the evaluation data holds no sample' after the
    model was saved (review)."""
    import onnxq

    x = np.load(MODELS / "digits_calib.npz")["input"]

    class Reader:
        def __init__(self) -> None:
            self.i = 0

        def get_next(self):
            if self.i >= 4:
                return None
            self.i += 1
            return {"input": x[(self.i - 1) * 8:self.i * 8]}

    onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", None, Reader(), progress=False,
                   report=tmp_path / "r.html")
    assert (tmp_path / "q.onnx").exists() and (tmp_path / "r.html").exists()
