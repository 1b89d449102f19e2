"""A pass deferred to the calibration pass (SmoothQuant): one data pass instead of two,
and the same ranges and model as running it first."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run, sqnr_db
from test_smoothquant import matmul_chain, outlier_data

import onnxq
from onnxq.calibrate import runner
from onnxq.calibrate.rescale import rescale_statistics
from onnxq.calibrate.statistics import Statistic
from onnxq.graph.layout import ConvGeometry

SQ = {"name": "smoothquant", "alpha": 0.5}
# SmoothQuant is deferred only as the last pass; naming fold_batchnorm after it runs it first.
EAGER = [SQ, {"name": "fold_batchnorm"}]


@pytest.fixture
def streams(monkeypatch):
    """Purposes of the passes over the calibration data (the sizing probe not counted)."""
    seen: list[str] = []
    real = runner.stream_tensors

    def counting(model, names, data, options, progress=None, purpose="calibrating", *args, **kwargs):
        if purpose != "sizing calibration":
            seen.append(purpose)
        return real(model, names, data, options, progress, purpose, *args, **kwargs)

    monkeypatch.setattr(runner, "stream_tensors", counting)
    return seen


def _quantize(passes: list, calib: dict, method: str = "minmax", algos: list | None = None):
    config = onnxq.get_preset("U8S8")
    config.target = "generic"
    config.global_quant_config.input_tensors.calib_method = method
    config.global_quant_config.output_tensors.calib_method = method
    config.pre_quant_opt_config, config.algo_config = passes, algos or []
    return onnxq.quantize(matmul_chain(), None, config, calib)


def _smoothed_tensors(result) -> list[str]:
    """Tensors SmoothQuant scaled in matmul_chain: the inserted Mul's output (x is a graph
    input) and the chains folded into m1 (h, hb) and m2 (h2)."""
    muls = [n.outputs[0].name for n in result.ir_model.graph if n.op_type == "Mul" and "smoothquant" in n.name]
    return muls + ["h", "hb", "h2"]


def test_minmax_ranges_follow_the_scaling_without_a_second_pass(streams):
    calib, test = outlier_data(64, 4, (64,)), outlier_data(32, 5, (64,))
    deferred = _quantize([SQ], calib)
    assert len(streams) == 1
    streams.clear()
    eager = _quantize(EAGER, calib)
    assert len(streams) == 2 and streams[0] == "smoothquant"

    note = "smoothquant: 3 layers smoothed in 3 groups (alpha 0.5): 1 Mul inserted, 2 folded into MatMul"
    assert note in deferred.summary.note_texts and note in eager.summary.note_texts
    mul_out = _smoothed_tensors(deferred)[0]
    assert mul_out == "x_smoothquant"
    # The Mul's output range is exact (monotonic rounding); the folded chains and what
    # follows differ from the eager run by float32 rounding of the rewritten layers only.
    assert deferred.ranges[mul_out] == eager.ranges[mul_out]
    assert deferred.ranges.keys() == eager.ranges.keys()
    for name, (lo, hi) in eager.ranges.items():
        np.testing.assert_allclose(deferred.ranges[name], (lo, hi), rtol=1e-5, atol=1e-6, err_msg=name)
    ref = run(matmul_chain(), test)
    got_deferred, got_eager = run(deferred.model, test), run(eager.model, test)
    assert sqnr_db(ref, got_deferred) > 20.0  # 23.7 dB measured (x has 50x outlier channels)
    assert abs(sqnr_db(ref, got_deferred) - sqnr_db(ref, got_eager)) < 0.1


def test_histogram_observers_see_the_scaled_tensors_in_one_more_pass(streams):
    calib = outlier_data(64, 4, (64,))
    deferred = _quantize([SQ], calib, "percentile")
    assert len(streams) == 2
    eager = _quantize(EAGER, calib, "percentile")
    for name in _smoothed_tensors(deferred):  # observed on the same finished model
        assert deferred.ranges[name] == eager.ranges[name], name
    assert [i.name for i in deferred.model.graph.initializer] == [i.name for i in eager.model.graph.initializer]


def test_bias_correction_means_follow_the_scaling(streams):
    calib, test = outlier_data(64, 4, (64,)), outlier_data(32, 5, (64,))
    bc = [{"name": "bias_correction", "op_types": ["MatMul", "Gemm"]}]
    deferred = _quantize([SQ], calib, algos=bc)
    assert len(streams) == 1
    eager = _quantize(EAGER, calib, algos=bc)
    corrected = [n for n in deferred.summary.note_texts if n.startswith("bias_correction:")]
    assert corrected and corrected == [n for n in eager.summary.note_texts if n.startswith("bias_correction:")]
    ref = run(matmul_chain(), test)
    assert abs(sqnr_db(ref, run(deferred.model, test)) - sqnr_db(ref, run(eager.model, test))) < 0.1


def test_data_read_once_is_enough_for_smoothquant():
    """A generator can be read only once: SmoothQuant used to need it twice."""
    calib = outlier_data(32, 4, (64,))
    feeds = ({"x": calib["x"][i : i + 8]} for i in range(0, 32, 8))
    result = _quantize([SQ], feeds)
    assert any(n.startswith("smoothquant: 3 layers smoothed") for n in result.summary.note_texts)
    assert result.summary.calibration_samples == 32


def test_statistics_scale_along_their_own_axis_only():
    mean = Statistic("t", "mean", -1)
    across = Statistic("t", "mean", 0)
    other = Statistic("u", "mean", -1)
    windows = Statistic("c", "windows", 1, ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1, 1, 1)))
    stats = {mean: np.array([1.0, 2.0]), windows: np.ones((2, 9)), across: np.ones(4), other: np.array([5.0, 5.0])}
    rescales = {"t": (-1, np.array([2.0, 0.5])), "c": (1, np.array([2.0, 0.5]))}
    out = rescale_statistics(stats, rescales, {"t": 2, "u": 2, "c": 4})
    np.testing.assert_array_equal(out[mean], [2.0, 1.0])
    np.testing.assert_array_equal(out[windows], np.tile([[2.0], [0.5]], (1, 9)))
    np.testing.assert_array_equal(out[other], [5.0, 5.0])
    assert across not in out  # cannot follow: whoever needs it collects it again
