"""Recurrent models as a speech user meets them: a time-major LSTM ([T, N, F], ONNX's and
torch's default layout) with its initial states [directions, N, H].

Calibration, the output check and `compare` cut and count samples on each input's batch
axis (`calibrate/inputs.batch_axes`), so an utterance runs whole: its time axis is never
cut into fragments that each start from a zero state, and the states' fixed first axis is
not taken for a batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.calibrate.inputs import batch_axes
from onnxq.errors import CalibrationDataError
from onnxq.evaluate import compare_models

HIDDEN, FEATURES, CLASSES = 16, 8, 10
# (frames, utterances) of each calibration file: lengths differ, as real recordings do
LENGTHS = ((7, 1), (11, 2), (9, 3), (7, 2), (13, 1), (5, 3))


def time_major_lstm(seed: int = 0) -> onnx.ModelProto:
    """X [T, N, 8] and states [2, N, 16] -> bidirectional LSTM -> MatMul head [T, N, 10]."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((2, 4 * HIDDEN, FEATURES)) / np.sqrt(FEATURES)).astype(np.float32)
    r = (rng.standard_normal((2, 4 * HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    b = (rng.standard_normal((2, 8 * HIDDEN)) * 0.1).astype(np.float32)
    head = (rng.standard_normal((2 * HIDDEN, CLASSES)) / np.sqrt(2 * HIDDEN)).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((w, "W"), (r, "R"), (b, "B"), (head, "head"), (np.array([0, 0, 2 * HIDDEN], np.int64), "shape"))]
    nodes = [
        helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "c0"], ["Y", "Y_h"], hidden_size=HIDDEN,
                         direction="bidirectional", name="lstm"),
        helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),  # [T, N, 2, H]
        helper.make_node("Reshape", ["Yt", "shape"], ["features"]),
        helper.make_node("MatMul", ["features", "head"], ["logits"], name="head"),
    ]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", FEATURES]),
              helper.make_tensor_value_info("h0", TensorProto.FLOAT, [2, "N", HIDDEN]),
              helper.make_tensor_value_info("c0", TensorProto.FLOAT, [2, "N", HIDDEN])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", "N", CLASSES]),
               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [2, "N", HIDDEN])]
    graph = helper.make_graph(nodes, "time_major_lstm", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def utterances(seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    feeds = []
    for frames, n in LENGTHS:
        t = np.arange(frames, dtype=np.float32)[:, None, None]
        x = np.sin(0.3 * t * rng.uniform(0.5, 2.0, (1, n, FEATURES))) + 0.3 * rng.standard_normal((frames, n, FEATURES))
        feeds.append({"X": x.astype(np.float32),
                      "h0": (0.5 * rng.standard_normal((2, n, HIDDEN))).astype(np.float32),
                      "c0": (0.5 * rng.standard_normal((2, n, HIDDEN))).astype(np.float32)})
    return feeds


def write_folder(folder, feeds) -> str:
    folder.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(folder / f"u{i:02d}.npz", **feed)
    return str(folder)


def test_time_major_lstm_with_states_calibrates_whole_utterances(tmp_path):
    """The states' fixed axis 0 had been taken for the batch ("different sample counts"),
    and the time axis cut into batch-size fragments; each utterance now runs whole."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    out = tmp_path / "lstm.int8.onnx"
    result = onnxq.quantize(model, out, None, calib, progress=False)
    assert result.summary.calibration_samples == sum(n for _, n in LENGTHS)  # utterances, not frames
    onnx.checker.check_model(str(out), full_check=True)
    assert result.summary.quantized_by_op.get("MatMul") == 1
    # each held-out utterance, run whole in default sessions (measured 32-41 dB)
    for feed in utterances(2):
        assert sqnr_db(run(model, feed), run(out, feed)) > 25
    comparison = compare_models(model, out, write_folder(tmp_path / "eval", utterances(2)))
    assert comparison.samples == sum(n for _, n in LENGTHS)


def test_time_major_ranges_do_not_depend_on_the_batch_size(tmp_path):
    """Cut on the time axis, the ranges had depended on --batch-size (each fragment's RNN
    started from its initial state); on the batch axis the file is the same for any."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    files = []
    for batch in (1, 8):
        config = {"calibration": {"batch_size": batch}}
        files.append(tmp_path / f"b{batch}.onnx")
        onnxq.quantize(model, files[-1], config, calib, progress=False)
    assert files[0].read_bytes() == files[1].read_bytes()


def test_max_samples_cuts_on_the_batch_axis(tmp_path):
    """--max-samples counts utterances: 4 of them, from the first files, whole."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    result = onnxq.quantize(model, tmp_path / "q.onnx", {"calibration": {"max_samples": 4}}, calib, progress=False)
    assert result.summary.calibration_samples == 4


def test_latency_repeats_an_utterance_on_the_batch_axis(tmp_path):
    """--latency had read the states' axis 0 (2 directions) as a fixed batch of 2 and timed
    nothing else; it times batch 1 and 8, each state [2, N, 16] as the model takes it."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    result = onnxq.quantize(model, tmp_path / "q.onnx", {"calibration": {"measure_latency": True}}, calib,
                            progress=False)
    latency = result.summary.latency
    assert [t.batch for t in latency.timings] == [1, 8] and not latency.skipped


def test_a_static_recipe_says_how_to_quantize_the_lstm(tmp_path):
    """The LSTM stays float under a static recipe, and the summary names the recipe that
    quantizes it; following it quantizes the LSTM beside the static MatMul."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    result = onnxq.quantize(model, tmp_path / "q.onnx", None, calib, progress=False)
    assert "W8_DYNAMIC" in result.summary.float_nodes["lstm"][1]
    dynamic = {"layer_type_quant_config": {"LSTM": {"input_tensors": {"is_dynamic": True}}}}
    result = onnxq.quantize(model, tmp_path / "q2.onnx", dynamic, calib, progress=False)
    assert result.summary.quantized_by_op == {"LSTM": 1, "MatMul": 1}


@pytest.mark.parametrize("metric", ["sqnr>=20", "cosine>=0.99"])
def test_accuracy_target_on_utterances_of_other_lengths(tmp_path, metric):
    """The search scores sqnr and cosine on evaluation files of other lengths, each batch
    one sample of its paired test; it had refused them ("give evaluation data of one
    shape"). The score is the one the deployed model gets on those utterances."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    calib = write_folder(tmp_path / "calib", utterances(1))
    evaluation = utterances(2)
    config = {"mixed_precision": {"target": metric, "eval_data": write_folder(tmp_path / "eval", evaluation)}}
    result = onnxq.quantize(model, tmp_path / "q.onnx", config, calib, progress=False)
    assert result.summary.mixed_precision.met
    refs = np.concatenate([run(model, f).ravel() for f in evaluation])
    outs = np.concatenate([run(tmp_path / "q.onnx", f).ravel() for f in evaluation])
    if metric.startswith("sqnr"):
        assert abs(result.summary.mixed_precision.final_score - sqnr_db(refs, outs)) < 0.01


def test_a_model_onnxruntime_cannot_run_is_refused_with_its_reason(tmp_path):
    """A batch-first LSTM (layout 1), which onnxruntime's CPU does not run: the dynamic
    recipe, which opens no session before the load check, now gives onnxruntime's reason
    as the static one does."""
    model = time_major_lstm()
    lstm = next(n for n in model.graph.node if n.op_type == "LSTM")
    lstm.attribute.append(helper.make_attribute("layout", 1))
    path = tmp_path / "lstm.onnx"
    onnx.save(model, path)
    with pytest.raises(onnxq.OnnxqError, match="layout == 1"):
        onnxq.quantize(path, tmp_path / "q.onnx", "W8_DYNAMIC", progress=False)


def test_samples_without_frames_are_refused(tmp_path):
    """Utterances of 0 frames calibrate nothing: the run had written a model with scale 1.0
    everywhere (0.9 dB on real data) and checked it at 'SQNR inf dB' on the empty samples."""
    model = tmp_path / "lstm.onnx"
    onnx.save(time_major_lstm(), model)
    empty = [{"X": np.zeros((0, 2, FEATURES), np.float32), "h0": np.zeros((2, 2, HIDDEN), np.float32),
              "c0": np.zeros((2, 2, HIDDEN), np.float32)}]
    with pytest.raises(CalibrationDataError, match="saw no value in any of the .* tensors it observes: the "
                                                   "samples are empty"):
        onnxq.quantize(model, tmp_path / "q.onnx", None, write_folder(tmp_path / "calib", empty), progress=False)
    assert not (tmp_path / "q.onnx").exists()


B, T = "b", "t"


@pytest.mark.parametrize(("inputs", "outputs", "recurrent", "expected"), [
    # a batch-first model with its states: the states' axis 0 cannot be the batch
    ({"x": [B, T, 40], "h0": [4, B, 64], "c0": [4, B, 64]}, [[B, T, 10], [4, "n", 64]], {}, {"x": 0, "h0": 1, "c0": 1}),
    # time-major alone: the outputs carry b more often than t
    ({"x": [T, B, 40]}, [[T, B, 12], [1, B, 64]], {}, {"x": 1}),
    # ... or a recurrent node reads it directly at layout 0
    ({"X": [T, "N", 40]}, [[T, "N", 10]], {"X": 1}, {"X": 1}),
    ({"X": [T, "N", 40], "seq": ["N"]}, [], {"X": 1, "seq": 0}, {"X": 1, "seq": 0}),
    # axis 0 stays where it can be the batch
    ({"x": [T, B, 40]}, [[T, B, 12]], {}, {}),  # nothing says otherwise
    ({"ids": ["batch", "sequence"], "mask": ["batch", "sequence"]}, [["batch", "sequence", 384], ["batch", 384]], {},
     {}),
    ({"x": [1, T, 40], "mask": [1, T]}, [[1, T, 12]], {}, {}),  # a batch-1 export with a named time axis
    ({"x": [None, T, 40]}, [[None, T, 12]], {}, {}),  # an unnamed dynamic axis 0
    ({"input": ["batch", 3, "h", "w"]}, [["boxes", 4]], {}, {}),
    ({"ids": ["batch", "seq"], "past": ["batch", 3, "past", 64]}, [["batch", "seq", 100]], {}, {}),
    # review: an output naming its batch otherwise leaves a batch-first model as it is
    ({"x": ["batch", "seq", 8], "mask": ["batch", "seq"]}, [["batch_size", "seq", 4]], {}, {}),
    # review: a batch-1 export beside a per-frame input is no model batched on time
    ({"x": [1, T, 4], "w": [T]}, [[1, T, 4]], {}, {}),
    # ... while a one-layer GRU's state [1, b, 64] beside [b, t, 40] is batched on b
    ({"x": [B, T, 40], "h0": [1, B, 64]}, [[B, T, 10]], {}, {"x": 0, "h0": 1}),
])
def test_batch_axes(inputs, outputs, recurrent, expected):
    assert batch_axes(inputs, outputs, recurrent) == expected
