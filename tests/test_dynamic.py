"""Dynamic quantization (onnxq.emit.dynamic): MatMul, Gemm, Conv and LSTM.

Each quantized model passes the full ONNX checker, runs on onnxruntime CPU, stays close to
the float model (SQNR), keeps int8/uint8 weights, and is fused by onnxruntime into its
integer kernels (counted in the graph onnxruntime saves after optimisation).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder, check_deployed, reference_run, session, sqnr_db
from onnx import TensorProto, helper, numpy_helper

from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import Config, QuantizationSpec
from onnxq.emit.dynamic import emit_dynamic
from onnxq.graph.load import load_model
from onnxq.target import resolve_target

MS = "com.microsoft"
# Reference arithmetic (helpers.reference_run) against float, measured on x86 AVX2 without
# VNNI, where target auto gives int8 weights 7 bits: MatMul/Gemm/Conv 35.0-41.8 dB (uint8
# weights 41.2), LSTM 34.5-37.4 dB. The floor is the lowest minus 2 dB; 8-bit weights (CPUs
# whose kernels are exact) only raise these figures.
SQNR_FLOOR = 32.5


def weight_spec(dtype: str = "int8", qscheme: str = "per_channel", symmetric: bool = True) -> ResolvedSpec:
    """The weight spec the planner gives a dynamic node with target auto on this CPU
    (7-bit int8 weights where DynamicQuantizeMatMul's kernel saturates)."""
    spec = merge_specs([QuantizationSpec(dtype=dtype, qscheme=qscheme, symmetric=symmetric)], "weight")
    assert spec is not None
    bits = resolve_target(Config()).weight_bits("dynamic", "uint8") if dtype == "int8" else None
    return dataclasses.replace(spec, bits=bits) if bits else spec


def quantize(proto: onnx.ModelProto, spec: ResolvedSpec | None = None, ops=("MatMul", "Gemm", "Conv", "LSTM")):
    """Load, emit dynamic on every node of `ops`; returns (quantized proto, report)."""
    model, _ = load_model(proto)
    names = {n.name: spec or weight_spec() for n in model.graph if n.op_type in ops}
    report = emit_dynamic(model, names)
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    return out, report


def optimized_ops(proto: onnx.ModelProto, tmp_path: Path) -> Counter:
    """(domain, op_type) counts of the graph onnxruntime runs after its optimisations."""
    path = tmp_path / "optimized.onnx"
    session(proto, optimized_model_filepath=str(path))
    return Counter((n.domain, n.op_type) for n in onnx.load(str(path)).graph.node)


def outputs(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return session(proto).run(None, feeds)


def integer_weights(proto: onnx.ModelProto) -> dict[str, np.dtype]:
    """dtype of input 1 (the weight) of every integer kernel in the graph."""
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    kernels = ("MatMulInteger", "ConvInteger", "DynamicQuantizeLSTM")
    return {n.name: inits[n.input[1]].dtype for n in proto.graph.node if n.op_type in kernels}


def float_initializer_elements(proto: onnx.ModelProto) -> int:
    return sum(int(np.prod(i.dims)) for i in proto.graph.initializer if i.data_type == TensorProto.FLOAT)


# -- models -----------------------------------------------------------------------------


def matmul_model(k: int = 64, n: int = 48, seed: int = 0) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 8, k])
    return b.build([b.matmul(x, k, n)], name="dyn_matmul")


def gemm_model(trans_b: int, bias: bool, seed: int = 1, **attrs) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 64])
    w = b.he((32, 64) if trans_b else (64, 32), 64)
    inputs = [x, b.const("w", w)] + ([b.const("c", b.small((32,), 0.5))] if bias else [])
    return b.build([b.node("Gemm", inputs, transB=trans_b, **attrs)], name="dyn_gemm")


def conv_model(seed: int = 2, group: int = 1, bias: bool = True) -> onnx.ModelProto:
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 8, 12, 12])
    y = b.conv(x, 8, 16, group=group, bias=bias)
    return b.build([b.conv(b.relu(y), 16, 8, k=1)], name="dyn_conv")


def feeds_for(proto: onnx.ModelProto, seed: int = 7, batch: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in proto.graph.input:
        dims = [d.dim_value or batch for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def check_close(float_model: onnx.ModelProto, quant_model: onnx.ModelProto,
                floor: float = SQNR_FLOOR) -> list[float]:
    """Every output: the quantization arithmetic reaches `floor` against float, and the
    default session is within KERNEL_MARGIN_DB of it (helpers.check_deployed). The reference
    is numpy's DynamicQuantizeLinear + MatMulInteger/ConvInteger, or for DynamicQuantizeLSTM
    onnxruntime's exact U8U8 kernel (see helpers.reference_run)."""
    feeds = feeds_for(float_model)
    floats = outputs(float_model, feeds)
    return [check_deployed(f, quant_model, feeds, floor, output=i)[0] for i, f in enumerate(floats)]


# -- MatMul / Gemm ------------------------------------------------------------------------


def test_matmul_fuses_to_dynamic_quantize_matmul(tmp_path):
    proto = matmul_model()
    quant, report = quantize(proto)
    assert list(report.quantized.values()) == ["MatMul"] and not report.skipped
    check_close(proto, quant)
    ops = optimized_ops(quant, tmp_path)
    assert ops[(MS, "DynamicQuantizeMatMul")] == 1, ops
    assert ops[("", "MatMul")] == 0 and ops[("", "MatMulInteger")] == 0, ops
    assert set(integer_weights(quant).values()) == {np.dtype(np.int8)}
    assert float_initializer_elements(quant) < 64 * 48 / 10  # only scales stay float
    assert [o.name for o in quant.graph.output] == [o.name for o in proto.graph.output]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_fuses_with_bias(tmp_path, trans_b, bias):
    proto = gemm_model(trans_b, bias)
    quant, report = quantize(proto)
    assert list(report.quantized.values()) == ["Gemm"], report
    check_close(proto, quant)
    ops = optimized_ops(quant, tmp_path)
    assert ops == Counter({(MS, "DynamicQuantizeMatMul"): 1}), ops  # the bias Add is fused too
    assert set(integer_weights(quant).values()) == {np.dtype(np.int8)}


def test_gemm_alpha_beta_and_broadcast_bias(tmp_path):
    b = GraphBuilder(3)
    x = b.input("x", ["N", 64])
    w, c = b.const("w", b.he((32, 64), 64)), b.const("c", b.small((1, 32), 0.5))
    proto = b.build([b.node("Gemm", [x, w, c], transB=1, alpha=0.5, beta=2.0)])
    quant, _ = quantize(proto)
    check_close(proto, quant)
    assert optimized_ops(quant, tmp_path)[(MS, "DynamicQuantizeMatMul")] == 1


def test_gemm_scalar_and_full_bias():
    for shape in [(1,), (4, 32)]:
        b = GraphBuilder(4)
        x = b.input("x", [4, 64])
        w, c = b.const("w", b.he((64, 32), 64)), b.const("c", b.small(shape, 0.5))
        proto = b.build([b.node("Gemm", [x, w, c], beta=0.5)])
        quant, report = quantize(proto)
        assert not report.skipped
        check_close(proto, quant)


@pytest.mark.parametrize("dtype, symmetric", [("uint8", True), ("uint8", False), ("int8", False)])
def test_matmul_other_weight_types(tmp_path, dtype, symmetric):
    proto = matmul_model(seed=5)
    quant, _ = quantize(proto, weight_spec(dtype, symmetric=symmetric))
    check_close(proto, quant)
    assert set(integer_weights(quant).values()) == {np.dtype(dtype)}
    assert optimized_ops(quant, tmp_path)[(MS, "DynamicQuantizeMatMul")] == 1


def test_per_channel_scales_follow_columns():
    """Columns scaled 1e-3..1: per-channel keeps every column accurate, per-tensor cannot."""
    b = GraphBuilder(6)
    x = b.input("x", ["N", 64])
    w = b.he((64, 16), 64) * np.logspace(-3, 0, 16, dtype=np.float32)
    proto = b.build([b.node("MatMul", [x, b.const("w", w)])])
    feeds = feeds_for(proto)
    ref = outputs(proto, feeds)[0]

    def worst_column(spec: ResolvedSpec) -> float:
        quant = quantize(proto, spec)[0]
        check_deployed(ref, quant, feeds, float("-inf"))  # this CPU's kernels add nothing
        out = reference_run(quant, feeds)
        return min(sqnr_db(ref[:, j], out[:, j]) for j in range(16))

    per_channel, per_tensor = worst_column(weight_spec()), worst_column(weight_spec(qscheme="per_tensor"))
    # Reference arithmetic, 7-bit weights (AVX2): 30.4 dB (8-bit: 34.3); floor 2 dB below.
    assert per_channel >= 28.5, per_channel
    assert per_tensor < 10.0, per_tensor  # measured 0 dB: the smallest columns round to 0


def test_shared_input_each_node_fuses(tmp_path):
    """onnxruntime merges the two identical DynamicQuantizeLinear (CSE), so the input is
    quantized once and each node becomes MatMulIntegerToFloat."""
    b = GraphBuilder(8)
    x = b.input("x", ["N", 32])
    proto = b.build([b.matmul(x, 32, 16), b.gemm(x, 32, 24)])
    quant, report = quantize(proto)
    assert len(report.quantized) == 2
    check_close(proto, quant)
    ops = optimized_ops(quant, tmp_path)
    assert ops == Counter({(MS, "MatMulIntegerToFloat"): 2, ("", "DynamicQuantizeLinear"): 1}), ops


# -- Conv --------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 4])
def test_conv_runs_as_conv_integer(tmp_path, group):
    proto = conv_model(group=group)
    quant, report = quantize(proto)
    assert list(report.quantized.values()) == ["Conv", "Conv"] and not report.notes
    check_close(proto, quant)
    ops = optimized_ops(quant, tmp_path)
    assert ops[("", "ConvInteger")] == 2 and ops[("", "Conv")] == 0, ops
    assert set(integer_weights(quant).values()) == {np.dtype(np.int8)}


def test_conv_per_channel_with_uniform_zero_point():
    """ConvInteger takes one weight zero point; symmetric per-channel weights share it."""
    proto = conv_model(bias=False)
    quant, _ = quantize(proto, weight_spec("uint8"))
    inits = {i.name: numpy_helper.to_array(i) for i in quant.graph.initializer}
    conv = next(n for n in quant.graph.node if n.op_type == "ConvInteger")
    assert inits[conv.input[1]].dtype == np.uint8 and inits[conv.input[3]].shape == ()
    mul = next(n for n in quant.graph.node if n.op_type == "Mul" and conv.name[:6] in n.name)
    assert inits[mul.input[1]].shape == (16, 1, 1)  # one scale per output channel
    check_close(proto, quant)


def test_conv_asymmetric_per_channel_falls_back_to_per_tensor():
    proto = conv_model()
    quant, report = quantize(proto, weight_spec("uint8", symmetric=False))
    assert len(report.notes) == 2 and "per tensor" in next(iter(report.notes.values()))
    check_close(proto, quant)


# -- LSTM --------------------------------------------------------------------------------


def lstm_model(direction: str, outputs_: tuple[str, ...] = ("Y", "Y_h", "Y_c"), seed: int = 9):
    rng = np.random.default_rng(seed)
    dirs, hidden, size = (2 if direction == "bidirectional" else 1), 16, 12
    w = (rng.standard_normal((dirs, 4 * hidden, size)) / np.sqrt(size)).astype(np.float32)
    r = (rng.standard_normal((dirs, 4 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    bias = (rng.standard_normal((dirs, 8 * hidden)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (bias, "B"))]
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], list(outputs_), name="lstm",
                            hidden_size=hidden, direction=direction)
    graph = helper.make_graph(
        [node], "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, "N", size])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs_ if o], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("qscheme", ["per_channel", "per_tensor"])
def test_lstm_becomes_dynamic_quantize_lstm(tmp_path, direction, qscheme):
    proto = lstm_model(direction)
    quant, report = quantize(proto, weight_spec(qscheme=qscheme))
    assert report.quantized == {"lstm": "LSTM"}
    check_close(proto, quant)
    ops = optimized_ops(quant, tmp_path)
    assert ops == Counter({(MS, "DynamicQuantizeLSTM"): 1}), ops
    assert integer_weights(quant) and set(integer_weights(quant).values()) == {np.dtype(np.int8)}


def test_lstm_absent_output_and_asymmetric_weights():
    proto = lstm_model("reverse", ("", "Y_h"))
    quant, report = quantize(proto, weight_spec("uint8", symmetric=False))
    node = next(n for n in quant.graph.node if n.op_type == "DynamicQuantizeLSTM")
    assert list(node.output) == ["", "Y_h"]
    assert "lstm" in report.notes  # per-channel asymmetric zero points: per tensor instead
    check_close(proto, quant)


# -- skipped nodes -----------------------------------------------------------------------


def test_skips_with_reasons():
    b = GraphBuilder(10)
    x, y = b.input("x", ["N", 16]), b.input("y", [16, 8])
    dynamic_weight = b.node("MatMul", [x, y])
    trans_a = b.node("Gemm", [b.input("xt", [16, "N"]), b.const("w", b.he((16, 8), 16))], transA=1)
    c_input = b.node("Gemm", [x, b.const("w", b.he((16, 8), 16)), b.input("c", [8])])
    proto = b.build([dynamic_weight, trans_a, c_input, b.matmul(x, 16, 4)])
    model, _ = load_model(proto)
    names = [n.name for n in model.graph]
    nodes = dict.fromkeys(names, weight_spec())
    nodes[names[3]] = weight_spec("int4")
    nodes["missing"] = weight_spec()
    report = emit_dynamic(model, nodes)
    assert not report.quantized
    assert set(report.skipped) == {*names, "missing"}
    assert "not a constant" in report.skipped[names[0]]
    assert "transA" in report.skipped[names[1]]
    assert "C" in report.skipped[names[2]]
    assert "int4" in report.skipped[names[3]]
    assert [n.op_type for n in model.graph] == ["MatMul", "Gemm", "Gemm", "MatMul"]


def test_per_group_is_skipped():
    model, _ = load_model(matmul_model())
    name = next(n.name for n in model.graph)
    spec = merge_specs([QuantizationSpec(dtype="int8", qscheme="per_group", group_size=32)], "weight")
    report = emit_dynamic(model, {name: spec})
    assert "per_group" in report.skipped[name]
