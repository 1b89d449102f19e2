"""Symmetric int4/uint4 weights use the whole range [-8, 7], and 4-bit block weights can get
a per-block clipping-scale search, weighted by activation importance when given
(onnxq.numerics.weights).

References here are written independently of the emitter: `ort_rtn` is onnxruntime's
blockwise symmetric quantizer (matmul_nbits_quantizer.quant_slice_symmetric: scale =
signed absmax / -8), `old_rtn` the previous absmax / 7 arithmetic.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import DType, QuantizationSpec
from onnxq.emit.matmul_nbits import emit_matmul_nbits
from onnxq.graph.load import load_model
from onnxq.numerics import weights
from onnxq.numerics.blocks import (
    dequantize_blockwise,
    quantize_blockwise,
    rounded_blockwise,
    unpack_bits,
)
from onnxq.numerics.qmath import compute_qparams, dequantize, quantize
from onnxq.numerics.weights import CLIP_GRID, quantize_blocks, quantize_weight

# Rounding noise power scales with the step squared: 8 steps instead of 7 for the same
# extreme gain 20*log10(8/7) = 1.16 dB, less a little clipping of the other side (which
# keeps 7 steps of 8).
FULL_RANGE_GAIN_DB = 0.8


def spec(dtype: str = "int4", symmetric: bool = True, group_size: int | None = 128,
         scale_type: str = "float32", qscheme: str = "per_group") -> ResolvedSpec:
    resolved = merge_specs([QuantizationSpec(dtype=dtype, symmetric=symmetric, qscheme=qscheme,
                                             group_size=group_size, scale_type=scale_type)], "weight")
    assert resolved is not None
    return resolved


def sample(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    draw = {"gaussian": rng.standard_normal, "laplace": rng.laplace,
            "student_t3": lambda size: rng.standard_t(3, size)}[kind]
    return (0.02 * draw(size=shape)).astype(np.float32)


def awkward_blocks(block: int) -> np.ndarray:
    """Blocks that stress the search: zeros, constants, one outlier, one-sided, tiny."""
    rng = np.random.default_rng(7)
    rows = [np.zeros(block), np.full(block, 0.3), np.full(block, -0.3), rng.standard_normal(block) * 1e-30,
            np.abs(rng.standard_normal(block)), -np.abs(rng.standard_normal(block))]
    spike = rng.standard_normal(block) * 0.01
    spike[3] = 5.0
    rows.append(spike)
    return np.stack(rows).astype(np.float32)


def ort_rtn(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's symmetric blockwise RTN on rows: codes in [-8, 7] and signed scales."""
    hi, lo = blocks.max(axis=1, keepdims=True), blocks.min(axis=1, keepdims=True)
    scale = np.where(np.abs(hi) > np.abs(lo), hi, lo) / np.float32(-8.0)
    codes = np.where(scale == 0, 0, blocks / np.where(scale == 0, 1, scale)).round().clip(-8, 7)
    return codes, scale[:, 0]


def old_rtn(blocks: np.ndarray) -> np.ndarray:
    """Dequantized rows with the previous arithmetic: scale = absmax / 7 (code -8 unused)."""
    scale, zp = compute_qparams(blocks.min(axis=1), blocks.max(axis=1), "int4", True)
    q = quantize(blocks, scale[:, None], zp[:, None], "int4")
    return dequantize(q, scale[:, None], zp[:, None]).astype(np.float64)


def dq(q: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """(q - zp) * scale per row, in float32 as the kernels compute it, returned as float64."""
    codes = q.astype(np.int32) - np.asarray(zp).astype(np.int32)[:, None]
    return (codes.astype(np.float32) * np.asarray(scale).astype(np.float32)[:, None]).astype(np.float64)


def row_error(w: np.ndarray, d: np.ndarray, h: np.ndarray | None = None) -> np.ndarray:
    r2 = (w.astype(np.float64) - d) ** 2
    return np.sum(r2 if h is None else r2 * h, axis=1)


# -- the whole range ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype, qmin", [("int4", -8), ("uint4", 0)])
def test_extreme_of_each_block_lands_on_the_lowest_code(dtype, qmin):
    w = sample("gaussian", (512, 64), seed=1)
    q, scale, zp = quantize_blocks(w, spec(dtype, group_size=64), clip_search=False)
    q = q.astype(np.int32)
    assert np.all(np.asarray(zp).astype(np.int32) == qmin + 8)
    extreme = np.abs(w).argmax(axis=1)
    rows = np.arange(len(w))
    assert np.all(q[rows, extreme] == qmin)  # every block uses its lowest code
    np.testing.assert_allclose(dq(q, scale, zp)[rows, extreme], w[rows, extreme], rtol=1e-6)
    positive_extreme = w[rows, extreme] > 0
    assert np.all((scale < 0) == positive_extreme) and positive_extreme.any() and (~positive_extreme).any()


def test_plain_rounding_is_onnxruntime_rtn():
    w = sample("laplace", (1024, 32), seed=2)
    q, scale, zp = quantize_blocks(w, spec("int4", group_size=32), clip_search=False)
    ref_codes, ref_scale = ort_rtn(w)
    np.testing.assert_array_equal(scale, ref_scale)
    np.testing.assert_array_equal(q.astype(np.int32), ref_codes.astype(np.int32))


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int8", "uint8"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_weight_layout_rounding_is_qdq_arithmetic(dtype, symmetric):
    """MatMulNBits' plain rounding blocks W [K, N] in its own layout (no transposed float
    copy): per block of each column, the codes and scales are QuantizeLinear's on the
    block's min/max parameters, K not a multiple of the block included."""
    k, n, block = 100, 70, 32
    w = sample("laplace", (k, n), seed=5)
    w[:, 3] = 0.0  # an all-zero column
    s = spec(dtype, symmetric, group_size=block)
    bq = quantize_blockwise(w, s)
    rows = np.zeros((n, 4 * block), np.float32)
    rows[:, :k] = w.T
    rows = rows.reshape(-1, block)
    scale, zp = weights.weight_qparams(rows.min(axis=1), rows.max(axis=1), s, weights.MIN_SCALE, signed=True)
    codes = quantize(rows, scale[:, None], zp[:, None], dtype)
    np.testing.assert_array_equal(bq.scales.reshape(-1), scale.astype(np.float32))
    expected = dequantize(codes, scale[:, None], zp[:, None]).reshape(n, -1)[:, :k].T
    np.testing.assert_array_equal(dequantize_blockwise(bq), expected)
    np.testing.assert_array_equal(rounded_blockwise(w, s), expected)  # AWQ's candidates: no packing, same values
    assert np.unique(codes).size > 8  # the grid is used, not a constant


def test_search_still_uses_code_minus_8():
    w = sample("student_t3", (256, 128), seed=3)
    q, _, _ = quantize_blocks(w, spec("int4"), clip_search=True)
    counts = np.bincount(q.astype(np.int32).ravel() + 8, minlength=16)
    assert counts[0] > 0 and counts.min() > 0, counts  # all 16 codes in use


def test_per_channel_int4_keeps_positive_scales_and_reaches_minus_8():
    w = sample("gaussian", (64, 96), seed=4)
    qt = quantize_weight(w, spec("int4", group_size=None, qscheme="per_channel"), axis=0)
    lo, hi = w.min(axis=1), w.max(axis=1)
    np.testing.assert_allclose(qt.scale, np.maximum(-lo / 8, hi / 7).astype(np.float32), rtol=1e-7)
    assert np.all(qt.scale > 0)
    codes = qt.data.astype(np.int32)
    negative_side = -lo > hi * 8 / 7
    assert negative_side.any() and np.all(codes[negative_side].min(axis=1) == -8)
    assert np.all(codes[~negative_side].max(axis=1) == 7)


@pytest.mark.parametrize("kind", ["gaussian", "laplace", "student_t3"])
@pytest.mark.parametrize("block", [32, 128])
def test_full_range_beats_absmax_over_7(kind, block):
    w = sample(kind, (4096, block), seed=block)
    q, scale, zp = quantize_blocks(w, spec("int4", group_size=block), clip_search=False)
    old, full = sqnr_db(w, old_rtn(w)), sqnr_db(w, dq(q, scale, zp))
    assert full - old >= FULL_RANGE_GAIN_DB, (old, full)  # measured 1.06-1.14 dB
    q, scale, zp = quantize_blocks(w, spec("int4", group_size=block), clip_search=True)
    assert sqnr_db(w, dq(q, scale, zp)) > full  # the search adds more (measured 0.3-0.6 dB)


# -- the clipping search --------------------------------------------------------------------

SEARCH_CASES = [  # dtype, symmetric, scale_type, scale dtype
    ("int4", True, "float32", np.float32),
    ("uint4", True, "float32", np.float32),
    ("uint4", False, "float32", np.float32),
    ("int4", False, "float32", np.float32),
    ("int4", True, "float32", np.float16),
    ("int4", True, "power_of_two", np.float32),
    ("uint4", False, "float16", np.float32),
]


@pytest.mark.parametrize("dtype, symmetric, scale_type, scale_dtype", SEARCH_CASES)
def test_search_never_increases_block_error(dtype, symmetric, scale_type, scale_dtype):
    block = 64
    w = np.concatenate([sample(kind, (300, block), seed=i) for i, kind in
                        enumerate(["gaussian", "laplace", "student_t3"])] + [awkward_blocks(block)])
    s = spec(dtype, symmetric, block, scale_type)
    plain = quantize_blocks(w, s, scale_dtype, clip_search=False)
    searched = quantize_blocks(w, s, scale_dtype, clip_search=True)
    assert searched[1].dtype == scale_dtype
    e_plain, e_search = row_error(w, dq(*plain)), row_error(w, dq(*searched))
    assert np.all(e_search <= e_plain * (1 + 1e-12)), np.max(e_search / np.maximum(e_plain, 1e-300))
    # most blocks strictly improve; power-of-two scales leave the search two candidates
    assert np.mean(e_search < e_plain) > (0.1 if scale_type == "power_of_two" else 0.5)
    assert np.all(np.isfinite(searched[1])) and np.all(searched[1] != 0)
    zeros = np.all(w == 0, axis=1)
    assert np.all(dq(*searched)[zeros] == 0)


def brute_force(w: np.ndarray, scale: np.ndarray, h: np.ndarray | None = None) -> np.ndarray:
    """Best (h-weighted) error per block, one block at a time: every grid factor, with and
    without the weighted least-squares scale of its codes (int4 symmetric, float32 scales)."""
    h = np.ones_like(w) if h is None else h
    best = []
    for row, s0, hr in zip(w, scale, h):
        x = row / np.float32(s0)
        errors = []
        for a in CLIP_GRID:
            codes = np.clip(np.rint(x * (np.float32(1) / np.float32(a))), -8, 7)
            fit = float((hr * x) @ codes) / float((hr * codes) @ codes) if codes.any() else a
            for t in (a, fit):
                s = np.float32(s0 * t)
                errors.append(np.sum(hr * (row.astype(np.float64) - codes * s) ** 2))
        best.append(min(errors))
    return np.array(best)


def test_search_finds_the_brute_force_optimum():
    w = np.concatenate([sample("laplace", (40, 32), seed=5), awkward_blocks(32)])
    _, scale, _ = quantize_blocks(w, spec("int4", group_size=32), clip_search=False)
    q, s, zp = quantize_blocks(w, spec("int4", group_size=32), clip_search=True)
    np.testing.assert_allclose(row_error(w, dq(q, s, zp)), brute_force(w, scale), rtol=1e-6, atol=1e-30)
    h = np.random.default_rng(5).gamma(0.5, size=(3, 32)).astype(np.float32)  # cycles over rows
    q, s, zp = quantize_blocks(w, spec("int4", group_size=32), importance=h)
    rows_h = h[np.arange(len(w)) % 3]
    np.testing.assert_allclose(row_error(w, dq(q, s, zp), rows_h), brute_force(w, scale, rows_h),
                               rtol=1e-6, atol=1e-30)


def test_search_is_deterministic_and_independent_of_chunking(monkeypatch):
    w = sample("student_t3", (1000, 32), seed=6)
    h = np.random.default_rng(6).uniform(0.1, 2.0, (5, 32)).astype(np.float32)
    first = quantize_blocks(w, spec("uint4", False, 32), importance=h)
    monkeypatch.setattr(weights, "SEARCH_CHUNK", 32 * 7)  # 143 chunks, the last one short
    second = quantize_blocks(w, spec("uint4", False, 32), importance=h)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64))


def test_search_off_without_importance_and_8_bit_blocks_alone():
    w = sample("gaussian", (256, 96), seed=8)  # K = 256, N = 96
    s = spec("int4", group_size=64)
    ref_codes, ref_scale = ort_rtn(np.ascontiguousarray(w.T).reshape(-1, 64))
    for off in (quantize_blockwise(w, s), quantize_blockwise(w, s, clip_search=False),
                quantize_blockwise(w, s, clip_search=False, importance=np.ones(256))):
        np.testing.assert_array_equal(off.scales.ravel(), ref_scale)
        np.testing.assert_array_equal(unpack_bits(off.packed, 4, 64).reshape(ref_codes.shape), ref_codes + 8)
    for on in (quantize_blockwise(w, s, clip_search=True), quantize_blockwise(w, s, importance=np.ones(256))):
        assert not np.array_equal(on.scales.ravel(), ref_scale)
    eight = [quantize_blockwise(w, spec("int8", group_size=64), clip_search=c) for c in (True, False)]
    np.testing.assert_array_equal(eight[0].packed, eight[1].packed)
    absmax = np.abs(np.ascontiguousarray(w.T).reshape(96, 4, 64)).max(axis=-1)
    np.testing.assert_allclose(eight[0].scales, absmax / 127, rtol=1e-6)  # int8 keeps absmax/127


def test_int8_per_channel_weights_unchanged():
    w = sample("gaussian", (32, 48), seed=9)
    s = spec("int8", group_size=None, qscheme="per_channel")
    qt = quantize_weight(w, s, axis=0)
    scale, zp = compute_qparams(w.min(axis=1), w.max(axis=1), "int8", True)
    np.testing.assert_array_equal(qt.scale, scale)
    np.testing.assert_array_equal(qt.data, quantize(w, scale, zp, "int8", axis=0))


# -- end to end: W4_GROUP128 -------------------------------------------------------------------


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def nbits_weight(model: onnx.ModelProto) -> np.ndarray:
    """W [K, N] unpacked from MatMulNBits' B (low nibble first) and scales, default zp 8."""
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    inits = initializers(model)
    assert len(node.input) == 3  # symmetric: no zero points
    packed, scales = inits[node.input[1]], inits[node.input[2]]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, block).astype(np.float32) - 8
    return (codes * scales[..., None]).reshape(n, -1)[:, :k].T


def reference_dequantized(w: np.ndarray, axis: int, block: int = 128) -> np.ndarray:
    """`w` through onnxruntime's RTN (blocks along `axis`): the same arithmetic, no search."""
    moved = np.moveaxis(w, axis, -1)
    codes, scale = ort_rtn(moved.reshape(-1, block))
    return np.moveaxis((codes * scale[:, None]).reshape(moved.shape), -1, axis)


def run_default_session(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def test_w4_group128_matmul_end_to_end():
    b = GraphBuilder(10)
    x = b.input("x", ["N", 4, 512])
    w = sample("student_t3", (512, 192), seed=10)
    model = b.build([b.node("MatMul", [x, b.const("w", w)])], name="w4")
    # accuracy_level 0: the kernel computes in float32, so the output shows the stored weights alone
    # symmetric (the preset is asymmetric): `nbits_weight` reads the kernel's default zero point
    sym = {"layer_type_quant_config": {"MatMul": {"weight": {"symmetric": True}}}}
    quant = onnxq.quantize(model, None, {"preset": "W4_GROUP128", "accuracy_level": 0, **sym}).model
    onnx.checker.check_model(quant, full_check=True)
    assert [n.op_type for n in quant.graph.node] == ["MatMulNBits"]
    a = np.random.default_rng(11).standard_normal((8, 4, 512)).astype(np.float32)
    out = run_default_session(quant, {"x": a})
    w_q = nbits_weight(quant)
    w_ref = reference_dequantized(w, axis=0)  # data-free default: onnxruntime's RTN arithmetic
    np.testing.assert_array_equal(w_q, w_ref.astype(np.float32))
    expected = a.astype(np.float64) @ w_ref
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()
    floor = sqnr_db(a @ w, expected) - 0.01  # the same arithmetic, up to float32 accumulation
    assert sqnr_db(a @ w, out) >= floor, (sqnr_db(a @ w, out), floor)
    old = old_rtn(np.ascontiguousarray(w.T).reshape(-1, 128)).reshape(192, 512).T
    assert sqnr_db(w, w_q) >= sqnr_db(w, old) + FULL_RANGE_GAIN_DB


def test_importance_weighted_search_lowers_output_error():
    """Activations with a few large channels (as in LLMs): the search weighted by their mean
    square minimises each block's expected output error, so on a fresh draw of the same
    distribution the output beats plain rounding; the weight-MSE search, blind to them,
    does not get that far."""
    rng = np.random.default_rng(16)
    k, n, samples = 512, 128, 512
    std = np.ones(k, np.float32)
    std[rng.choice(k, 8, replace=False)] = 20.0
    calib, fresh = (rng.standard_normal((2, samples, k)) * std).astype(np.float32)
    w = sample("student_t3", (k, n), seed=16)
    b = GraphBuilder(16)
    model = b.build([b.node("MatMul", [b.input("x", ["N", k]), b.const("w", w)])], name="imp")
    importance = (calib.astype(np.float64) ** 2).mean(axis=0)
    outputs = {}
    for name, kwargs in {"plain": {}, "mse": {"clip_search": True}, "weighted": {"importance": True}}.items():
        ir_model, _ = load_model(model)
        nodes = {node.name: spec("int4") for node in ir_model.graph}
        if kwargs.pop("importance", False):
            kwargs["importance"] = dict.fromkeys(nodes, importance)
        assert not emit_matmul_nbits(ir_model, nodes, **kwargs)
        quant = ir.to_proto(ir_model)
        onnx.checker.check_model(quant, full_check=True)
        outputs[name] = sqnr_db(fresh @ w, run_default_session(quant, {"x": fresh}))
    # measured: plain 14.1 dB, weight-MSE search 14.5 dB, weighted search 17.7 dB
    assert outputs["weighted"] > outputs["plain"] + 1.0, outputs
    assert outputs["weighted"] > outputs["mse"], outputs


def test_w4_group128_gather_gemm_accept_signed_scales():
    b = GraphBuilder(12)
    ids = b.input("ids", ["N", 6], TensorProto.INT64)
    table = sample("gaussian", (300, 256), seed=12) * 50
    w_mm = sample("laplace", (256, 384), seed=13) * 5
    w_gemm = sample("student_t3", (128, 384), seed=14) * 5  # Gemm transB=1: [N, K]
    h = b.node("Gather", [b.const("table", table), ids], axis=0)
    h = b.node("MatMul", [h, b.const("w_mm", w_mm)])
    h = b.node("Reshape", [h, b.const("shape", np.array([-1, 384], np.int64))])
    model = b.build([b.node("Gemm", [h, b.const("w_gemm", w_gemm)], transB=1)], name="w4_ops")
    # accuracy_level 0: the kernel computes in float32, so the output shows the stored weights alone
    # symmetric (the preset is asymmetric): full-range signed scales
    quant = onnxq.quantize(model, None, {"preset": "W4_GROUP128", "accuracy_level": 0, "layer_type_quant_config": {op: {"weight": {"symmetric": True}} for op in ("MatMul", "Gemm", "Gather")}}).model
    onnx.checker.check_model(quant, full_check=True)
    ops = {n.op_type: n for n in quant.graph.node}
    assert {"GatherBlockQuantized", "MatMulNBits", "DequantizeLinear"} <= set(ops)
    dq_attrs = {a.name: helper.get_attribute_value(a) for a in ops["DequantizeLinear"].attribute}
    assert dq_attrs["block_size"] == 128
    inits = initializers(quant)
    scales = [inits[ops["GatherBlockQuantized"].input[2]], inits[ops["MatMulNBits"].input[2]],
              inits[ops["DequantizeLinear"].input[1]]]
    assert all((s < 0).any() and (s > 0).any() for s in scales)  # signed scales everywhere
    feeds = {"ids": np.random.default_rng(15).integers(0, 300, (5, 6))}

    def forward(t: np.ndarray, wm: np.ndarray, wg: np.ndarray) -> np.ndarray:
        return (t[feeds["ids"]] @ wm).reshape(-1, 384) @ wg.T

    ref = forward(table, w_mm, w_gemm)
    out = run_default_session(quant, feeds)
    same_arithmetic = forward(reference_dequantized(table, 1), reference_dequantized(w_mm, 0),
                              reference_dequantized(w_gemm, 1))
    floor = sqnr_db(ref, same_arithmetic) - 0.01  # data-free default: onnxruntime's RTN
    assert sqnr_db(ref, out) >= floor, (sqnr_db(ref, out), floor)


@pytest.mark.parametrize(("dtype", "symmetric"), [(DType.INT4, False), (DType.INT4, True), (DType.INT8, True)])
def test_a_block_past_the_row_is_the_row_without_its_padding(dtype, symmetric):
    """A block wider than the blocked axis pads nothing that matters (zeros change no range
    and no error): the same codes and scales as a block of the axis' length, without the
    padded temporary (a mistyped group size of 100000 had asked for 18 GB; LLM trial)."""
    w = np.random.default_rng(0).standard_normal((40, 24)).astype(np.float32)
    spec = ResolvedSpec(dtype, symmetric, "per_group", None, 100000, "minmax", 99.99, 2048, (), None, None,
                        "float32", "half_even", False)
    importance = np.random.default_rng(1).random(24).astype(np.float32) + 0.5
    for extra in ({}, {"importance": importance}):
        wide = quantize_weight(w, spec, 1, block_size=100000, **extra)
        exact = quantize_weight(w, spec, 1, block_size=24, **extra)
        np.testing.assert_array_equal(wide.data, exact.data)
        np.testing.assert_array_equal(wide.scale, exact.scale)
        np.testing.assert_array_equal(wide.zero_point, exact.zero_point)
        assert wide.scale.shape == (40, 1) and wide.block_size == 100000


def _grouped(group: int) -> onnxq.Config:
    return onnxq.compose_config("W4_GROUP128", None, {"global_quant_config": {"weight": {
        "dtype": "int4", "symmetric": False, "qscheme": "per_group", "group_size": group}}})


def test_blocks_wider_than_the_rows_are_narrowed_to_the_row(tmp_path):
    """MatMulNBits pads each row to whole blocks: SmolLM2 in blocks of 4096 came out at 340
    MB (82 MB at 128, 540 MB float; LLM trial). A block past the row's end is the whole row
    either way, so it is stored in the next power of two that holds the row: the same
    codes and scales, less padding. A block that is no MatMulNBits block (100000: not a
    power of two) stays a blocked DequantizeLinear, which pads nothing (it had asked for an
    18 GB temporary)."""
    b = GraphBuilder(0)
    x = b.input("x", ["batch", 96])
    src = tmp_path / "m.onnx"
    onnx.save(b.build([b.matmul(b.matmul(x, 96, 192), 192, 96)], name="mlp"), src)
    feed = {"x": np.random.default_rng(2).standard_normal((4, 96)).astype(np.float32)}
    reference = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    outputs = {}
    for group in (4096, 256, 100000):
        out = tmp_path / f"q{group}.onnx"
        result = onnxq.quantize(str(src), str(out), _grouped(group), progress=False)
        outputs[group] = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)[0]
        blocks = [next(a.i for a in n.attribute if a.name == "block_size")
                  for n in onnx.load(str(out)).graph.node if n.op_type == "MatMulNBits"]
        if group == 100000:
            assert not blocks and any("not a power of two" in n for n in result.summary.note_texts)
        else:
            assert blocks == [128, 256], blocks  # K = 96 and 192: the next powers of two
    np.testing.assert_array_equal(outputs[4096], outputs[256])  # one block per row either way
    assert (tmp_path / "q4096.onnx").stat().st_size == (tmp_path / "q256.onnx").stat().st_size
    assert sqnr_db(reference, outputs[100000]) > 8


@pytest.mark.parametrize(("method", "dtype"), [("minmax", DType.INT4), ("hqq", DType.INT4), ("hqq", DType.INT8)])
def test_a_narrowed_block_rounds_as_the_wide_one(method, dtype):
    """A row shorter than its block is stored in a block of the next power of two
    (`matmul_nbits.row_block`): the codes, scales and zero points must be those of the
    wide block, the clipping search and HQQ included, whose sums the zero padding had
    moved (review: HQQ zero points differed between blocks of 128 and 32 on K = 24)."""
    from onnxq.numerics.blocks import dequantize_blockwise, quantize_blockwise

    w = (np.random.default_rng(0).standard_t(3, (24, 40)) * 0.05).astype(np.float32)
    found = []
    for block in (32, 128):
        spec = ResolvedSpec(dtype, False, "per_group", None, block, method, 99.99, 2048, (), None, None,
                            "float32", "half_even", False)
        bq = quantize_blockwise(w, spec, clip_search=True)
        found.append((dequantize_blockwise(bq), bq.scales, bq.zero_points))
    for narrow, wide in zip(*found):
        np.testing.assert_array_equal(narrow, wide)
