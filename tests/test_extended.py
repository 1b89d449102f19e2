"""Extended QDQ format (issue 12): onnxq's custom ops, run in onnxruntime through
onnxruntime-extensions, agree exactly with their numpy reference for every rounding mode,
integer grid and block format, edge cases included; a qdq-ext model with only int8
settings is the standard QDQ model; narrower activations run end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import conv_relu_chain, random_feeds, sqnr_db, stack_feeds
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

import onnxq
import onnxq.runtime as rt
from onnxq.errors import ConfigError
from onnxq.numerics.extended import BLOCK_FORMATS, ROUND_MODES, block_fake_quantize, fake_quantize

ROOT = Path(__file__).resolve().parents[1]


def _run_op(node: onnx.NodeProto, x: np.ndarray, inits: list[onnx.TensorProto]) -> np.ndarray:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(rt.DOMAIN, 1)])
    return rt.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]


def _qdq_op(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, qmin: int, qmax: int, mode: str,
            axis: int | None) -> np.ndarray:
    node = helper.make_node(rt.QDQ_OP, ["x", "s", "z"], ["y"], domain=rt.DOMAIN, qmin=qmin, qmax=qmax,
                            round_mode=mode, axis=rt.NO_AXIS if axis is None else axis)
    inits = [nh.from_array(np.asarray(scale, np.float32), "s"), nh.from_array(np.asarray(zp, np.float32), "z")]
    return _run_op(node, x, inits)


EDGES = np.array([-1e30, -3.5, -2.5, -1.5, -0.5, 0.0, 0.5, 1.5, 2.5, 3.5, 1e30, np.inf, -np.inf, np.nan],
                 np.float32)


@pytest.mark.parametrize("mode", ROUND_MODES)
@pytest.mark.parametrize(("qmin", "qmax"), [(-128, 127), (0, 63), (-(2**31), 2**31 - 1), (0, 3)])
def test_quantize_dequantize_op_matches_reference(mode, qmin, qmax):
    rng = np.random.default_rng(qmax % 97)
    x = np.concatenate([EDGES, rng.standard_normal(50).astype(np.float32) * 4]).reshape(1, -1)
    zp = 0.0 if qmin < 0 else float(qmax // 2)
    got = _qdq_op(x, np.float32(0.5), np.float32(zp), qmin, qmax, mode, None)
    want = fake_quantize(x, 0.5, zp, qmin, qmax, mode)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[0, EDGES.size - 1])  # NaN stays NaN
    assert got[0, EDGES.size - 3] == (qmax - zp) * 0.5  # +inf saturates


def test_rounding_modes_at_ties():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], np.float32)
    expect = {
        "half_even": [-2, -2, 0, 0, 2, 2], "half_up": [-3, -2, -1, 1, 2, 3],
        "floor": [-3, -2, -1, 0, 1, 2], "ceil": [-2, -1, 0, 1, 2, 3],
    }
    for mode, values in expect.items():
        np.testing.assert_array_equal(fake_quantize(x, 1.0, 0.0, -128, 127, mode), np.array(values, np.float32))


def test_per_channel_scales_along_an_axis():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    scale, zp = np.array([0.1, 0.2, 0.05], np.float32), np.array([0.0, 1.0, -2.0], np.float32)
    got = _qdq_op(x, scale, zp, -8, 7, "half_even", 1)
    np.testing.assert_array_equal(got, fake_quantize(x, scale, zp, -8, 7, "half_even", 1))


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
def test_block_op_matches_reference(fmt):
    rng = np.random.default_rng(len(fmt))
    x = (rng.standard_normal((3, 70)) * np.exp(rng.uniform(-6, 6, (3, 1)))).astype(np.float32)
    x[1, :32] = 0.0  # a zero block
    x[2, 40] = np.nan  # poisons its block only
    node = helper.make_node(rt.BLOCK_OP, ["x"], ["y"], domain=rt.DOMAIN, format=fmt, block_size=0, axis=-1)
    got = _run_op(node, x, [])
    want = block_fake_quantize(x, fmt, -1)
    np.testing.assert_array_equal(got, want)
    block = BLOCK_FORMATS[fmt].block_size
    assert np.all(got[1, :32] == 0)
    poisoned = slice(40 // block * block, min(70, (40 // block + 1) * block))
    assert np.isnan(got[2, poisoned]).all() and not np.isnan(got[2, :poisoned.start]).any()
    finite = np.isfinite(x).all(axis=1)
    assert sqnr_db(x[finite], got[finite]) > {"mxfp4_e2m1": 12, "mxfp6_e3m2": 20, "mxfp6_e2m3": 20}.get(fmt, 25)


def test_block_elements_lie_on_the_format_grid():
    x = np.random.default_rng(3).standard_normal((1, 32)).astype(np.float32)
    y = block_fake_quantize(x, "mxfp4_e2m1")
    shared = 2.0 ** (np.floor(np.log2(np.abs(x).max())) - 2)
    assert set(np.unique(np.abs(y / shared))) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    z = block_fake_quantize(x, "mxint8")
    steps = z / (2.0 ** np.floor(np.log2(np.abs(x).max())) * 2.0**-6)
    np.testing.assert_array_equal(steps, np.rint(steps))


def _quantize(config: dict) -> onnx.ModelProto:
    model = conv_relu_chain()
    data = stack_feeds(random_feeds(model, 16, seed=0))
    return onnxq.quantize(model, None, onnxq.as_config(config), data, progress=False).model


def test_int8_only_qdq_ext_is_the_qdq_model():
    assert _quantize({"quant_format": "qdq-ext"}).SerializeToString() == _quantize({}).SerializeToString()


def test_six_bit_activations_run_end_to_end(tmp_path):
    spec = {"bits": 6, "round_method": "half_up"}
    model = _quantize({"quant_format": "qdq-ext", "global_quant_config": {"input_tensors": spec,
                                                                          "output_tensors": spec}})
    assert any(n.op_type == rt.QDQ_OP for n in model.graph.node)
    path = tmp_path / "ext.onnx"
    onnx.save(model, str(path))
    with pytest.raises(Exception, match="OnnxqQuantizeDequantize"):
        ort.InferenceSession(str(path))  # stock onnxruntime: the ops are not there
    feeds = random_feeds(conv_relu_chain(), 4, seed=9)
    ref = ort.InferenceSession(conv_relu_chain().SerializeToString()).run(None, feeds[0])[0]
    got = rt.InferenceSession(path).run(None, feeds[0])[0]
    assert 15 < sqnr_db(ref, got) < sqnr_db(ref, ort.InferenceSession(_quantize({}).SerializeToString())
                                             .run(None, feeds[0])[0])  # 6 bits: worse than 8, still close
    np.savez(tmp_path / "data.npz", **stack_feeds(feeds))
    proc = subprocess.run([sys.executable, "-m", "onnxq", "run", str(path), "--data", str(tmp_path / "data.npz"),
                           "--out", str(tmp_path / "out.npz")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with np.load(tmp_path / "out.npz") as out:
        assert out[next(iter(out.files))].shape[0] == 4


def test_wider_activations_are_never_worse_than_16_bit(tmp_path):
    """32-bit activations on the bundled CNN, bias correction on (the target's default):
    an int32 bias cannot hold the input scale x weight scale of a 32-bit grid, so the
    biases stay float; raising half the classifier's weight scales to fit it took the
    output from 44.7 dB (16-bit) to 23.9."""
    data = str(ROOT / "models" / "digits_calib.npz")
    feeds = {k: v[:16] for k, v in np.load(data).items() if k != "labels"}
    ref = ort.InferenceSession(str(ROOT / "models" / "digits_cnn.onnx")).run(None, feeds)[0]
    scores = {}
    for bits in (16, 32):
        spec = {"dtype": f"int{bits}", "symmetric": False}
        config = onnxq.compose_config("U8S8", None, {"quant_format": "qdq-ext", "global_quant_config": {
            "input_tensors": spec, "output_tensors": spec}})
        out = tmp_path / f"a{bits}.onnx"
        result = onnxq.quantize(str(ROOT / "models" / "digits_cnn.onnx"), str(out), config, data, progress=False)
        onnx.checker.check_model(str(out))
        scores[bits] = sqnr_db(ref, rt.InferenceSession(out).run(None, feeds)[0])
    assert result.summary.float_biases, "32-bit activations: the biases stay float"
    assert scores[32] >= scores[16] - 0.5 and scores[16] > 35, scores


def test_extended_settings_need_the_extended_format():
    with pytest.raises(ConfigError, match="qdq-ext"):
        onnxq.as_config({"global_quant_config": {"input_tensors": {"bits": 6}}})
    with pytest.raises(ConfigError, match="qdq-ext"):
        onnxq.as_config({"global_quant_config": {"output_tensors": {"dtype": "int32"}}})
    config = onnxq.as_config({"quant_format": "qdq-ext", "global_quant_config": {
        "input_tensors": {"dtype": "int32"}, "output_tensors": {"dtype": "int32"}}})
    assert config.global_quant_config.input_tensors.dtype.value == "int32"


def test_block_formats_end_to_end_match_the_reference():
    """A Gemm with MXFP8 activations and MXFP4 weights computes exactly the float Gemm of the
    block-quantized input and weight; no calibration data is needed."""
    from helpers import gemm

    model = gemm(trans_b=1)
    spec = {"quant_format": "qdq-ext", "global_quant_config": {
        "input_tensors": {"dtype": "mxfp8_e4m3"}, "output_tensors": None, "weight": {"dtype": "mxfp4_e2m1"},
        "bias": None}}
    result = onnxq.quantize(model, None, onnxq.as_config(spec), None, progress=False)
    assert result.summary.quantized_by_op == {"Gemm": 2}
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    got = rt.InferenceSession(result.model.SerializeToString()).run(None, {"x": x})[0]
    inits = {i.name: nh.to_array(i) for i in model.graph.initializer}
    first, second = model.graph.node[0], model.graph.node[2]
    h = block_fake_quantize(x, "mxfp8_e4m3", -1) @ block_fake_quantize(inits[first.input[1]], "mxfp4_e2m1", 1).T
    h = np.maximum(h + inits[first.input[2]], 0)
    want = block_fake_quantize(h, "mxfp8_e4m3", -1) @ block_fake_quantize(inits[second.input[1]], "mxfp4_e2m1", 1).T
    want = want + inits[second.input[2]]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_block_formats_need_the_extended_format():
    with pytest.raises(ConfigError, match="qdq-ext"):
        onnxq.as_config({"global_quant_config": {"weight": {"dtype": "mxfp4_e2m1"}}})
    with pytest.raises(ConfigError, match="inputs and weights"):
        onnxq.as_config({"quant_format": "qdq-ext", "global_quant_config": {"output_tensors": {"dtype": "mxint8"}}})


def test_analyze_reads_a_qdq_ext_model_per_layer_and_tensor(tmp_path):
    """formats-and-targets.md: analyze registers the ops itself; it also reads their
    structure (before: 6-bit activations gave '0 of 0' layers and tensors, and block formats
    'no QuantizeLinear/DequantizeLinear', exit 2). A 6-bit tensor's figures match a direct
    comparison of the float tensor with the op's output."""
    from onnxq.analyze import analyze_models
    spec = {"bits": 6, "round_method": "half_up"}
    float_path, six, mx = tmp_path / "f.onnx", tmp_path / "six.onnx", tmp_path / "mx.onnx"
    onnx.save(conv_relu_chain(), str(float_path))
    onnx.save(_quantize({"quant_format": "qdq-ext", "global_quant_config": {"input_tensors": spec,
                                                                           "output_tensors": spec}}), str(six))
    onnx.save(_quantize({"quant_format": "qdq-ext", "layer_type_quant_config": {
        "Conv": {"input_tensors": {"dtype": "mxint8"}, "weight": {"dtype": "mxint8"}}}}), str(mx))
    data = stack_feeds(random_feeds(conv_relu_chain(), 8, seed=4))
    analysis = analyze_models(float_path, six, data, progress=False)
    convs = [r for r in analysis.layers if r.op_type == "Conv"]
    assert convs and all(r.own_sqnr_db > 15 for r in convs)
    assert analysis.tensors and all(t.sqnr_db < 60 for t in analysis.tensors)  # 6-bit grids: errors measured
    worst = analysis.tensors[0]
    model = onnx.load(six)
    op = next(n for n in model.graph.node if n.op_type == rt.QDQ_OP and n.input[0] == worst.name)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(onnx.ValueInfoProto(name=op.output[0]))
    test = rt.InferenceSession(exposed.SerializeToString()).run([op.output[0]], {k: v for k, v in data.items()})[0]
    plain = onnx.ModelProto()
    plain.CopyFrom(conv_relu_chain())
    plain.graph.output.append(onnx.ValueInfoProto(name=worst.name))
    ref = ort.InferenceSession(plain.SerializeToString()).run([worst.name], data)[0]
    expected = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - test).astype(np.float64) ** 2))
    assert worst.sqnr_db == pytest.approx(expected, abs=0.05)
    blocks = analyze_models(float_path, mx, data, progress=False)
    assert [r.op_type for r in blocks.layers if r.op_type == "Conv"] and blocks.tensors == []
