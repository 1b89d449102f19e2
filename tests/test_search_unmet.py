"""A target no model meets: the search writes the best model it scored (the cheapest one
as good within the eval set's noise), says so, and the model written scores what the
summary says in onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import random_feeds, sqnr_db, stack_feeds
from test_analyze import deep_chain

from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.quantize import quantize
from onnxq.search.target import Scored
from onnxq.search.unmet import Candidate, choose_unmet


def _top1(*matched: int, n: int = 100) -> Scored:
    """A top-1 score over `n` samples, those numbered in `matched` right (100) and the rest wrong (0)."""
    samples = np.zeros(n)
    samples[list(matched)] = 100.0
    return Scored(float(samples.mean()), samples)


def _candidate(what: str, scored: Scored) -> Candidate:
    return Candidate(what, {} if what == "base" else {"conv": what}, scored)


def test_the_best_candidate_is_written_where_it_wins_beyond_the_noise():
    base = _candidate("base", _top1(*range(70)))
    int8 = _candidate("int8", _top1(*range(80)))  # 10 more samples right, none lost
    worse = _candidate("int16", _top1(*range(60)))
    choice = choose_unmet([base, int8, worse], higher_is_better=True, min_gain=None)
    assert choice.best is int8 and choice.written is int8


def test_a_costlier_candidate_within_the_noise_gives_way_to_the_cheaper():
    """One sample more right than the int8 trial is within the eval set's noise (`gain.py`):
    the int8 model is written, the float one's score reported as the best."""
    base = _candidate("base", _top1(*range(60)))
    int8 = _candidate("int8", _top1(*range(80)))
    float_ = _candidate("float", _top1(*range(81)))
    choice = choose_unmet([base, int8, float_], higher_is_better=True, min_gain=None)
    assert choice.best is float_ and choice.written is int8
    # two samples more, none lost, is beyond it (as for an algorithm rung): the best is written
    two_more = _candidate("float", _top1(*range(82)))
    assert choose_unmet([base, int8, two_more], True, None).written is two_more
    # with rung_min_gain 0, any gain counts; with 5 (points of top-1), the int8 trial's 20
    # points over the base count and the float one's 1 more does not
    assert choose_unmet([base, int8, float_], True, 0.0).written is float_
    assert choose_unmet([base, int8, float_], True, 5.0).written is int8


def test_ties_go_to_the_cheaper_and_nan_never_wins():
    same = [_candidate("base", Scored(3.0)), _candidate("int8", Scored(3.0))]
    assert choose_unmet(same, True, None).written is same[0]  # equal scores: the first (cheapest)
    nan = [_candidate("base", Scored(1.0)), _candidate("int8", Scored(math.nan)), _candidate("float", Scored(0.5))]
    choice = choose_unmet(nan, True, None)
    assert choice.best is nan[0] and choice.written is nan[0]
    # a metric where lower is better (custom<=...): the lowest wins
    lower = [_candidate("base", Scored(5.0)), _candidate("int8", Scored(2.0)), _candidate("float", Scored(4.0))]
    assert choose_unmet(lower, False, None).written is lower[1]
    with pytest.raises(ValueError):
        choose_unmet([], True, None)


@pytest.fixture(scope="module")
def two_bit_chain(tmp_path_factory):
    """A 16-conv chain with two layers' weights in 2 bits (they wreck the output), its
    calibration and evaluation data."""
    model = deep_chain(layers=15, seed=7)
    folder = tmp_path_factory.mktemp("unmet")
    onnx.save(model, folder / "chain.onnx")
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    overrides = {"layer_quant_config": {n: {"weight": {"bits": 2}} for n in (convs[4], convs[11])}}
    np.savez(folder / "eval.npz", **stack_feeds(random_feeds(model, 32, 1)))
    return folder, overrides, stack_feeds(random_feeds(model, 64, 0))


def _sqnr_on_eval(folder, quantized) -> float:
    with np.load(folder / "eval.npz") as npz:
        feeds = {k: npz[k] for k in npz.files}
    outputs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
               for p in (folder / "chain.onnx", quantized)]
    return sqnr_db(*outputs)


def test_an_unmet_target_writes_the_best_model_scored(two_bit_chain, tmp_path):
    """Ladder int16 then int8: neither meets sqnr>=200; int16 (the later rung before) left
    the 2-bit weights and scored low, int8 raised them and scored best. The int8 model is
    written (before: the all-quantized one), every layer still quantized, and it scores in
    onnxruntime what the summary says."""
    folder, overrides, calib = two_bit_chain
    cfg = compose_config("U8S8", None, {**overrides, "mixed_precision": {
        "target": "sqnr>=200", "ladder": ["int16", "int8"], "eval_data": str(folder / "eval.npz")}})
    out = tmp_path / "q.onnx"
    result = quantize(folder / "chain.onnx", out, cfg, calib, progress=False)
    mp = result.summary.mixed_precision
    scores = {t["rung"]: t["score"] for t in mp.trials}
    assert not mp.met and set(scores) == {"int16", "int8"}
    assert scores["int8"] > max(scores["int16"], mp.base_score) + 6  # a real gain, not noise
    assert mp.final_score == pytest.approx(scores["int8"], abs=1e-3) and mp.best_score == scores["int8"]
    assert {p.rung for p in mp.promotions} == {"int8"} and len(mp.promotions) == 2  # the two 2-bit layers
    assert mp.written == "every ranked layer raised to int8 (2 layers of 16 changed by it)"
    note = next(n for n in result.summary.note_texts if "not met" in n)
    assert f"the best score reached is {mp.final_score:.4g}, by every ranked layer raised to int8" in note
    assert "that model is written" in note
    onnx.checker.check_model(str(out), full_check=True)
    assert _sqnr_on_eval(folder, out) == pytest.approx(mp.final_score, abs=0.01)
    convs = sum(n.op_type == "Conv" for n in onnx.load(str(out)).graph.node)
    dq = sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node)
    assert convs == 16 and dq >= 2 * convs  # every Conv still reads quantized input and weight


def test_an_unmet_target_keeps_the_all_quantized_model_where_no_trial_beats_it(two_bit_chain, tmp_path, capsys):
    """Ladder int16 alone: 16-bit activations leave the 2-bit weights, and score within the
    eval set's noise of the all-quantized model (6.18 against 6.18 dB): the cheaper
    all-quantized model is written, and --quiet's one line names it and its score."""
    import re

    import yaml

    folder, overrides, calib = two_bit_chain
    np.savez(tmp_path / "calib.npz", **calib)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(overrides))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(folder / "chain.onnx"), str(out), "--calib-data", str(tmp_path / "calib.npz"),
                 "--config", str(tmp_path / "cfg.yaml"), "--eval-data", str(folder / "eval.npz"),
                 "--accuracy-target", "sqnr>=200", "--ladder", "int16", "--quiet"]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NOT met" in err and err.endswith("written: the all-quantized model"), err
    final = float(re.search(r"final ([-\d.]+)", err).group(1))
    assert _sqnr_on_eval(folder, out) == pytest.approx(final, abs=0.01)
    assert not _int16(out)
    # --rung-min-gain 0: any gain counts, and the int16 model's 0.004 dB more is one
    assert main(["quantize", str(folder / "chain.onnx"), str(out), "--calib-data", str(tmp_path / "calib.npz"),
                 "--config", str(tmp_path / "cfg.yaml"), "--eval-data", str(folder / "eval.npz"),
                 "--accuracy-target", "sqnr>=200", "--ladder", "int16", "--rung-min-gain", "0", "--quiet"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.endswith("written: every ranked layer raised to int16 (16 layers)"), err
    assert float(re.search(r"final ([-\d.]+)", err).group(1)) > final and _int16(out)


def _int16(path) -> bool:
    """Whether the model at `path` has int16 Q/DQ (their zero points)."""
    return any(t.data_type == onnx.TensorProto.INT16 for t in onnx.load(str(path)).graph.initializer)


def test_the_report_says_what_an_unmet_search_wrote(two_bit_chain, tmp_path):
    """The HTML report's mixed-precision data and table carry the best score and the model
    written; its layer table is ordered by the output ranking, with its figure."""
    pytest.importorskip("matplotlib")
    import json
    import re

    folder, overrides, calib = two_bit_chain
    cfg = compose_config("U8S8", None, {**overrides, "mixed_precision": {
        "target": "sqnr>=200", "ladder": ["int8"], "eval_data": str(folder / "eval.npz")}})
    result = quantize(folder / "chain.onnx", tmp_path / "q.onnx", cfg, calib, progress=False,
                      report=tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text()
    data = json.loads(re.search(r'id="onnxq-data">(.*?)</script>', text, re.S).group(1))
    mp = result.summary.mixed_precision
    assert data["mixed_precision"]["written"] == mp.written == ("every ranked layer raised to int8 (2 layers of 16 "
                                                                "changed by it)")
    assert data["mixed_precision"]["best_score"] == pytest.approx(mp.final_score)
    assert "written (target not met)" in text and "output dB" in text
    ranked = [r["output_sqnr_db"] for r in data["layers"] if r["output_sqnr_db"] is not None]
    assert ranked and ranked == sorted(ranked)


def test_the_note_gives_the_best_score_the_search_found_and_the_written_models_own():
    """Where the best candidate is written but scores otherwise once calibrated again, the
    note's best score is the candidate's, and the written model's score follows it."""
    from onnxq.search.driver import _written_words
    from onnxq.search.unmet import Choice

    best = _candidate("every ranked layer raised to int8", _top1(*range(80)))
    same = _written_words(Choice(best, best), 80.0, None)
    assert same == ("the best score reached is 80, by every ranked layer raised to int8, and that model is written")
    again = _written_words(Choice(best, best), 77.0, None)
    assert again.startswith("the best score reached is 80, by every ranked layer raised to int8")
    assert "(it scores 77 as written: calibrated again)" in again


def test_raised_words_count_what_a_rung_changed():
    """A rung that changes fewer layers than it raises says how many of them (encoder trial:
    "every ranked layer raised to int16 (66 layers)" beside 69 ranked read as a miscount)."""
    from onnxq.search.unmet import raised_words

    assert raised_words("int16", 66, 69, 69) == "every ranked layer raised to int16 (66 layers of 69 changed by it)"
    assert raised_words("int16", 5, 69, 5) == "the 5 most sensitive layers raised to int16 (5 layers)"
    assert raised_words("int16", 4, 69, 5) == "the 5 most sensitive layers raised to int16 (4 layers of 5 changed by it)"


def test_the_search_says_it_used_the_calibration_data(tmp_path):
    """With no eval_data and a custom evaluate met before any layer was ranked, the note had
    said layers were ranked on the calibration data (encoder trial)."""
    from onnxq.config.spec import MixedPrecisionConfig
    from onnxq.search.driver import _eval_set

    data = {"input": np.zeros((4, 1, 8, 8), np.float32)}
    for custom, words in ((True, "the search ranks layers on the calibration data"),
                          (False, "the search ranks layers and scores models on the calibration data")):
        _, notes = _eval_set(MixedPrecisionConfig(), data, custom, None, ["CPUExecutionProvider"])
        assert notes == [f"no eval_data given: {words} (pass mixed_precision.eval_data for a held-out set)"]
