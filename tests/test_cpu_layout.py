"""CPU targets keep a float Add -> LayerNormalization apart (emit/cpu_layout.py): the same
numbers, without onnxruntime's slower fused SkipLayerNormalization."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from helpers import GraphBuilder, cosine, random_feeds, run

import onnxq
from onnxq.config.compose import compose_config


def residual_block() -> onnx.ModelProto:
    """x -> MatMul -> + x -> LayerNorm -> MatMul: a post-LN transformer block's residual."""
    b = GraphBuilder(12)
    x = b.input("x", ["N", 8, 32])
    h = b.node("Add", [b.matmul(x, 32, 32), x])
    ln = b.node("LayerNormalization", [h, b.const("gamma", np.ones(32, np.float32)),
                                       b.const("beta", np.zeros(32, np.float32))], axis=-1)
    return b.build([b.matmul(ln, 32, 16)], opset=17)


def _optimized_ops(model: onnx.ModelProto, tmp_path, level: ort.GraphOptimizationLevel) -> list[str]:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def _quantize(target: str):
    model = residual_block()
    config = compose_config("U8S8", None, {"target": target})
    return model, onnxq.quantize(model, None, config, random_feeds(model, 16, seed=2))


def test_cpu_targets_write_the_residual_add_as_sum(tmp_path):
    model, result = _quantize("x86-avx2")
    ops = [n.op_type for n in result.model.graph.node]
    assert "Sum" in ops and "Add" not in ops
    assert any("written as Sum" in n for n in result.summary.note_texts)
    assert "SkipLayerNormalization" not in _optimized_ops(result.model, tmp_path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    # Sum adds bit for bit as Add did: with the Add put back, the reference arithmetic agrees exactly.
    as_add = onnx.ModelProto()
    as_add.CopyFrom(result.model)
    for node in as_add.graph.node:
        if node.op_type == "Sum":
            node.op_type = "Add"
    feeds = random_feeds(model, 4, seed=5)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    for feed in feeds:
        got = [ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
               .run(None, feed)[0] for m in (result.model, as_add)]
        np.testing.assert_array_equal(got[0], got[1])
    assert cosine(run(result.model, feeds), run(model, feeds)) > 0.99


def test_gpu_targets_keep_the_add_for_the_fused_kernel(tmp_path):
    _, result = _quantize("gpu")
    ops = [n.op_type for n in result.model.graph.node]
    assert "Add" in ops and "Sum" not in ops
    # which onnxruntime fuses (here on the CPU provider, where it is the slower choice)
    assert "SkipLayerNormalization" in _optimized_ops(result.model, tmp_path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
