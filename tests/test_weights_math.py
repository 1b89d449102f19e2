"""Quantization arithmetic against hand-computed values and against onnxruntime.

Values are chosen so that scales are powers of two (exact in float32) and the expected
integers, ties included, can be written down by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run
from onnx import TensorProto, helper, numpy_helper

from onnxq.config.resolve import merge_specs
from onnxq.config.spec import DType, QScheme, QuantizationSpec, RoundMethod, ScaleType
from onnxq.numerics import qmath
from onnxq.numerics.weights import channel_range, quantize_bias, quantize_weight


def weight_spec(**fields):
    base = dict(dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_CHANNEL)
    base.update(fields)
    return merge_specs([QuantizationSpec(**base)], "weight")


BIAS_SPEC = merge_specs([QuantizationSpec()], "bias")  # int32 symmetric by default

# ---------------------------------------------------------------------------------------
# weights

W2 = np.array(
    [
        [1.984375, -0.5, 0.0078125, 0.0234375, -0.0234375, 0.0390625],  # absmax 127/64
        [0.49609375, -0.0625, 0.005859375, -0.009765625, 0.0, 0.001953125],  # absmax 127/256
    ],
    dtype=np.float32,
)
# x * 64 = [127, -32, 0.5, 1.5, -1.5, 2.5] and x * 256 = [127, -16, 1.5, -2.5, 0, 0.5]
Q_ROW0_HALF_EVEN = [127, -32, 0, 2, -2, 2]
Q_ROW1_HALF_EVEN = [127, -16, 2, -2, 0, 0]


def test_weight_per_tensor():
    qt = quantize_weight(W2[:1], weight_spec(qscheme=QScheme.PER_TENSOR), axis=None)
    assert qt.axis is None
    assert qt.scale.dtype == np.float32 and qt.scale.shape == ()
    assert float(qt.scale) == 1 / 64
    assert qt.zero_point.dtype == np.int8 and int(qt.zero_point) == 0
    assert qt.data.dtype == np.int8
    assert qt.data.tolist() == [Q_ROW0_HALF_EVEN]


def test_weight_per_tensor_uses_the_global_absmax():
    qt = quantize_weight(W2, weight_spec(qscheme=QScheme.PER_TENSOR), axis=None)
    assert float(qt.scale) == 1 / 64
    # Row 1 on the coarse scale: x * 64 = [31.75, -4, 0.375, -0.625, 0, 0.125]
    assert qt.data.tolist() == [Q_ROW0_HALF_EVEN, [32, -4, 0, -1, 0, 0]]


def test_weight_per_channel_axis0():
    qt = quantize_weight(W2, weight_spec(), axis=0)
    assert qt.axis == 0
    assert qt.scale.dtype == np.float32
    assert qt.scale.tolist() == [1 / 64, 1 / 256]
    assert qt.zero_point.dtype == np.int8 and qt.zero_point.tolist() == [0, 0]
    assert qt.data.tolist() == [Q_ROW0_HALF_EVEN, Q_ROW1_HALF_EVEN]


def test_weight_per_channel_last_axis():
    qt = quantize_weight(W2.T.copy(), weight_spec(), axis=1)
    assert qt.axis == 1
    assert qt.scale.tolist() == [1 / 64, 1 / 256]
    assert qt.data.T.tolist() == [Q_ROW0_HALF_EVEN, Q_ROW1_HALF_EVEN]


def test_weight_per_channel_4d_conv_layout():
    w = np.zeros((3, 2, 2, 2), np.float32)
    w[0, 1, 1, 0] = -2.0  # absmax 2 -> scale 2/127
    w[1] = 0.25
    w[1, 0, 0, 0] = -0.5  # absmax 0.5
    # channel 2 stays all zeros: scale 1.0, all codes 0
    qt = quantize_weight(w, weight_spec(), axis=0)
    np.testing.assert_array_equal(qt.scale, np.float32([2 / 127, 0.5 / 127, 1.0]))
    assert qt.data[0, 1, 1, 0] == -127 and np.count_nonzero(qt.data[0]) == 1
    assert qt.data[1, 0, 0, 0] == -127 and np.all(qt.data[1].ravel()[1:] == 64)  # 63.5 -> 64
    assert np.all(qt.data[2] == 0)


def test_weight_half_up_rounding():
    qt = quantize_weight(W2, weight_spec(round_method=RoundMethod.HALF_UP), axis=0)
    assert qt.data.tolist() == [[127, -32, 1, 2, -2, 3], [127, -16, 2, -3, 0, 1]]


def test_channel_range():
    lo, hi = channel_range(W2, 0)
    assert lo.tolist() == [-0.5, -0.0625] and hi.tolist() == [1.984375, 0.49609375]
    lo, hi = channel_range(W2, None)
    assert float(lo) == -0.5 and float(hi) == 1.984375


# ---------------------------------------------------------------------------------------
# bias


def test_bias_per_channel():
    w_scale = np.float32([1 / 64, 1 / 256])
    bias = np.float32([1.0, -0.25])
    qt = quantize_bias(bias, np.float32(0.5), w_scale, BIAS_SPEC)
    assert qt is not None
    assert qt.scale.dtype == np.float32 and qt.scale.tolist() == [1 / 128, 1 / 512]
    assert qt.data.dtype == np.int32 and qt.data.tolist() == [128, -128]
    assert qt.zero_point.dtype == np.int32 and qt.zero_point.tolist() == [0, 0]
    assert qt.axis == 0


def test_bias_ties_round_half_even():
    # 1.5 and -2.5 steps of the bias scale
    qt = quantize_bias(np.float32([3 / 256, -5 / 1024]), np.float32(0.5),
                       np.float32([1 / 64, 1 / 256]), BIAS_SPEC)
    assert qt.data.tolist() == [2, -2]


def test_bias_per_tensor():
    qt = quantize_bias(np.float32([0.75, -1.0, 0.0]), np.float32(0.25), np.float32(0.125), BIAS_SPEC)
    assert qt.axis is None
    assert float(qt.scale) == 1 / 32
    assert qt.data.tolist() == [24, -32, 0]


def test_bias_grouped_conv_transpose_scales_repeat():
    qt = quantize_bias(np.float32([1.0, 1.0, -1.0, 0.5]), np.float32(1.0),
                       np.float32([0.5, 0.25]), BIAS_SPEC)
    assert qt.scale.tolist() == [0.5, 0.25, 0.5, 0.25]
    assert qt.data.tolist() == [2, 4, -2, 2]


def test_bias_size_not_a_multiple_of_scales():
    assert quantize_bias(np.float32([1, 2, 3]), np.float32(1.0), np.float32([0.5, 0.25]),
                         BIAS_SPEC) is None


@pytest.mark.parametrize(
    "value, expected",
    [
        ((2**31 - 1) * 2.0**-10, 2**31 - 1),
        (-(2**31) * 2.0**-10, -(2**31)),
        (2**31 * 2.0**-10, None),
        (-(2**31 + 1) * 2.0**-10, None),
        (1e30, None),
    ],
)
def test_bias_overflow_returns_none(value, expected):
    qt = quantize_bias(np.array([value, 0.0]), np.float32(1.0), np.float32(2.0**-10), BIAS_SPEC)
    if expected is None:
        assert qt is None
    else:
        assert qt.data.tolist() == [expected, 0]


# ---------------------------------------------------------------------------------------
# compute_qparams


def qp(rmin, rmax, dtype, symmetric, scale_type="float32"):
    scale, zp = qmath.compute_qparams(rmin, rmax, dtype, symmetric, scale_type)
    assert scale.dtype == np.float32
    return scale, zp


@pytest.mark.parametrize(
    "rmin, rmax, dtype, symmetric, scale, zp",
    [
        (-1.0, 3.0, "uint8", False, np.float32(4 / 255), 64),  # 1 / (4/255) = 63.75
        (0.5, 2.0, "uint8", False, np.float32(2 / 255), 0),  # the range always holds 0
        (-2.0, -1.0, "uint8", False, np.float32(2 / 255), 255),
        (-1.0, 3.0, "int8", False, np.float32(4 / 255), -64),  # -128 + 63.75
        (-1.0, 0.5, "int8", True, np.float32(1 / 127), 0),
        (-1.0, 0.5, "uint8", True, np.float32(1 / 127), 128),
        (0.0, 0.0, "uint8", False, np.float32(1.0), 0),
        (0.0, 0.0, "int8", True, np.float32(1.0), 0),
    ],
)
def test_qparams_float32(rmin, rmax, dtype, symmetric, scale, zp):
    s, z = qp(rmin, rmax, dtype, symmetric)
    assert s == scale
    assert z.dtype == np.dtype(dtype) and int(z) == zp


@pytest.mark.parametrize(
    "rmin, rmax, dtype, symmetric, scale, zp",
    [
        (-1.0, 1.0, "int8", True, 2.0**-6, 0),  # 1/127 -> up to 1/64
        (-1.0, 3.0, "uint8", False, 2.0**-5, 32),  # 4/255 -> up to 1/32
        (-1.984375, 0.0, "int8", True, 2.0**-6, 0),  # already 1/64: unchanged
    ],
)
def test_qparams_power_of_two(rmin, rmax, dtype, symmetric, scale, zp):
    s, z = qp(rmin, rmax, dtype, symmetric, "power_of_two")
    assert float(s) == scale and int(z) == zp


@pytest.mark.parametrize(
    "rmin, rmax, dtype, symmetric, scale, zp",
    [
        # 4/255 lies between float16 values 2^-6 + 4*2^-16 and 2^-6 + 5*2^-16: rounds up
        (-1.0, 3.0, "uint8", False, 2.0**-6 + 5 * 2.0**-16, 64),
        # 1/127 lies between 2^-7 + 8*2^-17 and 2^-7 + 9*2^-17
        (-1.0, 1.0, "int8", True, 2.0**-7 + 9 * 2.0**-17, 0),
    ],
)
def test_qparams_float16(rmin, rmax, dtype, symmetric, scale, zp):
    s, z = qp(rmin, rmax, dtype, symmetric, ScaleType.FLOAT16.value)
    assert float(s) == scale
    assert float(np.float16(s)) == float(s)  # representable in float16
    assert int(z) == zp


def test_qparams_per_channel_arrays():
    s, z = qp(np.array([-1.0, 0.0, -0.25]), np.array([0.5, 0.0, 2.0]), "int8", True)
    np.testing.assert_array_equal(s, np.float32([1 / 127, 1.0, 2 / 127]))
    assert z.dtype == np.int8 and z.tolist() == [0, 0, 0]
    s, z = qp(np.array([-1.0, 0.5]), np.array([3.0, 2.0]), "uint8", False)
    np.testing.assert_array_equal(s, np.float32([4 / 255, 2 / 255]))
    assert z.tolist() == [64, 0]


def test_qparams_tiny_range_has_a_floor():
    """A range of 1e-30 keeps its resolution (scale-equivariance); one under float32's
    normal numbers takes the floor."""
    s, _ = qp(0.0, 1e-30, "uint8", False)
    assert float(s) == pytest.approx(1e-30 / 255, rel=1e-6)
    s, _ = qp(0.0, 1e-40, "uint8", False)
    assert float(s) == np.float32(qmath.MIN_SCALE)


def test_int_type_table():
    assert (qmath.int_type("int8").qmin, qmath.int_type("int8").qmax) == (-128, 127)
    assert (qmath.int_type("uint8").qmin, qmath.int_type("uint8").qmax) == (0, 255)
    assert qmath.int_type("int32").bits == 32 and qmath.int_type("uint8").bits == 8
    with pytest.raises(KeyError):
        qmath.int_type("float32")


# ---------------------------------------------------------------------------------------
# numpy quantize/dequantize vs onnxruntime QuantizeLinear/DequantizeLinear

ONNX_TYPE = {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


def one_node(op: str, x_type: int, y_type: int, shape, scale, zp, axis=None):
    attrs = {} if axis is None else {"axis": axis}
    node = helper.make_node(op, ["x", "scale", "zp"], ["y"], **attrs)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info("x", x_type, list(shape))],
        [helper.make_tensor_value_info("y", y_type, list(shape))],
        initializer=[numpy_helper.from_array(np.asarray(scale, np.float32), "scale"),
                     numpy_helper.from_array(np.asarray(zp), "zp")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def ort_quantize(x, scale, zp, axis=None):
    zp = np.asarray(zp)
    model = one_node("QuantizeLinear", TensorProto.FLOAT, ONNX_TYPE[zp.dtype], x.shape, scale, zp, axis)
    return run(model, {"x": x})


def ort_dequantize(q, scale, zp, axis=None):
    model = one_node("DequantizeLinear", ONNX_TYPE[q.dtype], TensorProto.FLOAT, q.shape, scale, zp, axis)
    return run(model, {"x": q})


def tie_vector(scale: float) -> np.ndarray:
    """Exact ties (k + 0.5) * scale across and beyond the 8-bit range, plus huge values."""
    k = np.arange(-300, 300, dtype=np.float64)
    x = np.concatenate([(k + 0.5) * scale, k * scale, (k + 0.25) * scale, [1e30, -1e30, 0.0, -0.0]])
    return x.astype(np.float32)


@pytest.mark.parametrize("zp", [np.uint8(128), np.uint8(0), np.int8(0), np.int8(-3), np.int8(127)])
@pytest.mark.parametrize("scale", [0.125, 2.0**-10, 4.0])
def test_quantize_matches_ort_ties_and_saturation(zp, scale):
    x = tie_vector(scale)
    ours = qmath.quantize(x, np.float32(scale), zp, zp.dtype.name)
    theirs = ort_quantize(x, scale, zp)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)
    # The vector really exercises ties and both saturation ends.
    info = qmath.int_type(zp.dtype.name)
    assert np.sum(ours == info.qmin) > 10 and np.sum(ours == info.qmax) > 10
    # 0.5 -> 0 and 1.5 -> 2 (half to even), relative to the zero point
    half = np.float32([0.5 * scale, 1.5 * scale, -0.5 * scale, -1.5 * scale])
    rel = qmath.quantize(half, np.float32(scale), zp, zp.dtype.name).astype(int) - int(zp)
    expected = np.clip(np.array([0, 2, 0, -2]) + int(zp), info.qmin, info.qmax) - int(zp)
    assert rel.tolist() == expected.tolist()


def test_quantize_matches_ort_per_channel():
    scale = np.float32([0.125, 0.5, 2.0])
    zp = np.uint8([0, 128, 255])
    x = np.stack([tie_vector(float(s)) for s in scale], axis=1)
    ours = qmath.quantize(x, scale, zp, "uint8", axis=1)
    np.testing.assert_array_equal(ours, ort_quantize(x, scale, zp, axis=1))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_dequantize_matches_ort(dtype):
    info = np.iinfo(dtype)
    q = np.arange(info.min, info.max + 1, dtype=dtype)
    for scale, zp in ((np.float32(0.0173), dtype(3)), (np.float32(2.0**-7), dtype(info.max))):
        ours = qmath.dequantize(q, scale, zp)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ort_dequantize(q, scale, zp))
    q2 = np.stack([q, q[::-1]], axis=1)
    scales, zps = np.float32([0.1, 0.003]), np.array([0, 5], dtype)
    np.testing.assert_array_equal(qmath.dequantize(q2, scales, zps, axis=1),
                                  ort_dequantize(q2, scales, zps, axis=1))


def test_round_trip_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 3, 10_000).astype(np.float32)
    scale, zp = qmath.compute_qparams(x.min(), x.max(), "uint8", False)
    back = qmath.dequantize(qmath.quantize(x, scale, zp, "uint8"), scale, zp)
    err = np.abs(back.astype(np.float64) - x)
    lo, hi = (0 - int(zp)) * float(scale), (255 - int(zp)) * float(scale)
    inside = (x >= lo) & (x <= hi)
    assert inside.mean() > 0.99
    assert err[inside].max() <= float(scale) * 0.5 * (1 + 1e-4)
    # The rounded zero point moves the ends by at most half a step.
    assert err.max() <= float(scale) * (1 + 1e-4)


def test_quantize_matches_ort_with_a_non_power_of_two_scale():
    scale, zp = np.float32(0.1), np.int8(0)
    x = np.float32([3.55, 1.05, -2.45])
    np.testing.assert_array_equal(qmath.quantize(x, scale, zp, "int8"), ort_quantize(x, scale, zp))
