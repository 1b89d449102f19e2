"""Every data type and preset: numpy Q/DQ matches onnxruntime exactly, and each preset's
model passes the checker, runs, stores the stated types and tracks float by an SQNR floor.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq import qmath
from onnxq.config.spec import DType
from tests.helpers import gemm, random_feeds, residual, sqnr_db

ONNX_TYPES = {
    "int4": TensorProto.INT4, "uint4": TensorProto.UINT4, "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8, "int16": TensorProto.INT16, "uint16": TensorProto.UINT16,
    "float8_e4m3fn": TensorProto.FLOAT8E4M3FN, "float8_e5m2": TensorProto.FLOAT8E5M2,
}


def _qdq_model(dtype: str, scale: float, zero_point: np.ndarray) -> onnx.ModelProto:
    zp = helper.make_tensor("zp", ONNX_TYPES[dtype], [], [zero_point.astype(np.float32).item()]
                            if dtype.startswith("float8") else [int(zero_point)])
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000])],
        [numpy_helper.from_array(np.array(scale, np.float32), "s"), zp],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("dtype", sorted(ONNX_TYPES))
@pytest.mark.parametrize("symmetric", [True, False])
def test_numpy_qdq_matches_onnxruntime(dtype, symmetric):
    """Round trip Q then DQ: numpy (qmath) and onnxruntime agree bit for bit, saturation,
    ties and zero points included."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * 3).astype(np.float32)
    x[:8] = [0.0, -0.0, 1e9, -1e9, 2.5, -2.5, 0.5, -0.5]  # saturation and ties
    scale, zp = qmath.compute_qparams(-4.0, 6.0, dtype, symmetric)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(_qdq_model(dtype, float(scale), np.asarray(zp)).SerializeToString(), options)
    ours = qmath.dequantize(qmath.quantize(x, scale, zp, dtype), scale, zp)
    np.testing.assert_array_equal(ours, session.run(None, {"x": x})[0])


# Preset -> (SQNR floor in dB on the residual CNN, stored dtype that must appear).
PRESET_FLOORS = {
    "U8S8": (30.0, np.int8),
    "S8S8": (25.0, np.int8),
    "A16W8": (30.0, np.int16),
    "U16S8": (30.0, np.uint16),
    "S16S8": (30.0, np.int16),
    "XINT8": (18.0, np.int8),
    "FP8_E4M3": (18.0, ml_dtypes.float8_e4m3fn),
    "W8_DYNAMIC": (30.0, np.int8),
    "W4_GROUP128": (15.0, np.int8),
    "FP16": (50.0, np.float16),
    "BF16": (35.0, ml_dtypes.bfloat16),
}


@pytest.mark.parametrize("preset", sorted(PRESET_FLOORS))
def test_preset_end_to_end(preset):
    # Dynamic quantization is for MatMul/Gemm (its preset leaves convolutions float).
    model = gemm() if preset == "W8_DYNAMIC" else residual()
    calib = random_feeds(model, 24, seed=1)
    result = onnxq.quantize(model, None, preset, calib)
    q = result.model
    onnx.checker.check_model(q, full_check=True)
    options = ort.SessionOptions()
    if preset == "FP8_E4M3":  # onnxruntime's CPU QDQ fusions reject float8 graphs
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    floor, stored = PRESET_FLOORS[preset]
    feeds = random_feeds(model, 8, seed=2)
    ref = ort.InferenceSession(model.SerializeToString())
    test = ort.InferenceSession(q.SerializeToString(), options)
    r = np.concatenate([ref.run(None, f)[0] for f in feeds])
    t = np.concatenate([test.run(None, f)[0] for f in feeds])
    assert sqnr_db(r, t) >= floor, f"{preset}: {sqnr_db(r, t):.1f} dB < {floor}"
    dtypes = {numpy_helper.to_array(i).dtype for i in q.graph.initializer}
    assert np.dtype(stored) in dtypes, f"{preset}: no {np.dtype(stored)} initializer in {dtypes}"
    if preset not in ("FP16", "BF16"):  # on CPU those store weights converted, compute float32
        assert result.summary.quantized_by_op, f"{preset}: nothing quantized"


def test_sixteen_bit_activations_beat_eight_bit():
    """Same weights (int8 per channel): int16 activations must track float closer than uint8."""
    model = residual()
    calib = random_feeds(model, 24, seed=1)
    feeds = random_feeds(model, 8, seed=2)
    ref = ort.InferenceSession(model.SerializeToString())
    r = np.concatenate([ref.run(None, f)[0] for f in feeds])

    def sqnr(preset: str) -> float:
        q = onnxq.quantize(model, None, preset, calib).model
        s = ort.InferenceSession(q.SerializeToString())
        return sqnr_db(r, np.concatenate([s.run(None, f)[0] for f in feeds]))

    assert sqnr("A16W8") > sqnr("U8S8") + 1.0


def test_int32_activations_are_a_clear_error():
    with pytest.raises(onnxq.OnnxqError, match="32-bit integers are only for bias"):
        onnxq.quantize(residual(), None, {"global_quant_config": {"input_tensors": {"dtype": DType.INT32.value}}})
