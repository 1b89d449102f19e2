"""Weight and channel geometry (`onnxq/graph/layout.py`).

Axes and counts are checked against the ONNX layouts; the channel scaling helpers are
checked by what they promise: scaling a weight's output channel c by f[c] scales the op's
output channel c, and scaling its input channel c equals scaling that input channel of
the activation (run with onnx's reference evaluator, groups included).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxq.graph import layout
from onnxq.plan.rules import OP_RULES


def node(op_type: str, **attrs) -> ir.Node:
    return ir.node(op_type, [], attrs)


def run_op(op_type: str, x: np.ndarray, w: np.ndarray, **attrs) -> np.ndarray:
    """One op on x and w with onnx's reference implementation (Gemm: op(x) @ op(w))."""
    group = attrs.get("group", 1)
    if op_type == "ConvTranspose" and group > 1:  # the reference mishandles groups: one at a time
        xs, ws = np.split(x, group, axis=1), np.split(w, group, axis=0)
        attrs = {**attrs, "group": 1}
        return np.concatenate([run_op(op_type, xg, wg, **attrs) for xg, wg in zip(xs, ws)], axis=1)
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x", "w"], ["y"], **attrs)], "layout",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, None),
         helper.make_tensor_value_info("w", TensorProto.DOUBLE, None)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ReferenceEvaluator(model).run(None, {"x": x, "w": w})[0]


# -- attributes -------------------------------------------------------------------------


def test_attr_and_groups_defaults():
    conv = node("Conv", group=4, pads=[1, 1, 1, 1])
    assert list(layout.attr(conv, "pads")) == [1, 1, 1, 1]
    assert layout.attr(conv, "auto_pad", "NOTSET") == "NOTSET"
    assert layout.attr(conv, "missing") is None
    assert layout.groups(conv) == 4
    assert layout.groups(node("Conv")) == 1
    assert layout.groups(node("Gemm")) == 1


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_transposes(trans_a, trans_b):
    assert layout.gemm_transposes(node("Gemm", transA=trans_a, transB=trans_b)) == (bool(trans_a), bool(trans_b))
    assert layout.gemm_transposes(node("Gemm")) == (False, False)


# -- Conv -------------------------------------------------------------------------------


def test_conv_axes_and_channels():
    conv = node("Conv")
    shape = (16, 8, 3, 3)
    assert layout.weight_axes(conv, 4) == (0, 1)
    assert layout.weight_out_axis(conv, 4) == 0
    assert layout.weight_in_axis(conv, 4) == 1
    assert layout.k_axes(conv, 4) == (2, 3, 1)  # taps first, input channel minor (im2col)
    assert layout.k_axes(conv, 3) == (2, 1)
    assert layout.k_axes(conv, 5) == (2, 3, 4, 1)
    assert layout.act_channel_axis(conv, 4) == -3
    assert layout.act_channel_axis(conv, 3) == -2
    assert layout.out_channels(conv, shape) == 16
    assert layout.in_channels(conv, shape) == 8
    assert not layout.is_depthwise(conv, shape)


def test_grouped_conv_channels_and_depthwise():
    grouped = node("Conv", group=2)
    assert layout.out_channels(grouped, (8, 3, 3, 3)) == 8
    assert layout.in_channels(grouped, (8, 3, 3, 3)) == 6
    assert layout.weight_in_axis(grouped, 4) == 1
    assert not layout.is_depthwise(grouped, (8, 3, 3, 3))
    depthwise = node("Conv", group=8)
    assert layout.is_depthwise(depthwise, (8, 1, 3, 3))
    assert layout.in_channels(depthwise, (8, 1, 3, 3)) == 8
    # a depth multiplier (two outputs per group) runs on the GEMM kernels
    assert not layout.is_depthwise(node("Conv", group=4), (8, 1, 3, 3))
    assert not layout.is_depthwise(node("Conv"), (1, 1, 3, 3))
    assert not layout.is_depthwise(node("ConvTranspose", group=8), (8, 1, 3, 3))
    assert not layout.is_depthwise(node("MatMul"), (8, 1))


def test_split_groups_views_conv_weight_by_group():
    w = np.arange(8 * 3 * 2 * 2).reshape(8, 3, 2, 2)
    wg = layout.split_groups(node("Conv", group=2), w)
    assert wg.shape == (2, 4, 3, 2, 2)
    np.testing.assert_array_equal(wg[1, 0], w[4])
    assert np.shares_memory(wg, w)


@pytest.mark.parametrize("group", [1, 2, 6])
def test_conv_channel_factors_scale_outputs_and_inputs(group):
    rng = np.random.default_rng(group)
    cin, cout = 6, 12
    w = rng.standard_normal((cout, cin // group, 3, 3))
    x = rng.standard_normal((2, cin, 5, 5))
    conv, attrs = node("Conv", group=group), {"group": group, "pads": [1, 1, 1, 1]}
    y = run_op("Conv", x, w, **attrs)
    f_out, f_in = rng.uniform(0.5, 2.0, cout), rng.uniform(0.5, 2.0, cin)
    scaled_out = run_op("Conv", x, w * layout.out_channel_factor(conv, w.shape, f_out), **attrs)
    np.testing.assert_allclose(scaled_out, y * f_out[None, :, None, None], rtol=1e-12)
    scaled_in = run_op("Conv", x, w * layout.in_channel_factor(conv, w.shape, f_in), **attrs)
    np.testing.assert_allclose(scaled_in, run_op("Conv", x * f_in[None, :, None, None], w, **attrs),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("group", [1, 3])
def test_conv_channel_absmax(group):
    w = np.random.default_rng(7).standard_normal((6, 2, 3, 3))
    conv = node("Conv", group=group)
    out_per_group = 6 // group
    expected_in = [np.abs(w[(c // 2) * out_per_group:(c // 2 + 1) * out_per_group, c % 2]).max()
                   for c in range(2 * group)]  # input channel c = group (c // 2), entry c % 2
    np.testing.assert_array_equal(layout.in_channel_absmax(conv, w), expected_in)
    np.testing.assert_array_equal(layout.out_channel_absmax(conv, w), np.abs(w).reshape(6, -1).max(axis=1))


@pytest.mark.parametrize("group", [1, 2])
def test_conv_apply_to_input_is_a_conv_on_a_constant_image(group):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4 // group, 3, 3))
    c = rng.standard_normal(4)
    x = np.broadcast_to(c[None, :, None, None], (1, 4, 5, 5)).copy()
    y = run_op("Conv", x, w, group=group)  # no padding: every output position sees only c
    np.testing.assert_allclose(layout.apply_to_input(node("Conv", group=group), w, c), y[0, :, 0, 0], rtol=1e-12)


# -- ConvTranspose ----------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_axes_channels_and_factors(group):
    rng = np.random.default_rng(10 + group)
    cin, cout = 4, 6
    w = rng.standard_normal((cin, cout // group, 3, 3))
    convt, attrs = node("ConvTranspose", group=group), {"group": group, "strides": [2, 2]}
    assert layout.weight_out_axis(convt, 4) == 1
    assert layout.weight_in_axis(convt, 4) == 0
    assert layout.k_axes(convt, 4) is None
    assert layout.act_channel_axis(convt, 4) == -3
    assert layout.out_channels(convt, w.shape) == cout
    assert layout.in_channels(convt, w.shape) == cin
    assert OP_RULES["ConvTranspose"].weight_axis(convt, 4) == 1
    x = rng.standard_normal((1, cin, 4, 4))
    y = run_op("ConvTranspose", x, w, **attrs)
    f_out = rng.uniform(0.5, 2.0, cout)
    scaled = run_op("ConvTranspose", x, w * layout.out_channel_factor(convt, w.shape, f_out), **attrs)
    np.testing.assert_allclose(scaled, y * f_out[None, :, None, None], rtol=1e-12)
    f_in = rng.uniform(0.5, 2.0, cin)
    scaled = run_op("ConvTranspose", x, w * layout.in_channel_factor(convt, w.shape, f_in), **attrs)
    np.testing.assert_allclose(scaled, run_op("ConvTranspose", x * f_in[None, :, None, None], w, **attrs),
                               rtol=1e-10, atol=1e-12)
    out_per_group, in_per_group = cout // group, cin // group
    expected = [np.abs(w[(o // out_per_group) * in_per_group:(o // out_per_group + 1) * in_per_group,
                         o % out_per_group]).max() for o in range(cout)]
    np.testing.assert_array_equal(layout.out_channel_absmax(convt, w), expected)
    np.testing.assert_array_equal(layout.in_channel_absmax(convt, w), np.abs(w).reshape(cin, -1).max(axis=1))


# -- Gemm -------------------------------------------------------------------------------


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_geometry(trans_a, trans_b):
    rng = np.random.default_rng(2 * trans_a + trans_b)
    k, n, m = 5, 3, 4
    gemm = node("Gemm", transA=trans_a, transB=trans_b)
    b_kn = rng.standard_normal((k, n))
    w = b_kn.T if trans_b else b_kn
    a = rng.standard_normal((m, k))
    x = a.T if trans_a else a
    assert layout.weight_out_axis(gemm, 2) == (0 if trans_b else 1)
    assert layout.weight_in_axis(gemm, 2) == (1 if trans_b else 0)
    assert layout.k_axes(gemm, 2) == ((1,) if trans_b else (0,))
    assert layout.act_channel_axis(gemm, 2) == (-2 if trans_a else -1)
    assert layout.out_channels(gemm, w.shape) == n
    assert layout.in_channels(gemm, w.shape) == k
    np.testing.assert_array_equal(layout.matrix_kn(gemm, w), b_kn)
    assert OP_RULES["Gemm"].weight_axis(gemm, 2) == layout.weight_out_axis(gemm, 2)
    assert OP_RULES["Gemm"].weight_in_axis(gemm, 2) == layout.weight_in_axis(gemm, 2)

    y = run_op("Gemm", x, w, transA=trans_a, transB=trans_b)
    np.testing.assert_allclose(y, a @ b_kn, rtol=1e-12)
    f_out, f_in = rng.uniform(0.5, 2.0, n), rng.uniform(0.5, 2.0, k)
    scaled = run_op("Gemm", x, w * layout.out_channel_factor(gemm, w.shape, f_out), transA=trans_a, transB=trans_b)
    np.testing.assert_allclose(scaled, y * f_out, rtol=1e-12)
    scaled = run_op("Gemm", x, w * layout.in_channel_factor(gemm, w.shape, f_in), transA=trans_a, transB=trans_b)
    np.testing.assert_allclose(scaled, (a * f_in) @ b_kn, rtol=1e-12)
    np.testing.assert_array_equal(layout.out_channel_absmax(gemm, w), np.abs(b_kn).max(axis=0))
    np.testing.assert_array_equal(layout.in_channel_absmax(gemm, w), np.abs(b_kn).max(axis=1))
    c = rng.standard_normal(k)
    np.testing.assert_allclose(layout.apply_to_input(gemm, w, c), c @ b_kn, rtol=1e-12)


# -- MatMul -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 4), (2, 6, 4), (3, 2, 6, 4)])
def test_matmul_geometry(shape):
    matmul = node("MatMul")
    rank = len(shape)
    assert layout.weight_out_axis(matmul, rank) == rank - 1
    assert layout.weight_in_axis(matmul, rank) == rank - 2
    assert layout.k_axes(matmul, rank) == (rank - 2,)
    assert layout.act_channel_axis(matmul, rank) == -1
    assert layout.out_channels(matmul, shape) == 4
    assert layout.in_channels(matmul, shape) == 6
    assert OP_RULES["MatMul"].weight_axis(matmul, rank) == rank - 1
    assert OP_RULES["MatMul"].weight_in_axis(matmul, rank) == rank - 2
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(shape)
    x = rng.standard_normal((*shape[:-2], 3, 6))
    f_out, f_in = rng.uniform(0.5, 2.0, 4), rng.uniform(0.5, 2.0, 6)
    np.testing.assert_allclose(x @ (w * layout.out_channel_factor(matmul, w.shape, f_out)), (x @ w) * f_out, rtol=1e-12)
    np.testing.assert_allclose(x @ (w * layout.in_channel_factor(matmul, w.shape, f_in)), (x * f_in) @ w, rtol=1e-12)


def test_matmul_vector_weight_and_2d_apply():
    matmul = node("MatMul")
    assert layout.weight_in_axis(matmul, 1) == 0
    assert layout.weight_out_axis(matmul, 1) == 0
    w = np.arange(12.0).reshape(4, 3)
    c = np.array([1.0, -2.0, 0.5, 3.0])
    np.testing.assert_array_equal(layout.apply_to_input(matmul, w, c), c @ w)
    np.testing.assert_array_equal(layout.matrix_kn(matmul, w), w)


# -- Gather and unknown ops -------------------------------------------------------------


def test_gather_table_layout():
    gather = node("Gather")
    assert layout.weight_out_axis(gather, 2) == 0
    assert layout.weight_in_axis(gather, 2) == 1
    assert layout.k_axes(gather, 2) is None
    assert OP_RULES["Gather"].weight_axis is layout.weight_out_axis


def test_unknown_op_raises():
    relu = node("Relu")
    for fn in (layout.weight_out_axis, layout.weight_in_axis, layout.act_channel_axis):
        with pytest.raises(ValueError, match="Relu"):
            fn(relu, 2)
    with pytest.raises(ValueError, match="Relu"):
        layout.apply_to_input(relu, np.ones((2, 2)), np.ones(2))
    assert layout.k_axes(relu, 2) is None
