"""QOperator format (issue 12): each op with an integer kernel, quantized as QDQ and as
QOperator, gives outputs within one output quantization step of each other in a default
onnxruntime session; inside the integer region there is no Q/DQ; `onnxq convert`
round-trips qdq -> qoperator -> qdq with identical outputs, and `--to float` strips
every Q/DQ."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, conv_relu_chain, random_feeds, run, sqnr_db, stack_feeds

import onnxq
from onnxq.cli import main

ROOT = Path(__file__).resolve().parents[1]
Builder = Callable[[], onnx.ModelProto]


def _conv() -> onnx.ModelProto:
    return conv_relu_chain()


def _matmul() -> onnx.ModelProto:
    b = GraphBuilder(4)
    x = b.input("x", ["N", 12, 24])
    return b.build([b.matmul(b.relu(b.matmul(x, 24, 32)), 32, 16)], name="matmul2")


def _gemm() -> onnx.ModelProto:
    b = GraphBuilder(3)
    x = b.input("x", ["N", 32])
    return b.build([b.gemm(b.relu(b.gemm(x, 32, 48)), 48, 10)], name="gemm")


def _binary(op: str) -> Builder:
    def build() -> onnx.ModelProto:
        b = GraphBuilder(5)
        x = b.input("x", ["N", 4, 8, 8])
        left, right = b.relu(b.conv(x, 4, 6)), b.conv(x, 4, 6, k=1)
        return b.build([b.conv(b.node(op, [left, right]), 6, 4, k=1)], name=op.lower())
    return build


def _concat() -> onnx.ModelProto:
    b = GraphBuilder(2)
    x = b.input("x", ["N", 4, 8, 8])
    cat = b.node("Concat", [b.relu(b.conv(x, 4, 6, k=1)), b.conv(x, 4, 5)], axis=1)
    return b.build([b.conv(cat, 11, 4, k=1)], name="concat")


def _unary(op: str, **attrs: object) -> Builder:
    def build() -> onnx.ModelProto:
        b = GraphBuilder(6)
        x = b.input("x", ["N", 4, 8, 8])
        y = b.node(op, [b.conv(x, 4, 6)], **attrs)
        return b.build([b.conv(y, 6, 4, k=1)], name=op.lower())
    return build


def _softmax() -> onnx.ModelProto:
    b = GraphBuilder(7)
    x = b.input("x", ["N", 32])
    y = b.node("Softmax", [b.gemm(x, 32, 16)], axis=-1)
    return b.build([b.gemm(y, 16, 8)], name="softmax")


def _data_movement() -> onnx.ModelProto:
    """MaxPool, Reshape, Transpose and Flatten between integer kernels."""
    b = GraphBuilder(8)
    x = b.input("x", ["N", 4, 8, 8])
    y = b.node("MaxPool", [b.relu(b.conv(x, 4, 8))], kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Transpose", [y], perm=[0, 1, 3, 2])
    y = b.node("Reshape", [y, b.const("shape", np.array([0, 8, 16], np.int64))])
    y = b.node("Flatten", [y], axis=1)
    return b.build([b.gemm(y, 128, 10)], name="movement")


CASES: dict[str, tuple[Builder, str, dict]] = {
    "QLinearConv": (_conv, "QLinearConv", {}),
    "QLinearMatMul": (_matmul, "QLinearMatMul", {}),
    "MatMulIntegerToFloat": (_matmul, "MatMulIntegerToFloat", {}),
    "QGemm": (_gemm, "QGemm", {}),
    "QLinearAdd": (_binary("Add"), "QLinearAdd", {}),
    "QLinearMul": (_binary("Mul"), "QLinearMul", {}),
    "QLinearConcat": (_concat, "QLinearConcat", {}),
    "QLinearAveragePool": (_unary("AveragePool", kernel_shape=[2, 2], strides=[2, 2]), "QLinearAveragePool", {}),
    "QLinearGlobalAveragePool": (_unary("GlobalAveragePool"), "QLinearGlobalAveragePool", {}),
    "QLinearSigmoid": (_unary("Sigmoid"), "QLinearSigmoid", {}),
    "QLinearLeakyRelu": (_unary("LeakyRelu", alpha=0.1), "QLinearLeakyRelu", {}),
    "QLinearSoftmax": (_softmax, "QLinearSoftmax", {"layer_type_quant_config": {"Softmax": {}}}),
    "data movement": (_data_movement, "MaxPool", {}),
}


def _quantize(model: onnx.ModelProto, data: dict, fmt: str, extra: dict) -> onnx.ModelProto:
    config = onnxq.as_config({"quant_format": fmt, **extra})
    return onnxq.quantize(model, None, config, data, progress=False).model


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _output_step(model: onnx.ModelProto) -> float:
    """The scale of the quantized tensor the model's first output dequantizes (1e-6 when
    the output is float: then the two formats must agree to float rounding)."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    out = model.graph.output[0].name
    producer = next(n for n in model.graph.node if out in n.output)
    if producer.op_type == "DequantizeLinear":
        return float(inits[producer.input[1]])
    return 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_qoperator_matches_qdq_within_one_step(case):
    build, kernel, extra = CASES[case]
    model = build()
    data = stack_feeds(random_feeds(model, 24, seed=1))
    qdq = _quantize(model, data, "qdq", extra)
    qop = _quantize(model, data, "qoperator", extra)
    onnx.checker.check_model(qop, full_check=True)
    if case == "data movement":
        assert {"MaxPool", "Transpose", "Reshape", "Flatten"} <= set(_ops(qop))
        moved = [n for n in qop.graph.node if n.op_type in ("MaxPool", "Transpose", "Reshape", "Flatten")]
        types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(qop).graph.value_info}
        assert all(types.get(n.output[0]) == onnx.TensorProto.UINT8 for n in moved)
    else:
        assert kernel in _ops(qop), _ops(qop)
        assert kernel not in _ops(qdq)
    # Q only at the entry, DQ only at the exit: nothing between integer ops.
    assert _ops(qop).count("QuantizeLinear") <= len(qop.graph.input)
    assert _ops(qop).count("DequantizeLinear") <= len(qop.graph.output)
    feeds = random_feeds(model, 8, seed=2)
    a, b = run(qdq, feeds), run(qop, feeds)
    assert np.max(np.abs(a - b)) <= _output_step(qdq) * 1.001 + 1e-5


def test_kept_patterns_are_named(tmp_path):
    """A MatMul whose activation is int16 has no QLinearMatMul: it stays QDQ, and the note says why."""
    model = _matmul()
    data = stack_feeds(random_feeds(model, 16, seed=3))
    config = onnxq.as_config({"preset": "A16W8", "quant_format": "qoperator"})
    result = onnxq.quantize(model, None, config, data, progress=False)
    note = next(n for n in result.summary.note_texts if n.startswith("qoperator format"))
    assert "kept as Q/DQ" in note and "not an 8-bit integer" in note
    onnx.checker.check_model(result.model)


@pytest.mark.parametrize("settings", [{"preset": "FP8_E4M3", "algo_config": [], "target_algorithms": False},
                                      {"global_quant_config": {"weight": {"dtype": "int4", "qscheme": "per_group",
                                                                          "group_size": 8}}}])
def test_layers_whose_weights_qoperator_cannot_take_are_named(settings):
    """float8 and int4 block weights: the note said only "qoperator format: nothing", or
    left the int4 Gemm out of both lists (format trial)."""
    model = _matmul()
    data = stack_feeds(random_feeds(model, 16, seed=3))
    result = onnxq.quantize(model, None, onnxq.as_config({**settings, "quant_format": "qoperator"}), data,
                            progress=False)
    note = next(n for n in result.summary.note_texts if n.startswith("qoperator format"))
    assert "kept as Q/DQ: MatMul: an input is not an 8-bit integer DequantizeLinear" in note, note


def test_convert_round_trip_and_float(tmp_path, capsys):
    model = _data_movement()
    path = tmp_path / "float.onnx"
    onnx.save(model, str(path))
    data = stack_feeds(random_feeds(model, 24, seed=4))
    np.savez(tmp_path / "calib.npz", **data)
    qdq = tmp_path / "qdq.onnx"
    assert main(["quantize", str(path), str(qdq), "--calib-data", str(tmp_path / "calib.npz"), "--quiet"]) == 0
    steps = {}
    for src, to in (("qdq", "qoperator"), ("qoperator", "qdq2"), ("qoperator", "float")):
        src_path = tmp_path / f"{src}.onnx"
        fmt = to.rstrip("2")
        flag = "--format" if to == "qdq2" else "--to"  # quantize's name for it works too (generative trial)
        assert main(["convert", str(src_path), str(tmp_path / f"{to}.onnx"), flag, fmt]) == 0
        steps[to] = onnx.load(str(tmp_path / f"{to}.onnx"))
        onnx.checker.check_model(steps[to], full_check=True)
    feeds = random_feeds(model, 8, seed=5)
    reference = run(onnx.load(str(qdq)), feeds)
    assert np.array_equal(run(steps["qoperator"], feeds), reference)
    assert np.array_equal(run(steps["qdq2"], feeds), reference)
    assert "QGemm" not in _ops(steps["qdq2"]) and "DequantizeLinear" in _ops(steps["qdq2"])
    as_float = steps["float"]
    assert not {"QuantizeLinear", "DequantizeLinear", "QGemm", "QLinearConv"} & set(_ops(as_float))
    flt = run(model, feeds)
    # Only rounding is gone: closer to the float model than the quantized one is, or as close.
    assert np.abs(run(as_float, feeds) - flt).mean() <= np.abs(reference - flt).mean() * 1.05 + 1e-6


def test_convert_refuses_a_float_model_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "float.onnx"
    onnx.save(conv_relu_chain(), str(path))
    out = tmp_path / "out.onnx"
    assert main(["convert", str(path), str(out), "--to", "qoperator"]) == 2
    assert "not a quantized model" in capsys.readouterr().err
    assert not out.exists()
    assert main(["convert", str(path), str(path), "--to", "qdq"]) == 2
    assert "is the input model" in capsys.readouterr().err


def test_convert_names_kernels_it_cannot_rewrite(tmp_path, capsys):
    """A dynamic model (DynamicQuantizeLinear + MatMulInteger) is quantized, not 'not a
    quantized model'; --to float refuses it in one line (leaving the kernels would not be
    float), --to qdq leaves them and says so; inspect says the model is already quantized."""
    model = _matmul_chain(tmp_path)
    dynamic = tmp_path / "dynamic.onnx"
    assert main(["quantize", str(model), str(dynamic), "--preset", "W8_DYNAMIC", "--quiet"]) == 0
    assert "MatMulInteger" in _ops(onnx.load(str(dynamic)))
    capsys.readouterr()
    out = tmp_path / "out.onnx"
    assert main(["convert", str(dynamic), str(out), "--to", "float"]) == 2
    err = capsys.readouterr().err
    assert "MatMulInteger" in err and "cannot turn back into float" in err and not out.exists()
    assert main(["convert", str(dynamic), str(out), "--to", "qdq"]) == 0
    assert "left as they are (weight-only or dynamic kernels): DynamicQuantizeLinear" in capsys.readouterr().out
    assert main(["inspect", str(dynamic)]) == 0
    assert "already quantized: " in capsys.readouterr().out


def _matmul_chain(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]), onnx.helper.make_node("Relu", ["h"], ["r"]),
         onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])], "chain",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])], [w1, w2])
    path = tmp_path / "chain.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path))
    return path


def test_bundled_model_in_qoperator_format(tmp_path):
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(ROOT / "models" / "digits_cnn.onnx"), str(out), "--calib-data",
                 str(ROOT / "models" / "digits_calib.npz"), "--format", "qoperator", "--quiet"]) == 0
    ops = _ops(onnx.load(str(out)))
    assert ops.count("QLinearConv") == 3 and "QGemm" in ops and "DequantizeLinear" not in ops


def test_int8_activations_with_uint8_weights_keep_their_q_dq(tmp_path):
    """onnxruntime has no QLinearConv/QGemm for int8 activations with uint8 weights: those
    stay Q/DQ (quantized, named in the note) where every node had gone float on loading."""
    digits = ROOT / "models" / "digits_cnn.onnx"
    with np.load(ROOT / "models" / "digits_calib.npz") as f:
        data = {"input": f["input"]}
    config = {"global_quant_config": {"input_tensors": {"dtype": "int8"}, "output_tensors": {"dtype": "int8"},
                                      "weight": {"dtype": "uint8"}}, "quant_format": "qoperator"}
    result = onnxq.quantize(str(digits), tmp_path / "q.onnx", config, data, progress=False)
    note = next(n for n in result.summary.note_texts if n.startswith("qoperator format"))
    assert "no QLinearConv kernel for int8 inputs with uint8 weights x3" in note, note
    ops = _ops(onnx.load(str(tmp_path / "q.onnx")))
    assert "QLinearConv" not in ops and ops.count("Conv") == 3 and "QLinearAdd" in ops
    assert sum(result.summary.quantized_by_op.values()) == 11
    ref = run(onnx.load(str(digits)), {"input": data["input"][:32]})
    assert sqnr_db(ref, run(tmp_path / "q.onnx", {"input": data["input"][:32]})) > 20


@pytest.mark.parametrize("case", ["corrupt", "unknown_to", "wrong_data"])
def test_format_commands_refuse_bad_input_in_one_line(tmp_path, case):
    import subprocess
    import sys

    model = tmp_path / "q.onnx"
    assert main(["quantize", str(ROOT / "models" / "digits_cnn.onnx"), str(model), "--calib-data",
                 str(ROOT / "models" / "digits_calib.npz"), "--quiet"]) == 0
    out = tmp_path / "out.onnx"
    if case == "corrupt":
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(b"not a model")
        argv = ["convert", str(bad), str(out), "--to", "qdq"]
    elif case == "unknown_to":
        argv = ["convert", str(model), str(out), "--to", "int3"]
    else:
        np.savez(tmp_path / "x.npz", x=np.zeros((2, 3), np.float32))
        argv = ["run", str(model), "--data", str(tmp_path / "x.npz"), "--out", str(tmp_path / "o.npz")]
        out = tmp_path / "o.npz"
    proc = subprocess.run([sys.executable, "-m", "onnxq", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(("onnxq: error:", "onnxq convert: error:"))
    assert not out.exists()


def test_one_output_channel_conv_becomes_qlinearconv():
    """A per-channel Conv with a single output channel: its bias scale ([1]) equals the
    product of input and weight scale (one value); the check used to crash on the shapes."""
    b = GraphBuilder(5)
    x = b.input("x", ["N", 3, 16, 16])
    model = b.build([b.conv(b.relu(b.conv(x, 3, 8)), 8, 1)], name="one_channel")
    data = stack_feeds(random_feeds(model, 24, seed=1))
    qop = _quantize(model, data, "qoperator", {})
    onnx.checker.check_model(qop, full_check=True)
    assert _ops(qop).count("QLinearConv") == 2
    ref, out = run(model, data), run(qop, data)
    assert 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - out) ** 2)) > 25


def test_analyze_names_the_qoperator_format(tmp_path, capsys):
    """analyze measures Q/DQ models; on integer kernels it finds no layer and says to
    analyze the Q/DQ model, which has every layer."""
    model, calib = ROOT / "models" / "digits_cnn.onnx", ROOT / "models" / "digits_calib.npz"
    q, qdq = tmp_path / "q.onnx", tmp_path / "qdq.onnx"
    assert main(["quantize", str(model), str(q), "--calib-data", str(calib), "--format", "qoperator", "--quiet"]) == 0
    assert main(["analyze", str(model), str(q), "--data", str(calib), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "(0 of 0)" in out and "analyze the Q/DQ model" in out
    assert main(["quantize", str(model), str(qdq), "--calib-data", str(calib), "--quiet"]) == 0
    assert main(["analyze", str(model), str(qdq), "--data", str(calib), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "QOperator" not in out and "most sensitive first" in out and "(0 of 0)" not in out


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_a_pad_runs_on_the_8_bit_tensor(tmp_path, mode):
    """A Pad between quantized ops pads the 8-bit tensor itself (no DequantizeLinear /
    QuantizeLinear around it), a constant Pad with the zero point: 0 in float whatever the
    input's range; its output matches the QDQ model's, and converts back."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((5, 4, 3, 3)) * 0.3).astype(np.float32), "w2")
    pads = numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1"),  # signed output: a nonzero zero point
             helper.make_node("Pad", ["a", "pads"], ["p"], name="pad", mode=mode),
             helper.make_node("Conv", ["p", "w2"], ["y"], name="conv2")]
    graph = helper.make_graph(nodes, "padded", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5, 10, 10])], [w1, w2, pads])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = random_feeds(model, 16, seed=1)
    qdq = onnxq.quantize(model, None, "U8S8", feeds, progress=False).model
    qop = onnxq.quantize(model, None, {"preset": "U8S8", "quant_format": "qoperator"}, feeds, progress=False).model
    onnx.checker.check_model(qop, full_check=True)
    producers = {o: n.op_type for n in qop.graph.node for o in n.output}
    pad = next(n for n in qop.graph.node if n.op_type == "Pad")
    assert producers[pad.input[0]] == "QLinearConv"
    test = random_feeds(model, 4, seed=2)
    ref, got = np.concatenate(run(qdq, test)), np.concatenate(run(qop, test))
    assert np.abs(ref - got).max() <= 0.05 * np.abs(ref).max()
    onnx.save(qop, tmp_path / "qop.onnx")
    assert main(["convert", str(tmp_path / "qop.onnx"), str(tmp_path / "back.onnx"), "--to", "qdq"]) == 0
    np.testing.assert_array_equal(np.concatenate(run(str(tmp_path / "back.onnx"), test)), got)


def test_compare_says_integer_kernels_have_no_reference_form(tmp_path):
    """compare --kernels both on a QOperator model printed reference lines identical to the
    deployed ones without a word (trust trial)."""
    from onnxq.evaluate import compare_models, format_comparison
    model = _matmul()
    data = stack_feeds(random_feeds(model, 16, seed=3))
    result = onnxq.quantize(model, None, onnxq.as_config({"quant_format": "qoperator"}), data, progress=False)
    onnx.save(model, tmp_path / "f.onnx")
    onnx.save(result.model, tmp_path / "q.onnx")
    both = compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), data, kernels="both")
    assert both.integer_kernels and "which have no reference form" in format_comparison(both)


def test_a_float_op_feeding_a_quantized_one_is_not_listed_as_kept_q_dq():
    """Softmax stays float (float_op_types) and its output is quantized for the MatMul after
    it: the qoperator note had listed it as "kept as Q/DQ" while the float list said it was
    kept float (encoder trial)."""
    from helpers import GraphBuilder, random_feeds

    b = GraphBuilder(0)
    x = b.input("x", ["batch", 16])
    model = b.build([b.matmul(b.node("Softmax", [b.matmul(x, 16, 16)], axis=-1), 16, 8)], name="softmax_mlp")
    config = onnxq.compose_config("U8S8", None, {"quant_format": "qoperator"})
    result = onnxq.quantize(model, None, config, random_feeds(model, 16, seed=1), progress=False)
    (note,) = [n for n in result.summary.note_texts if n.startswith("qoperator format")]
    assert "Softmax" not in note and "kept as Q/DQ" not in note and "MatMulIntegerToFloat 2" in note, note
    assert any(name.startswith("softmax") for name in result.plan.float_nodes)
