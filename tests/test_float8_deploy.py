"""Float8 QDQ models load and run in a default onnxruntime session (ORT_ENABLE_ALL) and
compute what their Q/DQ arithmetic says.

Reference: the same quantized model run with ORT_DISABLE_ALL, i.e. every QuantizeLinear /
DequantizeLinear executed as written (test_dtypes checks that onnxruntime's float8 Q/DQ
equals qmath's numpy Q/DQ bit for bit). The default session must
- track the reference to at least REFERENCE_SQNR_DB (in practice it is bit-identical),
- be no further from the float model than the reference, minus MARGIN_DB.
Before emit/float8.py the default session either refused the model (ClipQuantFusion) or
ran it silently wrong: Relus dropped (ReluQuantFusion), float8_e5m2 biases overflowed to
int32 garbage (WeightBiasQuantization, already at ORT_ENABLE_BASIC).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

import onnxq
from onnxq.emit import qdq_layout
from onnxq.emit.float8 import DATA_MOVEMENT, Float8Report, make_float8_deployable
from onnxq.numerics import qmath
from tests import helpers as H

FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
REFERENCE_SQNR_DB = 40.0  # default session vs ORT_DISABLE_ALL of the same model
# With one int8 node the default session runs it in a fused QLinearConv, whose
# requantization may round an output one step differently than DequantizeLinear -> Conv ->
# QuantizeLinear (it differs between VNNI and non-VNNI kernels); one step on some of a
# uint8 tensor's elements is about 40 dB below its range (39.6 dB measured on AVX512-VNNI),
# so this bound allows such steps on every element of it.
MIXED_REFERENCE_SQNR_DB = 30.0
MARGIN_DB = 0.5  # default session may be this much further from float than the reference
# Loose absolute floors vs float on these small random-weight models (measured: e4m3
# 21-25 dB, e5m2 15-20 dB), so a reference that is itself broken fails too.
FLOAT_FLOOR_DB = {"float8_e4m3fn": 15.0, "float8_e5m2": 10.0}
F8_ONNX = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2}


def float8_config(dtype: str) -> dict:
    spec = {"dtype": dtype, "symmetric": True}
    return {"global_quant_config": {
        "input_tensors": spec, "output_tensors": spec, "weight": {**spec, "qscheme": "per_channel"},
    }}


def clip_model(seed: int = 13) -> onnx.ModelProto:
    """Conv+Relu6 (Clip 0..6), Conv+Clip(-1, 1.3), MaxPool, Conv+Clip(0, 6), Reshape, Gemm."""
    b = H.GraphBuilder(seed)
    x = b.input("x", ["N", 3, 12, 12])

    def clip(v: str, lo: float, hi: float) -> str:
        return b.node("Clip", [v, b.const("lo", np.array(lo, np.float32)), b.const("hi", np.array(hi, np.float32))])

    x = clip(b.conv(x, 3, 8), 0.0, 6.0)
    x = clip(b.conv(x, 8, 8), -1.0, 1.3)
    x = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = clip(b.conv(x, 8, 6), 0.0, 6.0)
    x = b.node("Reshape", [x, b.const("shape", np.array([0, -1], np.int64))])
    return b.build([b.gemm(x, 6 * 36, 10)], name="clip_model")


def relu_data_movement(seed: int = 14) -> onnx.ModelProto:
    """Relus in front of MaxPool / Transpose / Reshape / Flatten, where onnxruntime copies
    QuantizeLinear backwards (QDQPropagationTransformer); MatMul and Gemm with a bias."""
    b = H.GraphBuilder(seed)
    x = b.input("x", ["N", 4, 8, 8])
    x = b.node("MaxPool", [b.relu(b.conv(x, 4, 8))], kernel_shape=[2, 2], strides=[2, 2])
    x = b.node("Transpose", [b.relu(b.conv(x, 8, 8, k=1))], perm=[0, 1, 3, 2])
    x = b.node("Reshape", [b.relu(x), b.const("shape", np.array([0, 8, 16], np.int64))])
    x = b.relu(b.matmul(x, 16, 12))
    x = b.node("Flatten", [x], axis=1)
    return b.build([b.gemm(b.relu(b.gemm(x, 96, 16)), 16, 5)], name="relu_data_movement")


def big_bias(seed: int = 15) -> onnx.ModelProto:
    """Conv+Relu chain whose biases are large next to x_scale * w_scale: onnxruntime's
    WeightBiasQuantization overflows int32 on them with float8_e5m2 scales."""
    model = H.conv_relu_chain(seed)
    for init in model.graph.initializer:
        if init.name.startswith("conv_b"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 100.0, init.name))
    return model


MODELS = {
    **{name: H.MODEL_BUILDERS[name] for name in (
        "conv_relu_chain", "residual", "concat", "gemm_transB0", "gemm_transB1", "matmul",
        "depthwise", "conv_transpose", "conv_bn_relu", "pooling", "softmax_head")},
    "clip_model": clip_model,
    "relu_data_movement": relu_data_movement,
    "big_bias": big_bias,
}


def _session(model: onnx.ModelProto, level: ort.GraphOptimizationLevel | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _check_deploys(model: onnx.ModelProto, q: onnx.ModelProto, dtype: str,
                   reference_db: float = REFERENCE_SQNR_DB) -> tuple[float, float, float]:
    onnx.checker.check_model(q, full_check=True)
    feeds = H.random_feeds(model, 4, seed=2)
    ref = H.run(model, feeds)
    default = H.run(_session(q), feeds)  # default options: ORT_ENABLE_ALL
    exact = H.run(_session(q, ort.GraphOptimizationLevel.ORT_DISABLE_ALL), feeds)
    to_ref, to_float, ref_to_float = H.sqnr_db(exact, default), H.sqnr_db(ref, default), H.sqnr_db(ref, exact)
    assert to_ref >= reference_db, f"default session vs ORT_DISABLE_ALL: {to_ref:.1f} dB"
    assert to_float >= ref_to_float - MARGIN_DB, f"{to_float:.1f} dB vs float, reference {ref_to_float:.1f}"
    assert ref_to_float >= FLOAT_FLOOR_DB[dtype], f"reference only {ref_to_float:.1f} dB from float"
    return to_ref, to_float, ref_to_float


def _assert_all_weights_float8(q: onnx.ModelProto) -> None:
    """Every weighted op reads its weight through a float8 DequantizeLinear: nothing was
    left float (onnxq keeps nodes float when onnxruntime cannot load them)."""
    producers = H.producers(q)
    types = {i.name: i.data_type for i in q.graph.initializer}
    weighted = [n for n in q.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")]
    assert weighted
    for node in weighted:
        dq = producers.get(node.input[1])
        assert dq is not None and dq.op_type == "DequantizeLinear" and types.get(dq.input[0]) in F8_ONNX, node.name


def _assert_no_fusable_patterns(q: onnx.ModelProto) -> None:
    """No Relu/Clip reaches a float8 QuantizeLinear alone (directly or through data
    movement), and no Conv/Gemm reading a float8 DequantizeLinear has a float bias."""
    producers, consumers = H.producers(q), H.consumers(q)
    zero_points = {i.name: i.data_type for i in q.graph.initializer}
    inits = H.initializers(q)
    outputs = {o.name for o in q.graph.output}
    for node in q.graph.node:
        if node.op_type == "QuantizeLinear" and zero_points.get(node.input[2]) in F8_ONNX:
            value = node.input[0]
            while value in producers and len(consumers.get(value, [])) == 1 and value not in outputs:
                source = producers[value]
                assert source.op_type not in ("Relu", "Clip"), f"{source.name} feeds float8 {node.name}"
                if source.op_type not in DATA_MOVEMENT:
                    break
                value = source.input[0]
        if node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(node.input) > 2 and node.input[2]:
            dq = producers.get(node.input[0])
            if dq is not None and dq.op_type == "DequantizeLinear" and zero_points.get(dq.input[2]) in F8_ONNX:
                assert node.input[2] not in inits or inits[node.input[2]].dtype != np.float32, node.name


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_float8_model_runs_at_default_level(name, dtype):
    model = MODELS[name]()
    result = onnxq.quantize(model, None, float8_config(dtype), H.random_feeds(model, 16, seed=1))
    q = result.model
    stored = {i.data_type for i in q.graph.initializer}
    assert {TensorProto.FLOAT8E4M3FN if dtype == "float8_e4m3fn" else TensorProto.FLOAT8E5M2} <= stored
    assert not any("ORT_ENABLE_BASIC" in note for note in result.summary.note_texts)
    _assert_all_weights_float8(q)
    _assert_no_fusable_patterns(q)
    _check_deploys(model, q, dtype)


def test_fp8_preset_and_note():
    model = clip_model()
    result = onnxq.quantize(model, None, "FP8_E4M3", H.random_feeds(model, 16, seed=1))
    notes = [n for n in result.summary.note_texts if n.startswith("float8 Q/DQ")]
    assert len(notes) == 1 and "default optimisation level" in notes[0], result.summary.note_texts
    _check_deploys(model, result.model, "float8_e4m3fn")


def test_mixed_float8_and_int8():
    """A float8 model with one uint8/int8 node: requantized tensors between them."""
    model = H.residual()
    config = float8_config("float8_e4m3fn")
    config["layer_quant_config"] = {"conv_7": {
        "input_tensors": {"dtype": "uint8", "symmetric": False},
        "output_tensors": {"dtype": "uint8", "symmetric": False},
        "weight": {"dtype": "int8", "symmetric": True, "qscheme": "per_channel"},
    }}
    q = onnxq.quantize(model, None, config, H.random_feeds(model, 16, seed=1)).model
    stored = {i.data_type for i in q.graph.initializer}
    assert TensorProto.FLOAT8E4M3FN in stored and TensorProto.UINT8 in stored
    _assert_no_fusable_patterns(q)
    _check_deploys(model, q, "float8_e4m3fn", MIXED_REFERENCE_SQNR_DB)


@pytest.mark.parametrize("dtype", FLOAT8)
def test_rewrite_keeps_the_arithmetic(dtype, monkeypatch):
    """The rewritten graph computes what the plain QDQ emission computes (both run as
    written): moving Relu/Clip after the DQ and the bias into an Add change nothing."""
    captured = []

    def spy(model: ir.Model) -> Float8Report:
        captured.append(ir.serde.serialize_model(model))  # the plain emission
        return make_float8_deployable(model)

    monkeypatch.setattr(qdq_layout, "make_float8_deployable", spy)
    monkeypatch.setattr(qdq_layout, "center_float8", lambda model, statistics: 0)  # changes the arithmetic
    model = clip_model()
    rewritten = onnxq.quantize(model, None, float8_config(dtype), H.random_feeds(model, 16, seed=1)).model
    (plain,) = captured
    assert H.op_count(rewritten, "Add") == H.op_count(plain, "Add") + 4  # 3 Conv + 1 Gemm bias
    feeds = H.random_feeds(model, 4, seed=3)
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = H.run(_session(plain, off), feeds), H.run(_session(rewritten, off), feeds)
    assert H.sqnr_db(a, b) >= 60.0  # bit-identical here; 60 dB allows a float ulp in a bias add


@pytest.mark.parametrize("dtype", FLOAT8)
def test_moved_clip_bounds_are_exact(dtype):
    """DQ(Q(clip(x, lo, hi))) == clip(DQ(Q(x)), DQ(Q(lo)), DQ(Q(hi))) for bounds that are
    not on the float8 grid: the identity emit/float8.py relies on."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * 4).astype(np.float32)
    scale, zp = qmath.compute_qparams(-3.3, 6.1, dtype, True)

    def qdq(v):
        return qmath.dequantize(qmath.quantize(v, scale, zp, dtype), scale, zp)

    for lo, hi in [(0.0, 6.0), (-1.0, 1.3), (0.37, 5.11), (-3.3, 0.1)]:
        before = qdq(np.clip(x, np.float32(lo), np.float32(hi)))
        after = np.clip(qdq(x), qdq(np.float32(lo)), qdq(np.float32(hi)))
        np.testing.assert_array_equal(before, after)


def test_int8_emission_untouched(monkeypatch):
    """Integer presets never reach the float8 rewrite."""
    def refuse(model):
        raise AssertionError("float8 rewrite called for an integer model")

    monkeypatch.setattr(qdq_layout, "make_float8_deployable", refuse)
    model = H.residual()
    q = onnxq.quantize(model, None, "U8S8", H.random_feeds(model, 8, seed=1)).model
    assert not any(i.data_type in F8_ONNX for i in q.graph.initializer)



@pytest.mark.parametrize("dtype", FLOAT8)
def test_activations_on_an_offset_are_centred(dtype, monkeypatch):
    """Channels that sit on a large offset with a small spread (an image channel at 5 +- 0.05):
    float8's relative precision spends its steps on the offset unless each channel is
    centred on its calibration mean (Sub before Q, Add after DQ); the model still passes
    the checker and loads in a default session, and its output is much closer to float."""
    model = H.conv_relu_chain()

    def data(n: int, seed: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(seed)
        offset = np.array([5.0, -3.0, 8.0], np.float32).reshape(1, 3, 1, 1)
        return {"x": (offset + 0.05 * r.standard_normal((n, 3, 16, 16))).astype(np.float32)}

    config = float8_config(dtype)  # with bias correction: the weights' error on an offset is a mean error
    config["algo_config"] = [{"name": "bias_correction"}]
    centred = onnxq.quantize(model, None, config, data(32, 1))
    assert any(n.startswith("float8: ") and "centred per channel" in n for n in centred.summary.note_texts)
    onnx.checker.check_model(centred.model)
    monkeypatch.setattr(qdq_layout, "center_float8", lambda model, statistics: 0)
    plain = onnxq.quantize(model, None, config, data(32, 1)).model
    test = data(8, 2)
    reference = H.run(_session(model), test)
    mean = reference.mean(axis=(0, 2, 3), keepdims=True)  # what the data carries is the spread

    def spread_sqnr(q: onnx.ModelProto) -> float:
        return H.sqnr_db(reference - mean, H.run(_session(q), test) - mean)

    assert spread_sqnr(centred.model) > spread_sqnr(plain) + 6.0


def test_a_channel_offset_never_pushes_values_off_the_grid():
    """Shifted by its offset, every calibrated value of a channel stays within what the
    QuantizeLinear represents (+-limit): the mean moves toward 0 where it would not."""
    from onnxq.calibrate.statistics import Statistic
    from onnxq.emit.float8_center import _offset

    stat = Statistic("t", "mean", 1)
    mean = np.array([3.0, 3.0, -2.0])
    stats = {Statistic("t", "min", 1): np.array([-1.0, -4.0, -5.0]),
             Statistic("t", "max", 1): np.array([5.0, 5.0, 4.0])}
    offset = _offset(stat, mean, stats, limit=5.0)
    np.testing.assert_allclose(offset, [3.0, 1.0, -1.0])
    assert np.all(stats[Statistic("t", "max", 1)] - offset <= 5.0)
    assert np.all(stats[Statistic("t", "min", 1)] - offset >= -5.0)
    assert _offset(stat, mean, {}, limit=5.0) is None  # no extremes measured: no centring


def test_float8_named_by_its_bits_raises_the_opset_as_by_name():
    """`exponent_bits: 4, mantissa_bits: 3` is float8_e4m3fn: the same opset upgrade (19)
    and the same model (before: opset 17 kept, every layer fell back to float)."""
    from pathlib import Path

    models = Path(__file__).resolve().parents[1] / "models"
    data = {k: v[:32] for k, v in np.load(models / "digits_calib.npz").items()}
    by_bits = onnxq.quantize(str(models / "digits_cnn.onnx"), None, {"global_quant_config": {
        "weight": {"exponent_bits": 4, "mantissa_bits": 3}}}, data, progress=False)
    by_name = onnxq.quantize(str(models / "digits_cnn.onnx"), None, {"global_quant_config": {
        "weight": {"dtype": "float8_e4m3fn"}}}, data, progress=False)
    assert by_bits.summary.opset == (17, 19) and by_bits.summary.quantized_by_op.get("Conv") == 3
    assert by_bits.model.SerializeToString() == by_name.model.SerializeToString()
