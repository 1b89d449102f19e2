"""Old models as a model-zoo user meets them (opsets 5-9, IR 3): onnxq upgrades them as it
loads them, and what the upgrade cannot carry over is fixed or refused in one line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.errors import ModelError

RNG = np.random.default_rng(0)
WEIGHT = (RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
SCALE, SHIFT = np.array([1, 2, 3, 4], np.float32), np.array([0.5, -0.5, 1, -1], np.float32)


def caffe2_style(second: str = "s") -> onnx.ModelProto:
    """Opset 6, IR 3: Conv -> Mul by a per-channel scale [4] and Add of a shift [4], each
    with broadcast=1 axis=1 (Caffe2-era exporters' per-channel affine) -> Relu."""
    inits = [numpy_helper.from_array(WEIGHT, "w"), numpy_helper.from_array(SCALE, "s"),
             numpy_helper.from_array(SHIFT, "b")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", second], ["m"], broadcast=1, axis=1),
             helper.make_node("Add", ["m", "b"], ["a"], broadcast=1, axis=1),
             helper.make_node("Relu", ["a"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
    if second != "s":
        inputs.append(helper.make_tensor_value_info(second, TensorProto.FLOAT, [4]))
    graph = helper.make_graph(nodes, "caffe2_style", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    model.ir_version = 3
    return model


def expected(x: np.ndarray) -> np.ndarray:
    conv = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 8, 8])], [numpy_helper.from_array(WEIGHT, "w")]),
        opset_imports=[helper.make_opsetid("", 13)])
    return np.maximum(run(conv, {"x": x}) * SCALE.reshape(1, 4, 1, 1) + SHIFT.reshape(1, 4, 1, 1), 0)


def test_a_per_channel_broadcast_at_an_axis_upgrades_as_it_computes(tmp_path):
    """onnx's version converter unsqueezed the [4] scale to [4, 1, 1, 1]: the upgraded model
    output [4, 4, 8, 8] and the check, comparing with that upgraded float model, read
    37.5 dB (legacy trial). The scale and shift are now reshaped to [4, 1, 1] first."""
    onnx.checker.check_model(caffe2_style(), full_check=True)
    onnx.save(caffe2_style(), tmp_path / "old.onnx")
    x = RNG.standard_normal((16, 1, 3, 8, 8)).astype(np.float32)
    out = tmp_path / "q.onnx"
    onnxq.quantize(str(tmp_path / "old.onnx"), str(out), None, {"x": x.reshape(16, 3, 8, 8)}, progress=False)
    onnx.checker.check_model(str(out), full_check=True)
    got = run(out, {"x": x[0]})
    assert got.shape == (1, 4, 8, 8)
    assert sqnr_db(expected(x[0]), got) > 25


def test_a_broadcast_of_a_runtime_operand_is_refused(tmp_path):
    """The same broadcast of an input the converter would get wrong, and which no constant
    reshape can fix: one line naming the node and the fix."""
    onnx.save(caffe2_style(second="scale_in"), tmp_path / "old.onnx")
    with pytest.raises(ModelError, match=r"Mul node 'm' broadcasts its second input at axis 1 .* re-export the "
                                         r"model with opset >= 7"):
        onnxq.quantize(str(tmp_path / "old.onnx"), None, None, {"x": np.zeros((2, 3, 8, 8), np.float32),
                                                                "scale_in": np.ones((2, 4), np.float32)},
                       progress=False)


def batchnorm_6() -> onnx.ModelProto:
    """Opset 6: Conv -> BatchNormalization (is_test=1), which onnxruntime has no kernel for."""
    stats = [numpy_helper.from_array(a, n) for a, n in ((SCALE, "gamma"), (SHIFT, "beta"),
                                                         (np.zeros(4, np.float32), "mean"),
                                                         (np.ones(4, np.float32), "var"))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], is_test=1,
                              epsilon=1e-5)]
    inits = [numpy_helper.from_array(WEIGHT, "w"), *stats]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]  # IR 3
    graph = helper.make_graph(nodes, "bn6", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)


def test_compare_reads_an_old_float_model_as_quantize_does(tmp_path):
    """compare opened the opset-6 float model as given, which onnxruntime refuses, and
    printed a 30-line traceback with exit 1; it now reads it upgraded, as quantize did. A
    quantized model onnxruntime refuses is one line naming it."""
    from onnxq.evaluate import compare_models
    onnx.save(batchnorm_6(), tmp_path / "old.onnx")
    x = RNG.standard_normal((8, 3, 8, 8)).astype(np.float32)
    onnxq.quantize(str(tmp_path / "old.onnx"), str(tmp_path / "q.onnx"), None, {"x": x}, progress=False)
    compared = compare_models(str(tmp_path / "old.onnx"), str(tmp_path / "q.onnx"), {"x": x})
    assert compared.samples == 8 and compared.outputs[0].sqnr_db > 25
    broken = onnx.load(tmp_path / "q.onnx")
    broken.graph.node[0].op_type = "NoSuchOp"
    onnx.save(broken, tmp_path / "broken.onnx")
    with pytest.raises(ModelError, match="onnxruntime cannot open the quantized model: .*NoSuchOp"):
        compare_models(str(tmp_path / "old.onnx"), str(tmp_path / "broken.onnx"), {"x": x})


def test_an_op_onnx_removed_is_named_with_what_computes_it(tmp_path):
    """ImageScaler (opset 8, the model zoo's tiny-yolov2) stopped onnx's version converter
    with its raw C++ assertion and the advice to re-export at opset 13, where no such op
    exists (legacy trial)."""
    nodes = [helper.make_node("ImageScaler", ["x"], ["s"], scale=1 / 255, bias=[0.1, 0.2, 0.3]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "scaler", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3), tmp_path / "o.onnx")
    with pytest.raises(ModelError, match=r"ImageScaler was an experimental op that onnx removed; replace it with "
                                         r"standard ops \(ImageScaler: Mul by its scale, then Add"):
        onnxq.quantize(str(tmp_path / "o.onnx"), None, None, {"x": np.zeros((2, 3, 8, 8), np.float32)},
                       progress=False)


def test_a_broadcast_aligned_at_the_end_is_left_to_the_converter():
    """A [3] operand on [N, 3] at axis 1 is aligned at the end already: onnx's converter
    upgrades it right, whatever feeds it (review: a runtime operand had been refused)."""
    nodes = [helper.make_node("Mul", ["x", "scale"], ["y"], broadcast=1, axis=1)]
    graph = helper.make_graph(nodes, "aligned", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                                 helper.make_tensor_value_info("scale", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    from onnxq.graph.normalize import upgrade_opset
    upgraded = upgrade_opset(model, 6, 13)
    x, scale = RNG.standard_normal((2, 3)).astype(np.float32), np.array([1, 2, 3], np.float32)
    assert np.allclose(run(upgraded, {"x": x, "scale": scale}), x * scale)
