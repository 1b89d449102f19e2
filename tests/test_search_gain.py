"""An algorithm rung is kept only where its gain is beyond the eval set's noise: paired
per-sample changes whose mean exceeds its standard error (`search/gain.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.errors import ConfigError
from onnxq.pipeline.run import run_pipeline
from onnxq.search import rungs as R
from onnxq.search.climb import climb_algorithms
from onnxq.search.gain import rung_gain
from onnxq.search.target import Scored, _cosine, _sqnr, _top1_scored

MODELS = Path(__file__).resolve().parent.parent / "models"


def _top1(matched: np.ndarray) -> Scored:
    return Scored(100.0 * float(np.mean(matched)), 100.0 * matched)


def _flipped(base: np.ndarray, gained: int, lost: int) -> np.ndarray:
    """`base` with `gained` of its misses matched and `lost` of its matches missed."""
    out = base.copy()
    out[np.flatnonzero(~base)[:gained]] = True
    out[np.flatnonzero(base)[:lost]] = False
    return out


@pytest.mark.parametrize(("gained", "lost", "kept"), [(1, 0, False), (2, 0, True), (3, 1, False), (4, 1, True),
                                                     (0, 0, False), (1, 2, False), (30, 10, True)])
def test_top1_gains_against_their_standard_error(gained, lost, kept):
    base = np.arange(600) % 3 != 0  # 400 of 600 matched
    why = rung_gain(_top1(_flipped(base, gained, lost)), _top1(base), True, False, None)
    assert (why is None) == kept
    if not kept and gained > lost:
        assert "within the eval set's noise" in why and "600 samples" in why and "--rung-min-gain 0" in why
    if gained <= lost:
        assert why == "no better"


def test_the_target_a_caller_metric_and_a_set_minimum_decide_alone():
    base = np.arange(600) % 3 != 0
    one_more = _top1(_flipped(base, 1, 0))
    assert rung_gain(one_more, _top1(base), True, True, None) is None  # it meets the target: kept
    assert rung_gain(one_more, _top1(base), True, False, 0.0) is None  # any gain, as before
    assert "under rung_min_gain 0.5" in rung_gain(one_more, _top1(base), True, False, 0.5)
    assert rung_gain(Scored(0.71), Scored(0.70), True, False, None) is None  # a caller's metric: one number
    assert rung_gain(Scored(0.69), Scored(0.70), False, False, None) is None  # lower is better for <=
    assert rung_gain(Scored(0.71), Scored(0.70), False, False, None) == "no better"


def test_per_sample_parts_add_up_to_the_score():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((50, 10)).astype(np.float32)
    out = ref + 0.1 * rng.standard_normal((50, 10)).astype(np.float32)
    labels = ref.argmax(1)
    labels[:7] = (labels[:7] + 1) % 10
    top1 = _top1_scored(out, labels)
    assert top1.value == pytest.approx(np.mean(top1.samples)) and set(np.unique(top1.samples)) <= {0.0, 100.0}
    cos = _cosine(ref, out)
    assert cos.value == pytest.approx(np.mean(cos.samples))
    sq = _sqnr(ref, out, None)
    assert sq.value == pytest.approx(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / -np.sum(sq.samples)))
    # less noise on one sample: a higher SQNR and a positive paired change there only
    better = out.copy()
    better[3] = ref[3]
    d = _sqnr(ref, better, None).samples - sq.samples
    assert _sqnr(ref, better, None).value > sq.value and d[3] > 0 and not np.delete(d, 3).any()


def test_a_rung_within_the_noise_is_dropped_and_the_summary_says_so():
    """The climb on the digits model with scores given: per_channel gains one sample of 100
    (dropped, noise), CLE gains 20 (kept)."""
    config = compose_config("U8S8", None, {"global_quant_config": {"weight": {"qscheme": None}}})  # per-tensor
    data = str(MODELS / "digits_calib.npz")
    start = run_pipeline(str(MODELS / "digits_cnn.onnx"), None, config, data, False, keep_state=True)
    base = np.arange(100) % 2 == 0
    scores = iter([_top1(_flipped(base, 1, 0)), _top1(_flipped(base, 20, 0))])
    climb = climb_algorithms(str(MODELS / "digits_cnn.onnx"), config, data, False,
                             R.algorithm_rungs(["per_channel", "cle"]), start, _top1(base),
                             lambda _model: next(scores), True, lambda s: s >= 99.0)
    assert [(t.rung, t.kept) for t in climb.trials] == [("per_channel", False), ("cle", True)]
    assert "within the eval set's noise" in climb.trials[0].why
    assert climb.score == 70.0 and climb.config.global_quant_config.weight.qscheme is None  # as given
    assert [p["name"] for p in climb.config.pre_quant_opt_config] == ["cle"]


def test_rung_min_gain_from_the_cli_a_file_and_python_and_bad_values(tmp_path, capsys):
    config = compose_config("U8S8", None, {"mixed_precision": {"rung_min_gain": 0.25}})
    assert config.mixed_precision.rung_min_gain == 0.25
    (tmp_path / "c.yaml").write_text("mixed_precision: {rung_min_gain: 0}\n")
    assert compose_config("U8S8", str(tmp_path / "c.yaml"), {}).mixed_precision.rung_min_gain == 0
    for bad in (-1, float("nan"), "a lot", True):  # a bool is an int to Python, not a gain
        with pytest.raises(ConfigError, match="rung_min_gain"):
            compose_config("U8S8", None, {"mixed_precision": {"rung_min_gain": bad}})
    args = ["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
            str(MODELS / "digits_calib.npz"), "--accuracy-target", "sqnr>=10", "--rung-min-gain", "-2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--rung-min-gain -2" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "q.onnx").exists()


def test_a_rung_that_fixes_an_overflowed_sample_is_kept():
    """sqnr parts: the start model's noise is infinite on one sample, the rung's finite:
    kept (the standard error was NaN and the rung was dropped); the reverse is no better."""
    start = Scored(-float("inf"), np.array([-1.0, -float("inf"), -2.0]))
    fixed = Scored(20.0, np.array([-1.0, -3.0, -2.0]))
    assert rung_gain(fixed, start, True, False, None) is None
    assert rung_gain(start, fixed, True, False, None) == "no better"


def test_a_cosine_sample_that_overflows_or_goes_silent_scores_no_agreement():
    """Per-sample cosines: a row of NaN (an overflow) or of zeros where float was not zero
    scores 0, not a perfect 1 (a rung that broke a sample looked like it fixed it); zeros
    against zeros agree."""
    ref = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [1.0, 1.0]], np.float32)
    out = np.array([[1.0, 2.0], [np.nan, 4.0], [0.0, 0.0], [0.0, 0.0]], np.float32)
    np.testing.assert_allclose(_cosine(ref, out).samples, [1.0, 0.0, 1.0, 0.0])


def test_a_systematic_but_tiny_sqnr_or_cosine_gain_is_not_worth_a_rung():
    """Every sample a little less noisy: beyond the noise by far, but 0.01 dB (the trust
    trial's SmoothQuant rung) is under the least gain worth a rung; 0.2 dB is kept."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((400, 32))
    noise = 0.05 * rng.standard_normal((400, 32))
    start = _sqnr(ref, ref + noise, None)
    for shrink, kept in ((10 ** (-0.01 / 20), False), (10 ** (-0.2 / 20), True)):
        better = _sqnr(ref, ref + shrink * noise, None)
        why = rung_gain(better, start, True, False, None)
        assert (why is None) == kept, why
        if not kept:
            assert "the least worth a rung on sqnr" in why and "--rung-min-gain 0" in why
            assert rung_gain(better, start, True, False, 0.0) is None  # the user's minimum decides alone
    cos_start = _cosine(ref, ref + noise)
    tiny = _cosine(ref, ref + 10 ** (-0.01 / 20) * noise)
    clear = _cosine(ref, ref + 10 ** (-0.2 / 20) * noise)
    assert "least worth a rung on cosine" in rung_gain(tiny, cos_start, True, False, None)
    assert rung_gain(clear, cos_start, True, False, None) is None


def test_a_search_that_misses_writes_the_cheaper_model_within_the_least_gain():
    """The model an unmet search writes follows the same rule: a costlier candidate 0.08 dB
    better, beyond the noise but under the least gain worth a rung, does not win (review)."""
    from onnxq.search.unmet import Candidate, choose_unmet

    rng = np.random.default_rng(1)
    ref = rng.standard_normal((400, 32))
    noise = 0.05 * rng.standard_normal((400, 32))
    cheap, best = _sqnr(ref, ref + noise, None), _sqnr(ref, ref + 10 ** (-0.08 / 20) * noise, None)
    choice = choose_unmet([Candidate("cheap", {}, cheap), Candidate("best", {"a": "int8"}, best)], True, None)
    assert choice.best.what == "best" and choice.written.what == "cheap"
    assert choose_unmet([Candidate("cheap", {}, cheap), Candidate("best", {"a": "int8"}, best)], True,
                        0.0).written.what == "best"  # --rung-min-gain 0: any gain counts
