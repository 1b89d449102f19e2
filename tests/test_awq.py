"""AWQ for MatMulNBits weights (issue 14): when a few input channels carry large
activations, scaling their weight rows up before round-to-nearest (and the input down by
a Mul) lowers the output error on held-out data; where it cannot help, the layer stays."""

from __future__ import annotations

import numpy as np
import onnx
from helpers import GraphBuilder, run, sqnr_db

import onnxq

K, N = 256, 96
GAIN = np.exp(np.random.default_rng(9).uniform(-1.5, 1.5, K))
GAIN[:8] *= 20  # outlier channels, as LLM hidden states have


def _model() -> onnx.ModelProto:
    b = GraphBuilder(1)
    x = b.input("x", ["N", 8, K])
    w = (np.random.default_rng(0).standard_normal((K, N)) * 0.05).astype(np.float32)
    return b.build([b.node("MatMul", [x, b.const("w", w)])], name="mm")


def _data(n: int, seed: int, gain: np.ndarray = GAIN) -> dict[str, np.ndarray]:
    return {"x": (np.random.default_rng(seed).standard_normal((n, 8, K)) * gain).astype(np.float32)}


def _quantize(algorithms: list[dict], data: dict) -> onnxq.QuantizationResult:
    config = {"preset": "W4_GROUP128", "algo_config": algorithms,
              "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}
    return onnxq.quantize(_model(), None, onnxq.as_config(config), data, progress=False)


def test_awq_protects_channels_with_large_activations():
    calib, held_out = _data(48, 1), _data(24, 2)
    ref = run(_model(), held_out)
    rtn = sqnr_db(ref, run(_quantize([], calib).model, held_out))
    result = _quantize([{"name": "awq"}], calib)
    onnx.checker.check_model(result.model)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops == ["Mul", "MatMulNBits"], ops
    assert "1 of 1 MatMul weights scaled" in " ".join(result.summary.notes)
    assert sqnr_db(ref, run(result.model, held_out)) > rtn + 1.5


def test_awq_leaves_a_layer_it_cannot_help():
    flat = np.ones(K)
    result = _quantize([{"name": "awq", "grid": 4}], _data(16, 3, flat))
    assert [n.op_type for n in result.model.graph.node] == ["MatMulNBits"]
    assert "0 of 1 MatMul weights scaled" in " ".join(result.summary.notes)
