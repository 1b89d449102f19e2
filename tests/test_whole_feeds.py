"""Models whose inputs share no batch axis, as a graph-network or recommendation user meets
them: a graph's nodes x [nodes, 4] beside its edges [2, edges] and their weights [edges];
bags of ids [total] beside their offsets [N]. Each file or feed is what the model takes in
one run: it runs whole, as one sample, never cut into rows or merged with another
(`calibrate/inputs.whole_feed`). Inputs that share a batch name still get the error for
different sample counts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.calibrate.batches import iter_batches
from onnxq.calibrate.inputs import model_inputs
from onnxq.errors import CalibrationDataError
from onnxq.evaluate import compare_models
from onnxq.graph.load import load_model

FEATURES, HIDDEN = 4, 8


def graph_network(seed: int = 0) -> onnx.ModelProto:
    """One message-passing layer: each edge carries its source node's features times its
    weight through a MatMul; the messages' sum is added to every node's own MatMul."""
    rng = np.random.default_rng(seed)
    w_msg = (rng.standard_normal((FEATURES, HIDDEN)) / 2).astype(np.float32)
    w_self = (rng.standard_normal((FEATURES, HIDDEN)) / 2).astype(np.float32)
    inits = [numpy_helper.from_array(w_msg, "w_msg"), numpy_helper.from_array(w_self, "w_self"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [
        helper.make_node("Gather", ["edge_index", "zero"], ["src"], axis=0),
        helper.make_node("Gather", ["x", "src"], ["sent"], axis=0),
        helper.make_node("Unsqueeze", ["edge_weight", "one"], ["weight"]),
        helper.make_node("Mul", ["sent", "weight"], ["weighted"]),
        helper.make_node("MatMul", ["weighted", "w_msg"], ["messages"], name="message"),
        helper.make_node("ReduceSum", ["messages", "zero_axes"], ["total"], keepdims=1),
        helper.make_node("MatMul", ["x", "w_self"], ["own"], name="own"),
        helper.make_node("Add", ["own", "total"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero_axes"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["nodes", FEATURES]),
              helper.make_tensor_value_info("edge_index", TensorProto.INT64, [2, "edges"]),
              helper.make_tensor_value_info("edge_weight", TensorProto.FLOAT, ["edges"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["nodes", HIDDEN])]
    graph = helper.make_graph(nodes, "graph_network", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def graphs(seed: int, count: int) -> list[dict[str, np.ndarray]]:
    """Graphs of other sizes, edges among each graph's own nodes."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        nodes, edges = int(rng.integers(5, 30)), int(rng.integers(2, 60))
        feeds.append({"x": rng.standard_normal((nodes, FEATURES)).astype(np.float32),
                      "edge_index": rng.integers(0, nodes, (2, edges)).astype(np.int64),
                      "edge_weight": rng.uniform(0.1, 1.0, edges).astype(np.float32)})
    return feeds


def _tensor_range(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], name: str) -> tuple[float, float]:
    """A tensor's min and max over whole runs of the float model."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    values = [run(exposed, feed, output=1) for feed in feeds]
    return min(float(v.min()) for v in values), max(float(v.max()) for v in values)


def test_inputs_of_no_shared_batch_axis_run_whole(tmp_path):
    model = graph_network()
    path = tmp_path / "gnn.onnx"
    onnx.save(model, path)
    folder = tmp_path / "calib"
    folder.mkdir()
    calib = graphs(1, 12)
    for i, feed in enumerate(calib):
        np.savez(folder / f"g{i:02d}.npz", **feed)
    out = tmp_path / "gnn.q.onnx"
    result = onnxq.quantize(str(path), str(out), calibration_data=str(folder), progress=False)
    onnx.checker.check_model(onnx.load(out), full_check=True)

    # each graph is one sample (the folder had been refused: edge_index's fixed axis 0 of
    # 2 read as a batch), and the ranges are those of every edge of every graph
    assert result.summary.calibration_samples == len(calib)
    assert any("ran whole" in n.text for n in result.summary.notes)
    # the edge index's Gather computes integers: listed on one line with any such node
    assert "    Gather x1: integer or boolean outputs (shapes, indices, masks): nothing to quantize" in \
        onnxq.format_summary(result.summary).splitlines()
    low, high = _tensor_range(model, calib, "weighted")
    assert result.ranges["weighted"] == pytest.approx((min(low, 0.0), max(high, 0.0)), rel=1e-5)

    held_out = graphs(2, 10)
    joined = (np.concatenate([run(model, f) for f in held_out]), np.concatenate([run(str(out), f) for f in held_out]))
    assert sqnr_db(*joined) > 30.0  # 33.9 dB (its worst graph 23.8: values past the calibrated range)

    # one graph in one .npz runs whole too, and a list of feeds
    one = tmp_path / "one.npz"
    np.savez(one, **calib[0])
    assert onnxq.quantize(str(path), None, calibration_data=str(one), progress=False).summary.calibration_samples == 1
    assert onnxq.quantize(str(path), None, calibration_data=calib, progress=False).summary.calibration_samples == 12

    # compare counts and scores graphs as they run
    folder_eval = tmp_path / "eval"
    folder_eval.mkdir()
    for i, feed in enumerate(held_out):
        np.savez(folder_eval / f"g{i:02d}.npz", **feed)
    compared = compare_models(str(path), str(out), str(folder_eval))
    assert compared.samples == len(held_out)
    assert compared.outputs[0].sqnr_db == pytest.approx(sqnr_db(*joined), abs=0.05)


def test_inputs_named_apart_still_need_equal_counts_in_one_file():
    """tf2onnx names each input's batch apart ([unk__1, 4] beside [unk__2, 3]): a stacked
    file whose counts differ is still the user's mistake, named."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["m"], name="fc"), helper.make_node("Add", ["m", "b"], ["y"])]
    graph = helper.make_graph(nodes, "apart", [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, ["unk__1", FEATURES]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, ["unk__2", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["unk__3", HIDDEN])],
        [numpy_helper.from_array(rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(CalibrationDataError, match="different sample counts"):
        onnxq.quantize(model, None, calibration_data={"a": rng.standard_normal((20, FEATURES)).astype(np.float32),
                                                      "b": rng.standard_normal((19, HIDDEN)).astype(np.float32)},
                       progress=False)
    good = {"a": rng.standard_normal((20, FEATURES)).astype(np.float32),
            "b": rng.standard_normal((20, HIDDEN)).astype(np.float32)}
    assert onnxq.quantize(model, None, calibration_data=good, progress=False).summary.calibration_samples == 20
    # equal counts are samples: cut to the batch and to max_samples as any model's
    inputs = model_inputs(load_model(model)[0])
    assert [len(b["a"]) for b in iter_batches(good, inputs, 8, 10)] == [8, 2]
    assert [len(b["a"]) for b in iter_batches([good, good], inputs, 8, None)] == [8] * 5


def test_inputs_sharing_a_batch_name_still_need_equal_counts():
    """[N, 4] beside [N] with 8 and 7 rows: a mistake, named as before."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="fc"),
             helper.make_node("Squeeze", ["s"], ["sq"]),
             helper.make_node("Add", ["sq", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "paired", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES]),
        helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = {"x": rng.standard_normal((8, FEATURES)).astype(np.float32),
            "bias": rng.standard_normal(7).astype(np.float32)}
    with pytest.raises(CalibrationDataError, match="different sample counts"):
        onnxq.quantize(model, None, calibration_data=data, progress=False)


def timestep_model(seed: int = 5) -> onnx.ModelProto:
    """A static batch of 2 latents [2, 4] and a scalar timestep, as diffusion UNets are
    exported: the timestep scales the latents before a MatMul."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["sample", "timestep"], ["scaled"]),
             helper.make_node("MatMul", ["scaled", "w"], ["y"], name="fc")]
    graph = helper.make_graph(nodes, "timestep", [
        helper.make_tensor_value_info("sample", TensorProto.FLOAT, [2, FEATURES]),
        helper.make_tensor_value_info("timestep", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, HIDDEN])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_stack_of_scalar_timesteps_is_one_per_sample(tmp_path):
    """[samples] of a scalar input beside [samples, 2, 4] latents: one timestep a run (it
    had raised IndexError in calibration, compare and the accuracy search)."""
    model = timestep_model()
    rng = np.random.default_rng(6)
    feeds = [{"sample": rng.standard_normal((2, FEATURES)).astype(np.float32),
              "timestep": np.array(rng.uniform(0.1, 1.0), np.float32)} for _ in range(6)]
    stacked = {"sample": np.stack([f["sample"] for f in feeds]), "timestep": np.stack([f["timestep"] for f in feeds])}
    assert stacked["timestep"].shape == (6,)
    one_by_one = onnxq.quantize(model, None, calibration_data=feeds, progress=False)
    path = tmp_path / "stacked.npz"
    np.savez(path, **stacked)
    from_stack = onnxq.quantize(model, None, calibration_data=str(path), progress=False)
    assert from_stack.summary.calibration_samples == 6
    assert from_stack.model.SerializeToString() == one_by_one.model.SerializeToString()
    assert sqnr_db(run(model, feeds), run(from_stack.model, feeds)) > 30.0

    compared = compare_models(model, from_stack.model, str(path))
    assert compared.samples == 6
    targeted = onnxq.quantize(model, None, {"mixed_precision": {"target": "sqnr>=60", "eval_data": str(path)}},
                              calibration_data=str(path), progress=False)
    assert targeted.summary.mixed_precision is not None

    with pytest.raises(CalibrationDataError, match=r"'timestep' is a scalar .* shape \[6, 1\]"):
        onnxq.quantize(model, None, calibration_data={**stacked, "timestep": stacked["timestep"][:, None]},
                       progress=False)


def test_a_one_value_input_given_once_is_told_to_repeat_it():
    """x [N, 4] beside a temperature [1] given once: the count error says how to give it,
    and the data given so runs (each sample on its own: the model takes one value a run)."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc"),
             helper.make_node("Div", ["logits", "temperature"], ["y"])]
    graph = helper.make_graph(nodes, "tempered", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES]),
        helper.make_tensor_value_info("temperature", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", HIDDEN])],
        [numpy_helper.from_array(rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.standard_normal((16, FEATURES)).astype(np.float32)
    with pytest.raises(CalibrationDataError, match=r"'temperature' takes one value per sample: repeat it, stacked "
                                                   r"\[samples, 1\]"):
        onnxq.quantize(model, None, calibration_data={"x": x, "temperature": np.array([2.0], np.float32)},
                       progress=False)
    repeated = {"x": x, "temperature": np.full((16, 1), 2.0, np.float32)}
    assert onnxq.quantize(model, None, calibration_data=repeated, progress=False).summary.calibration_samples == 16
