"""Format and precision settings as a new user gives them: the same spelling works from
Python as from a file, and a setting the chosen path cannot honour is refused in one line
(exit 2) instead of giving another model than the one asked for with exit 0."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db

import onnxq
from onnxq.cli import main
from onnxq.config.spec import DType, QuantFormat, Target
from onnxq.evaluate import compare_models, format_comparison

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "digits_cnn.onnx"
DATA = ROOT / "models" / "digits_calib.npz"


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _one_error_line(capsys, code: int, *words: str) -> str:
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxq: error: "), lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_enum_settings_in_code_take_any_case(tmp_path):
    """`quant_format = "QOperator"` gave plain QDQ (it equalled no member); "X86-AVX2" and
    "INT8" raised a bare ValueError. They now read as a file's do."""
    config = onnxq.get_preset("U8S8")
    config.quant_format = "QOperator"
    config.target = "X86-AVX2"
    config.global_quant_config.weight.dtype = "INT8"
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(MODEL, out, config, str(DATA), progress=False)
    read = result.config  # read on a copy: the caller's config stays as they wrote it
    assert read.quant_format is QuantFormat.QOPERATOR and read.target is Target.X86_AVX2
    assert read.global_quant_config.weight.dtype is DType.INT8
    assert config.quant_format == "QOperator" and config.global_quant_config.weight.dtype == "INT8"
    assert _ops(out)["QLinearConv"] == 3
    onnx.checker.check_model(str(out), full_check=True)
    x = np.load(DATA)[onnx.load(str(MODEL)).graph.input[0].name][:16]
    feed = {onnx.load(str(MODEL)).graph.input[0].name: x}
    assert sqnr_db(run(MODEL, feed), run(out, feed)) > 20  # measured 38.8 dB (target x86-avx2, on a CPU with VNNI)


@pytest.mark.parametrize("flags, words", [
    (["--per-group", "8"], ["blocks", "ai.onnx", "opset 21"]),
    (["--preset", "FP8_E4M3"], ["float8", "ai.onnx", "opset 19"]),
])
def test_contrib_qdq_refuses_what_it_cannot_write(tmp_path, capsys, flags, words):
    """com.microsoft Q/DQ has no block_size and no float8: per-group weights gave the float
    model back with exit 0, float8 a raw onnxruntime traceback."""
    out = tmp_path / "q.onnx"
    code = main(["quantize", str(MODEL), str(out), "--calib-data", str(DATA), "--qdq-domain", "com.microsoft", *flags])
    _one_error_line(capsys, code, *words)
    assert not out.exists()


def test_contrib_qdq_still_writes_int16(tmp_path):
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(MODEL), str(out), "--calib-data", str(DATA), "--qdq-domain", "com.microsoft",
                 "--activation-type", "int16", "--quiet"]) == 0
    model = onnx.load(str(out))
    assert any(n.domain == "com.microsoft" and n.op_type == "QuantizeLinear" for n in model.graph.node)


@pytest.mark.parametrize("flags, words", [
    (["--calib-method", "percentile", "--percentile", "99.9"], ["--calib-method percentile", "run time"]),
    (["--activation-type", "int16"], ["--activation-type int16", "uint8"]),
    (["--preset", "FP8_E4M3"], ["float8_e4m3fn", "uint8"]),
])
def test_dynamic_refuses_settings_it_would_ignore(tmp_path, capsys, flags, words):
    """Each gave a file byte-identical to plain --dynamic, with exit 0."""
    out = tmp_path / "q.onnx"
    code = main(["quantize", str(MODEL), str(out), "--calib-data", str(DATA), "--dynamic", *flags])
    _one_error_line(capsys, code, *words)
    assert not out.exists()


def test_convert_refuses_extended_ops(tmp_path, capsys):
    """`convert --to float` of a qdq-ext model kept its extended ops (a model no default
    session loads) and reported them removed; MX models were called "not quantized"."""
    six = tmp_path / "six.yaml"
    six.write_text("global_quant_config:\n  input_tensors: {dtype: int8, bits: 6}\n"
                   "  output_tensors: {dtype: int8, bits: 6}\n")
    ext = tmp_path / "ext.onnx"
    assert main(["quantize", str(MODEL), str(ext), "--calib-data", str(DATA), "--config", str(six),
                 "--format", "qdq-ext", "--quiet"]) == 0
    capsys.readouterr()
    for to in ("float", "qdq", "qoperator"):
        out = tmp_path / f"{to}.onnx"
        _one_error_line(capsys, main(["convert", str(ext), str(out), "--to", to]), "OnnxqQuantizeDequantize",
                        "--format qdq")
        assert not out.exists()


def test_qdq_ext_figures_say_how_the_model_ran(tmp_path):
    """No default session loads a qdq-ext model: the check and compare said one did."""
    config = onnxq.compose_config("U8S8", None, {"quant_format": "qdq-ext", "global_quant_config": {
        "input_tensors": {"dtype": "int8", "bits": 6}, "output_tensors": {"dtype": "int8", "bits": 6}}})
    out = tmp_path / "ext.onnx"
    result = onnxq.quantize(MODEL, out, config, str(DATA), progress=False)
    line = result.summary.fidelity.line()
    assert "extended ops registered" in line and "default onnxruntime session" not in line
    assert result.summary.fidelity.sqnr_db > 20  # measured 26.7 dB
    text = format_comparison(compare_models(MODEL, out, str(DATA), max_samples=32))
    assert "extended ops registered" in text.splitlines()[0]
    plain = onnxq.quantize(MODEL, tmp_path / "plain.onnx", "U8S8", str(DATA), progress=False)
    assert "default onnxruntime session" in plain.summary.fidelity.line()


def test_reasons_for_float_nodes_name_the_real_cause(tmp_path):
    """A Relu after an MX (block format) Conv was said to follow a Conv whose "input is not
    quantized"; a constant embedding table the config keeps float was "non-constant data"."""
    mx = tmp_path / "mx.yaml"
    mx.write_text("quant_format: qdq-ext\nlayer_type_quant_config:\n"
                  "  Conv: {input_tensors: {dtype: mxint8}, weight: {dtype: mxint8}}\n")
    config = onnxq.compose_config(None, str(mx))
    result = onnxq.quantize(MODEL, tmp_path / "mx.onnx", config, str(DATA), progress=False)
    relus = [why for op, why in result.summary.float_nodes.values() if op == "Relu"]
    assert relus and all("lowered as block format" in why for why in relus), relus

    rng = np.random.default_rng(0)
    table = onnx.numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "table")
    w = onnx.numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
         onnx.helper.make_node("MatMul", ["e", "w"], ["y"], name="mm")], "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])], [table, w])
    path = tmp_path / "embed.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    config = onnxq.compose_config("W8_DYNAMIC", None, {"layer_type_quant_config": {"Gather": {"weight": {"dtype": "float32"}}}})
    result = onnxq.quantize(path, tmp_path / "embed.q.onnx", config, None, progress=False)
    assert "kept float by the config" in result.summary.float_nodes["embed"][1], result.summary.float_nodes


def test_a_static_calibration_method_beside_dynamic_matmuls_is_kept(tmp_path):
    """Entropy calibration for the static layers, dynamic Gemm: the method is theirs."""
    config = {"global_quant_config": {"input_tensors": {"dtype": "uint8", "calib_method": "entropy"},
                                      "weight": {"dtype": "int8"}},
              "layer_type_quant_config": {"Gemm": {"input_tensors": {"is_dynamic": True}}}}
    out = tmp_path / "q.onnx"
    onnxq.quantize(MODEL, out, config, str(DATA), progress=False)
    assert _ops(out)["DynamicQuantizeLinear"] >= 1


def test_bias_correction_of_a_float16_gemm(tmp_path):
    """A float16 [N, C] input's mean came back unsummed over the samples, and bias
    correction failed on its shape."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 32)) / 6).astype(np.float16)
    b = rng.normal(0, .1, 24).astype(np.float16)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=1)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, ["N", 32])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, ["N", 24])],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    calib = [{"x": (rng.standard_normal((1, 32)) + 0.5).astype(np.float16)} for _ in range(8)]
    config = {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}, "algo_config": [{"name": "bias_correction"}]}
    result = onnxq.quantize(model, None, config, calib, progress=False)
    assert any("1 of 1 biases corrected" in str(n) for n in result.summary.notes)
