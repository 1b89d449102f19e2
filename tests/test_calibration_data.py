"""Every calibration data source yields the same calibrated ranges for the same samples.

The reference is a list of feed dicts; minmax ranges are order-independent, so every
source (and every batch size) must give exactly the same numbers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import (
    conv_relu_chain,
    fixed_batch_conv,
    fully_convolutional,
    random_feeds,
    save,
    stack_feeds,
    two_inputs,
)

import onnxq
from onnxq.config import get_preset
from onnxq.errors import CalibrationDataError

N_SAMPLES = 12


def calibrate(model, data, batch_size: int = 8, max_samples: int | None = None):
    config = get_preset("U8S8")
    config.calibration.batch_size = batch_size
    config.calibration.max_samples = max_samples
    # One-shot sources cannot feed the bias correction some targets add (a second read),
    # so that the outputs of every source type compare byte for byte it stays off here.
    config.target_algorithms = False
    return onnxq.quantize(model, None, config, data)


class Reader:
    """onnxruntime's CalibrationDataReader protocol: get_next() until None."""

    def __init__(self, feeds):
        self.feeds = list(feeds)
        self.calls = 0

    def get_next(self):
        self.calls += 1
        return self.feeds.pop(0) if self.feeds else None


@pytest.fixture(scope="module")
def single():
    model = conv_relu_chain()
    feeds = random_feeds(model, N_SAMPLES, seed=21)
    return model, feeds, calibrate(model, feeds)


def _npy_dir(tmp: Path, feeds, keep_batch_axis: bool) -> Path:
    folder = tmp / ("npy_batch" if keep_batch_axis else "npy")
    folder.mkdir()
    for i, f in enumerate(feeds):
        np.save(folder / f"{i:03d}.npy", f["x"] if keep_batch_axis else f["x"][0])
    return folder


def _npz_dir(tmp: Path, feeds) -> Path:
    folder = tmp / "npz"
    folder.mkdir()
    for i, f in enumerate(feeds):
        np.savez(folder / f"{i:03d}.npz", **f)
    return folder


def _npz_file(tmp: Path, feeds) -> Path:
    path = tmp / "all.npz"
    np.savez(path, **stack_feeds(feeds))
    return path


def _npy_file(tmp: Path, feeds) -> Path:
    path = tmp / "all.npy"
    np.save(path, stack_feeds(feeds)["x"])
    return path


SOURCES = {
    "npy_dir": lambda tmp, feeds: _npy_dir(tmp, feeds, keep_batch_axis=False),
    "npy_dir_with_batch_axis": lambda tmp, feeds: _npy_dir(tmp, feeds, keep_batch_axis=True),
    "npz_dir": _npz_dir,
    "npz_file": _npz_file,
    "npz_file_as_str": lambda tmp, feeds: str(_npz_file(tmp, feeds)),
    "npy_file": _npy_file,
    "dict_of_arrays": lambda tmp, feeds: stack_feeds(feeds),
    "list_of_feeds": lambda tmp, feeds: list(feeds),
    "generator_of_feeds": lambda tmp, feeds: (f for f in feeds),
    "reader": lambda tmp, feeds: Reader(feeds),
    "feeds_of_several_rows": lambda tmp, feeds: [stack_feeds(feeds[:5]), stack_feeds(feeds[5:])],
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_source_gives_reference_ranges(source, single, tmp_path):
    model, feeds, reference = single
    result = calibrate(model, SOURCES[source](tmp_path, feeds))
    assert result.summary.calibration_samples == N_SAMPLES
    assert result.ranges == reference.ranges
    assert result.model.SerializeToString() == reference.model.SerializeToString()


def test_reference_ranges_are_the_data_extremes(single):
    _, feeds, reference = single
    x = stack_feeds(feeds)["x"]
    assert reference.ranges["x"] == (float(x.min()), float(x.max()))
    # The Conv+Relu outputs are calibrated after the (absorbed) Relu: they start at 0.
    relu_ranges = [r for name, r in reference.ranges.items() if name.startswith("relu")]
    assert len(relu_ranges) == 2
    assert all(lo == 0.0 and hi > 0.0 for lo, hi in relu_ranges)


@pytest.mark.parametrize("source", ["npy_dir", "npz_dir", "npz_file", "dict_of_arrays",
                                    "list_of_feeds", "reader", "feeds_of_several_rows"])
@pytest.mark.parametrize("cap", [1, 5, 11])
def test_max_samples_caps_the_count(source, cap, single, tmp_path):
    model, feeds, _ = single
    result = calibrate(model, SOURCES[source](tmp_path, feeds), max_samples=cap)
    assert result.summary.calibration_samples == cap
    # Exactly the first `cap` samples were used.
    assert result.ranges == calibrate(model, feeds[:cap]).ranges


def test_max_samples_stops_reading(single):
    model, feeds, _ = single
    reader = Reader(feeds)
    calibrate(model, reader, max_samples=3)
    assert reader.calls <= 4  # nothing read ahead beyond what is needed


def test_max_samples_above_count_uses_all(single):
    model, feeds, reference = single
    result = calibrate(model, feeds, max_samples=1000)
    assert result.summary.calibration_samples == N_SAMPLES
    assert result.ranges == reference.ranges


@pytest.mark.parametrize("batch_size", [1, 2, 7, 12, 64])
def test_batch_size_does_not_change_minmax(batch_size, single):
    model, feeds, reference = single
    result = calibrate(model, feeds, batch_size=batch_size)
    assert result.summary.calibration_samples == N_SAMPLES
    assert result.ranges == reference.ranges


def test_batch_1_vs_7_with_variable_spatial_size():
    """Samples of different H, W cannot be stacked: batches split where the shape changes."""
    model = fully_convolutional()
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.standard_normal((1, 3, s, s)).astype(np.float32)}
             for s in (8, 8, 8, 12, 12, 8, 16, 16, 16, 16)]
    a = calibrate(model, feeds, batch_size=1)
    b = calibrate(model, feeds, batch_size=7)
    assert a.summary.calibration_samples == b.summary.calibration_samples == len(feeds)
    assert a.ranges == b.ranges
    x = np.concatenate([f["x"].ravel() for f in feeds])
    assert a.ranges["x"] == (float(x.min()), float(x.max()))


@pytest.mark.parametrize("batch_size", [1, 7])
def test_fixed_batch_of_one(batch_size, tmp_path):
    model = fixed_batch_conv(batch=1)
    feeds = random_feeds(model, 9, seed=5)
    reference = calibrate(model, feeds, batch_size=batch_size)
    assert reference.summary.calibration_samples == 9
    path = save(model, tmp_path / "m.onnx")
    for source in (stack_feeds(feeds), _npz_file(tmp_path, feeds), Reader(feeds),
                   [stack_feeds(feeds[:4]), stack_feeds(feeds[4:])]):
        result = calibrate(path, source, batch_size=batch_size)
        assert result.summary.calibration_samples == 9
        assert result.ranges == reference.ranges


def test_fixed_batch_of_two_drops_the_partial_batch():
    model = fixed_batch_conv(batch=2)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3, 10, 10)).astype(np.float32)
    result = calibrate(model, {"x": x})
    assert result.summary.calibration_samples == 2  # two whole [2,3,10,10] inputs
    assert result.ranges["x"] == (float(x[:4].min()), float(x[:4].max()))


def test_two_input_model_sources_agree(tmp_path):
    model = two_inputs()
    feeds = random_feeds(model, 7, seed=8)
    reference = calibrate(model, feeds)
    assert reference.summary.calibration_samples == 7
    for source in (_npz_dir(tmp_path, feeds), _npz_file(tmp_path, feeds),
                   stack_feeds(feeds), Reader(feeds)):
        result = calibrate(model, source, batch_size=3)
        assert result.ranges == reference.ranges
    a = np.concatenate([f["a"] for f in feeds])
    assert reference.ranges["a"] == (float(a.min()), float(a.max()))


def test_npy_needs_a_single_input_model(tmp_path):
    model = two_inputs()
    path = tmp_path / "a.npy"
    np.save(path, np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(CalibrationDataError, match="single-input"):
        calibrate(model, path)


def test_two_input_npz_with_unequal_counts(tmp_path):
    model = two_inputs()
    path = tmp_path / "bad.npz"
    np.savez(path, a=np.zeros((3, 3, 8, 8), np.float32), b=np.zeros((2, 2, 8, 8), np.float32))
    with pytest.raises(CalibrationDataError, match="different sample counts"):
        calibrate(model, path)


def test_a_dict_is_read_as_its_npz_would_be(tmp_path):
    """A stack missing the channel axis is refused from a dict as from its .npz: its rows
    were each taken for a lone sample, so the same arrays quantized from Python and failed
    from the CLI."""
    root = Path(__file__).resolve().parents[1] / "models"
    stack = np.load(root / "digits_calib.npz")["input"][:, 0]  # [128, 8, 8] for a [?, 1, 8, 8] input
    np.savez(tmp_path / "r3.npz", input=stack)
    for data in ({"input": stack}, tmp_path / "r3.npz"):
        with pytest.raises(CalibrationDataError, match=r"rank 3 .*1 axis missing; give arrays \[samples, 1, 8, 8\]"):
            onnxq.quantize(str(root / "digits_cnn.onnx"), None, None, data, progress=False)
    one = onnxq.quantize(str(root / "digits_cnn.onnx"), None, None, {"input": stack[0][None]}, progress=False)
    assert one.summary.calibration_samples == 1  # a lone sample without its batch axis is still one sample


def test_float64_samples_are_cast_not_mutated(single):
    """float64 samples are cast to the float32 input; samples are not mutated."""
    model, feeds, reference = single
    feeds64 = [{"x": f["x"].astype(np.float64)} for f in feeds]
    snapshot = [f["x"].copy() for f in feeds64]
    result = calibrate(model, feeds64)
    assert result.ranges == reference.ranges
    assert all(np.array_equal(f["x"], s) for f, s in zip(feeds64, snapshot))


def test_run_on_data_tells_the_data_from_onnxq_and_memory():
    """onnxruntime's refusal of the data is a CalibrationDataError naming the node; a
    failure in a node onnxq added is raised as it is (a bug); running out of memory says
    how to use less."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

    from onnxq.calibrate.session import run_on_data
    from onnxq.errors import OnnxqError

    class Failing:
        def __init__(self, exc):
            self.exc = exc

        def run(self, names, feed):
            raise self.exc

    feed = {"ids": np.zeros((2, 4), np.int64)}
    data = Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Gather node. "
                "Name:'emb' Status Message: indices element out of data bounds, idx=99")
    with pytest.raises(CalibrationDataError, match=r"ids \[2, 4\]\): Gather node 'emb': indices element out"):
        run_on_data(Failing(data), ["y"], feed)
    ours = Fail("... running ReduceMax node. Name:'x__onnxq_max' Status Message: bad")
    with pytest.raises(Fail):
        run_on_data(Failing(ours), ["y"], feed)
    memory = RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for buffer")
    with pytest.raises(OnnxqError, match="out of memory.*--batch-size") as caught:
        run_on_data(Failing(memory), ["y"], feed)
    assert not isinstance(caught.value, CalibrationDataError)


def test_file_errors_fit_evaluation_data_and_long_input_lists(tmp_path):
    """`compare --data notes.txt` was told of an "unsupported calibration file", and a .npy
    for an LLM listed its 120 inputs (LLM trial)."""
    from onnxq.calibrate.inputs import InputSpec
    from onnxq.calibrate.sources import _read_file

    text = tmp_path / "notes.txt"
    text.write_text("not arrays")
    with pytest.raises(CalibrationDataError, match=r"^unsupported data file notes.txt; use .npz, .npy"):
        _read_file(text, [InputSpec("x", np.dtype(np.float32), None)])
    ids = tmp_path / "ids.npy"
    np.save(ids, np.zeros((2, 4), np.int64))
    many = [InputSpec(f"in{i}", np.dtype(np.float32), None) for i in range(40)]
    with pytest.raises(CalibrationDataError, match=r"\(in0, in1, in2, in3, in4, in5, \.\.\. 40 in all\)$"):
        _read_file(ids, many)
