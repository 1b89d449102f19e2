"""A Conv or Gemm kept float between quantized ops runs in float in a default onnxruntime
session: its input reaches it through a per-channel DequantizeLinear, which onnxruntime's
WeightBiasQuantization (per-tensor int8 weights for any Conv/Gemm reading a per-tensor
DequantizeLinear) leaves alone (`onnxq/emit/float_kernels.py`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from helpers import GraphBuilder, producers, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.emit.float_kernels import keep_float_kernels


def spread_depthwise(seed: int = 21) -> onnx.ModelProto:
    """Conv+Relu, a depthwise Conv whose channels' weights span 1000x (per-tensor int8
    would zero the small ones), Relu, 1x1 Conv, Flatten, Gemm."""
    b = GraphBuilder(seed)
    x = b.relu(b.conv(b.input("x", ["N", 4, 8, 8]), 4, 16))
    w = b.he((16, 1, 3, 3), 9) * np.logspace(-3, 0, 16, dtype=np.float32)[:, None, None, None]
    x = b.relu(b.node("Conv", [x, b.const("dw_w", w), b.const("dw_b", b.small((16,)))],
                      kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16))
    x = b.node("Flatten", [b.relu(b.conv(x, 16, 8, k=1))])
    return b.build([b.gemm(x, 8 * 8 * 8, 10)], name="spread_depthwise")


def default_run(model: onnx.ModelProto, x: np.ndarray, disabled: list[str] | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=disabled or [])
    return session.run(None, {"x": x})[0]


def test_excluded_depthwise_conv_and_gemm_run_in_float(tmp_path):
    model = spread_depthwise()
    x = np.random.default_rng(0).standard_normal((32, 4, 8, 8)).astype(np.float32)
    names = {n.op_type: n.name for n in model.graph.node if n.op_type in ("Gemm",)}
    dw = next(n.name for n in model.graph.node if n.op_type == "Conv" and n.input[1].startswith("dw_w"))
    result = onnxq.quantize(model, tmp_path / "q.onnx", {"exclude": [dw, names["Gemm"]]}, {"x": x}, progress=False)
    assert dw in result.summary.float_nodes and names["Gemm"] in result.summary.float_nodes
    quantized = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(quantized)
    dq = producers(quantized)[next(n for n in quantized.graph.node if n.name == dw).input[0]]
    scale = next(t for t in quantized.graph.initializer if t.name == dq.input[1])
    assert dq.op_type == "DequantizeLinear" and list(scale.dims) == [16]
    # onnxruntime's weight rewrite finds nothing to do: the default session computes what
    # it computes with the rewrite off, and is close to float.
    out = default_run(quantized, x[:8])
    np.testing.assert_allclose(out, default_run(quantized, x[:8], ["WeightBiasQuantization"]), rtol=1e-5, atol=1e-6)
    reference = default_run(model, x[:8])
    assert sqnr_db(reference, out) > 25


def test_without_the_guard_onnxruntime_would_quantize_them(tmp_path):
    """The failure the guard prevents, on the same model: with the guard's per-channel
    scale and zero point made per tensor again, onnxruntime quantizes the excluded
    depthwise Conv's weights (per tensor): the default session no longer computes what it
    computes with that rewrite off, and the small channels are lost."""
    model = spread_depthwise()
    x = np.random.default_rng(0).standard_normal((32, 4, 8, 8)).astype(np.float32)
    dw = next(n.name for n in model.graph.node if n.op_type == "Conv" and n.input[1].startswith("dw_w"))
    onnxq.quantize(model, tmp_path / "q.onnx", {"exclude": [dw]}, {"x": x}, progress=False)
    guarded = onnx.load(tmp_path / "q.onnx")
    unguarded = onnx.load(tmp_path / "q.onnx")
    guard = producers(unguarded)[next(n for n in unguarded.graph.node if n.name == dw).input[0]]
    for tensor in unguarded.graph.initializer:
        if tensor.name in guard.input[1:]:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor)[:1].reshape(()), tensor.name))
    del guard.attribute[:]
    out = default_run(unguarded, x[:8])
    assert np.abs(out - default_run(unguarded, x[:8], ["WeightBiasQuantization"])).max() > 1e-3
    reference = default_run(model, x[:8])
    assert sqnr_db(reference, default_run(guarded, x[:8])) > sqnr_db(reference, out)


def test_a_gemm_reading_a_dequantize_gets_its_k_axis():
    """DequantizeLinear -> Gemm (transA=1: input [K, M]) -> QuantizeLinear, built by hand: the
    guard's per-channel scale runs along K, axis 0, and the session computes float."""
    k, m = 6, 3
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"], name="dq"),
         helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transA=1),
         helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"], name="q")],
        "gemm_ta", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [k, m])],
        [helper.make_tensor_value_info("yq", TensorProto.UINT8, None)],
        [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(3, np.uint8), "z"),
         numpy_helper.from_array(np.linspace(-1, 1, k * 4, dtype=np.float32).reshape(k, 4), "w"),
         numpy_helper.from_array(np.full(4, 0.25, np.float32), "b")])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    model = ir.from_proto(proto)
    assert keep_float_kernels(model).guarded == ["gemm"]
    guarded = ir.to_proto(model)
    onnx.checker.check_model(guarded)
    gemm = next(n for n in guarded.graph.node if n.name == "gemm")
    dq = next(n for n in guarded.graph.node if n.output[0] == gemm.input[0])
    scale = next(t for t in guarded.graph.initializer if t.name == dq.input[1])
    assert [a.i for a in dq.attribute if a.name == "axis"] == [0] and list(scale.dims) == [k]
    xq = np.random.default_rng(3).integers(0, 255, (k, m)).astype(np.uint8)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    out = ort.InferenceSession(guarded.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"xq": xq})[0]
    x = (xq.astype(np.float64) - 3) * 0.05
    expected = np.clip(np.rint((x.T @ np.linspace(-1, 1, k * 4).reshape(k, 4) + 0.25) / 0.05) + 3, 0, 255)
    assert np.abs(out.astype(np.int64) - expected).max() <= 1


def test_a_dequantize_without_zero_point_is_guarded_too():
    """A DequantizeLinear with its zero point left out (uint8 zero) feeding a float Conv."""
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["xq", "s"], ["x"], name="dq"),
         helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[1, 1])],
        "no_zero_point", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0.5, np.float32), "s"),
         numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")])
    model = ir.from_proto(onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])))
    found = keep_float_kernels(model)
    assert found.guarded == ["conv"] and found.exposed == []
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    conv = next(n for n in proto.graph.node if n.name == "conv")
    guard = next(n for n in proto.graph.node if n.output[0] == conv.input[0])
    assert len(guard.input) == 2 and "dq" not in {n.name for n in proto.graph.node}  # the old one had no reader left
    xq = np.arange(48, dtype=np.uint8).reshape(1, 3, 4, 4)
    expected = np.ones((2, 3)) @ (xq.reshape(3, 16) * 0.5)
    np.testing.assert_allclose(default_run_feed(proto, {"xq": xq}).reshape(2, 16), expected, rtol=1e-6)


def default_run_feed(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def tiny_input_conv(seed: int = 5) -> onnx.ModelProto:
    """A Conv reading values of about 1e-6 with a bias of about 0.05: with 16-bit
    activations its int32 bias (b / (x_scale * w_scale)) would overflow past what raising
    its weights' scale 2x covers, and the bias stays float."""
    b = GraphBuilder(seed)
    w = b.he((6, 3, 3, 3), 27)
    bias = np.linspace(-0.06, 0.06, 6, dtype=np.float32)
    y = b.node("Conv", [b.input("x", ["N", 3, 8, 8]), b.const("w", w), b.const("b", bias)],
               kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return b.build([y], name="tiny_input_conv")


def test_a_quantized_conv_with_a_float_bias_keeps_its_bias():
    """onnxruntime's WeightBiasQuantization would rewrite the float bias beside the
    quantized weight as Cast<int32>(Round(b / (x_scale * w_scale))) and wrap it: the output
    would be about the bias negated or garbage (0 dB). Guarded, the default session
    computes the Conv in float from its DequantizeLinear inputs, as the graph says."""
    model = tiny_input_conv()
    x = (np.random.default_rng(0).standard_normal((16, 3, 8, 8)) * 1e-6).astype(np.float32)
    result = onnxq.quantize(model, None, "A16W8", {"x": x}, progress=False)
    assert any(b.startswith("b") and "overflow" in b for b in result.summary.float_biases)
    quantized = result.model
    onnx.checker.check_model(quantized)
    conv = next(n for n in quantized.graph.node if n.op_type == "Conv")
    dq = producers(quantized)[conv.input[0]]
    scale = next(t for t in quantized.graph.initializer if t.name == dq.input[1])
    assert dq.op_type == "DequantizeLinear" and list(scale.dims) == [3]
    out = default_run(quantized, x)
    np.testing.assert_allclose(out, default_run(quantized, x, ["WeightBiasQuantization"]), rtol=1e-5, atol=1e-7)
    assert sqnr_db(default_run(model, x), out) > 60
