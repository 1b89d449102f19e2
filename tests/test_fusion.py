"""The QDQ placement lets onnxruntime fuse every quantized op into its integer kernel.

The quantized model goes through an onnxruntime session at ORT_ENABLE_EXTENDED with
`optimized_model_filepath` set; the saved optimised graph is then inspected.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from helpers import (
    KERNEL_MARGIN_DB,
    MODEL_BUILDERS,
    random_feeds,
    reference_run,
    run,
    session,
    sqnr_db,
)

import onnxq
from onnxq.config import QScheme

MS = "com.microsoft"

# model -> {(domain, op): count} that must appear after onnxruntime's QDQ fusion; the float
# op types listed in FLOAT_COMPUTE must all be gone.
EXPECTED: dict[str, dict[tuple[str, str], int]] = {
    "conv_relu_chain": {("", "QLinearConv"): 3},
    "depthwise": {("", "QLinearConv"): 3},
    "conv_bn_relu": {("", "QLinearConv"): 3},
    "residual": {("", "QLinearConv"): 4, (MS, "QLinearAdd"): 1},
    "concat": {("", "QLinearConv"): 3, (MS, "QLinearConcat"): 1},
    "gemm_transB0": {(MS, "QGemm"): 2},
    "gemm_transB1": {(MS, "QGemm"): 2},
    "matmul": {},  # QLinearMatMul or MatMulIntegerToFloat, checked below
    "pooling": {
        ("", "QLinearConv"): 3,
        (MS, "QGemm"): 1,
        (MS, "QLinearAveragePool"): 1,
        (MS, "QLinearGlobalAveragePool"): 1,
    },
    "softmax_head": {
        ("", "QLinearConv"): 1,
        (MS, "QLinearGlobalAveragePool"): 1,
        (MS, "QGemm"): 1,
        # The temperature Mul feeds only the float Softmax: it stays float (no gain in int8).
        (MS, "QLinearMul"): 0,
        ("", "Softmax"): 1,
    },
}
# Ops deliberately left float: the temperature Mul only feeds the float Softmax.
EXPECTED_FLOAT = {"softmax_head": {"Mul"}}
# Reference arithmetic against float with target auto, measured on x86 AVX2 without VNNI
# (7-bit Conv/Gemm/MatMul weights then, pair-safe and never coarser now; bias correction):
# 27.5 dB (matmul) to 42.0 dB (pooling), 29.5-34.0 for the others. The floor is the lowest minus 2 dB; 8-bit weights only raise it.
FUSED_MIN_SQNR_DB = 25.5
FLOAT_COMPUTE = {"Conv", "Gemm", "MatMul", "Add", "Concat", "Mul", "AveragePool",
                 "GlobalAveragePool", "Relu", "BatchNormalization"}


def optimized_graph(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    path = tmp_path / "optimized.onnx"
    session(model, graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            optimized_model_filepath=str(path))
    assert path.is_file()
    return onnx.load(str(path))


def quantize(model: onnx.ModelProto, config: object = "U8S8") -> onnx.ModelProto:
    return onnxq.quantize(model, None, config, random_feeds(model, 16, seed=100)).model


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quantized_ops_fuse(name, tmp_path):
    model = MODEL_BUILDERS[name]()
    q = quantize(model)
    opt = optimized_graph(q, tmp_path)
    ops = Counter((n.domain or "", n.op_type) for n in opt.graph.node)
    for key, count in EXPECTED[name].items():
        assert ops[key] == count, f"{name}: {key} x{ops[key]}, expected {count}; graph: {ops}"
    if name == "matmul":
        fused = ops[("", "QLinearMatMul")] + ops[(MS, "MatMulIntegerToFloat")]
        assert fused == 2, ops
    leftover = {op for (domain, op) in ops if domain == "" and op in FLOAT_COMPUTE}
    assert leftover == EXPECTED_FLOAT.get(name, set()), f"{name}: float ops survive fusion: {ops}"
    # The whole graph runs in the integer domain: one Q for the input, and one way back to
    # float before the output (or the float Softmax): a DQ, or a final Gemm/MatMul kernel
    # that writes float itself (QGemm without y_scale, MatMulIntegerToFloat).
    assert ops[("", "QuantizeLinear")] == 1, ops
    float_writers = sum(1 for n in opt.graph.node if (n.domain, n.op_type) == (MS, "MatMulIntegerToFloat")
                        or ((n.domain, n.op_type) == (MS, "QGemm") and (len(n.input) < 8 or not n.input[7])))
    assert ops[("", "DequantizeLinear")] + float_writers == 1, ops
    # The fused model computes what the QDQ model describes.
    feeds = random_feeds(model, 8, seed=7)
    fused_out = run(session(q, graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED), feeds)
    float_out = run(model, feeds)
    ref_db = sqnr_db(float_out, reference_run(q, feeds))
    assert ref_db >= FUSED_MIN_SQNR_DB, f"{name}: reference arithmetic {ref_db:.1f} dB"
    assert sqnr_db(float_out, fused_out) >= ref_db - KERNEL_MARGIN_DB


def test_conv_transpose_runs_float_between_qdq(tmp_path):
    """onnxruntime's CPU provider has no QLinearConvTranspose: the Convs around it still fuse,
    and the ConvTranspose itself reads DQ'd int8 weights."""
    q = quantize(MODEL_BUILDERS["conv_transpose"]())
    ops = Counter(n.op_type for n in optimized_graph(q, tmp_path).graph.node)
    assert ops["QLinearConv"] == 2
    assert ops["Conv"] == 0
    assert ops["ConvTranspose"] == 1


def test_per_tensor_weights_fuse_too(tmp_path):
    config = onnxq.get_preset("U8S8")
    config.global_quant_config.weight.qscheme = QScheme.PER_TENSOR
    q = quantize(MODEL_BUILDERS["pooling"](), config)
    ops = Counter(n.op_type for n in optimized_graph(q, tmp_path).graph.node)
    assert ops["QLinearConv"] == 3 and ops["QGemm"] == 1 and ops["Conv"] == 0


def test_fusion_check_detects_unfused_graph(tmp_path):
    """Control: a QDQ model whose Relu sits between Conv and Q (S8S8 keeps it) does not fuse
    fully, so the counts above are not vacuous."""
    q = quantize(MODEL_BUILDERS["conv_relu_chain"](), "S8S8")
    ops = Counter(n.op_type for n in optimized_graph(q, tmp_path).graph.node)
    assert ops["QLinearConv"] < 3
    assert ops["QuantizeLinear"] > 1


def test_an_unfused_relu_says_why():
    """The summary's reason for a Relu left float names the condition that kept it apart."""
    from helpers import conv_relu_chain, random_feeds

    model = conv_relu_chain()
    feeds = random_feeds(model, 8, seed=1)
    off = onnxq.quantize(model, None, {"fuse_activations": False}, feeds)
    assert {r for op, r in off.summary.float_nodes.values() if op == "Relu"} == {
        "fuse_activations is off: it runs in float on the dequantized output of the Conv before it"}
