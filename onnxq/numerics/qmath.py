"""Quantization arithmetic shared by observers and emitters.

Ranges become (scale, zero point) here, and tensors are quantized and dequantized here,
so every stage agrees on one definition. Integer ranges come from the dtype table, never
from hard-coded 8-bit constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx

from onnxq.config.spec import DType


@dataclass(frozen=True)
class IntType:
    """An integer quantization type: its range, numpy dtype and ONNX element type."""

    name: str
    qmin: int
    qmax: int
    np_dtype: type
    onnx_type: int

    @property
    def signed(self) -> bool:
        return self.qmin < 0

    @property
    def bits(self) -> int:
        return int(np.log2(self.qmax - self.qmin + 1))

    def narrowed(self, bits: int) -> IntType:
        """The same container holding only `bits`-bit codes (7-bit weights in int8).

        Signed narrowed codes reach +-2^(bits-1) (7 bits: [-64, 64], as onnxruntime's
        reduce_range): the container has room for +2^(bits-1), and it is the magnitude,
        not the count of codes, that keeps int16 pair sums of u8 x s8 products in range.
        """
        if bits >= self.bits:
            return self
        qmin = -(2 ** (bits - 1)) if self.signed else 0
        qmax = 2 ** (bits - 1) - 1 if self.signed else 2**bits - 1
        return IntType(f"{self.name}:{bits}b", qmin, qmax, self.np_dtype, self.onnx_type)


INT_TYPES: dict[DType, IntType] = {
    DType.INT4: IntType("int4", -8, 7, ml_dtypes.int4, onnx.TensorProto.INT4),
    DType.UINT4: IntType("uint4", 0, 15, ml_dtypes.uint4, onnx.TensorProto.UINT4),
    DType.INT8: IntType("int8", -128, 127, np.int8, onnx.TensorProto.INT8),
    DType.UINT8: IntType("uint8", 0, 255, np.uint8, onnx.TensorProto.UINT8),
    DType.INT16: IntType("int16", -(2**15), 2**15 - 1, np.int16, onnx.TensorProto.INT16),
    DType.UINT16: IntType("uint16", 0, 2**16 - 1, np.uint16, onnx.TensorProto.UINT16),
    DType.INT32: IntType("int32", -(2**31), 2**31 - 1, np.int32, onnx.TensorProto.INT32),
    DType.UINT32: IntType("uint32", 0, 2**32 - 1, np.uint32, onnx.TensorProto.UINT32),
}


@dataclass(frozen=True)
class Float8Type:
    """A float8 quantization type: QuantizeLinear saturates to +-max_value."""

    name: str
    max_value: float
    np_dtype: type
    onnx_type: int
    exponent_bits: int
    mantissa_bits: int


FLOAT8_TYPES: dict[DType, Float8Type] = {
    DType.FLOAT8_E4M3FN: Float8Type(
        "float8_e4m3fn", 448.0, ml_dtypes.float8_e4m3fn, onnx.TensorProto.FLOAT8E4M3FN, 4, 3
    ),
    DType.FLOAT8_E5M2: Float8Type(
        "float8_e5m2", 57344.0, ml_dtypes.float8_e5m2, onnx.TensorProto.FLOAT8E5M2, 5, 2
    ),
}

# Target float types (the tensor is converted, not quantized) and Brevitas-style
# (exponent_bits, mantissa_bits) descriptions of every standard float type.
FLOAT_TARGETS = {DType.FLOAT16, DType.BFLOAT16}
# Shared-exponent block formats of the qdq-ext format (`numerics.extended.BLOCK_FORMATS`).
BLOCK_DTYPES = {DType.MXINT8, DType.MXFP8_E4M3, DType.MXFP8_E5M2, DType.MXFP6_E3M2, DType.MXFP6_E2M3,
                DType.MXFP4_E2M1, DType.BFP16}
FLOAT_BY_BITS: dict[tuple[int, int], DType] = {
    (4, 3): DType.FLOAT8_E4M3FN,
    (5, 2): DType.FLOAT8_E5M2,
    (5, 10): DType.FLOAT16,
    (8, 7): DType.BFLOAT16,
    (8, 23): DType.FLOAT32,
}


def float_dtype_from_bits(exponent_bits: int, mantissa_bits: int) -> DType | None:
    """The standard float dtype with these exponent/mantissa widths, or None."""
    return FLOAT_BY_BITS.get((exponent_bits, mantissa_bits))


def is_integer(dtype: DType | str) -> bool:
    return DType(dtype) in INT_TYPES


def is_float8(dtype: DType | str) -> bool:
    return DType(dtype) in FLOAT8_TYPES


def qdq_opset(dtype: DType | str) -> int:
    """The lowest ai.onnx opset whose QuantizeLinear/DequantizeLinear take this dtype."""
    d = DType(dtype)
    if d in (DType.INT4, DType.UINT4, DType.INT16, DType.UINT16):
        return 21
    if d in FLOAT8_TYPES:
        return 19
    return 13

# Smallest scale we emit: float32's smallest normal number. Quantization is
# scale-equivariant, so a tensor of tiny values (a freshly initialised EfficientNet-B0's
# activations shrink to 1e-13 at its head) keeps its resolution; the floor of 2^-40 this
# replaced zeroed everything under 2e-10 (that EfficientNet: output SQNR 0 dB, onnxruntime's
# quantizer 21 dB; now 21.2; a Conv chain at 1e-30 keeps its 33 dB). Where an int8 kernel's
# s_in * s_w underflows float32, both are tiny and the products it drops lie far under the
# output's resolution; a bias that would pass int32 stays float (`weights.quantize_bias`),
# its node guarded against onnxruntime's own int32 rewrite of it (`emit/float_kernels.py`).
MIN_SCALE = 2.0**-126


def int_type(dtype: DType | str, bits: int | None = None) -> IntType:
    """The IntType of an integer dtype, narrowed to `bits` when given; raises KeyError
    for float dtypes."""
    info = INT_TYPES[DType(dtype)]
    return info if bits is None else info.narrowed(bits)


def symmetric_zero_point(info: IntType) -> int:
    """Zero point of symmetric quantization: 0 for signed, mid-range for unsigned."""
    return 0 if info.signed else (info.qmax + info.qmin + 1) // 2


def symmetric_divisor(info: IntType) -> int:
    """Number of quantization steps between 0 and the largest magnitude (127 for 8-bit)."""
    return (info.qmax - info.qmin) // 2


def round_scale(scale: np.ndarray, scale_type: str) -> np.ndarray:
    """Apply the scale type: power_of_two rounds up to 2^k, float16 to a float16 value."""
    scale = np.maximum(np.asarray(scale, dtype=np.float64), MIN_SCALE)
    if scale_type == "power_of_two":
        return np.exp2(np.ceil(np.log2(scale)))
    if scale_type == "float16":
        lo = float(np.finfo(np.float16).smallest_subnormal)
        hi = float(np.finfo(np.float16).max)
        s16 = np.clip(scale, lo, hi).astype(np.float16)
        s16 = np.where(s16.astype(np.float64) < np.minimum(scale, hi), np.nextafter(s16, np.float16(np.inf)), s16)
        return s16.astype(np.float64)
    return scale


def compute_qparams(
    rmin: np.ndarray | float,
    rmax: np.ndarray | float,
    dtype: DType | str,
    symmetric: bool,
    scale_type: str = "float32",
    min_scale: np.ndarray | float = MIN_SCALE,
    bits: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32) and zero point (in the dtype) covering [rmin, rmax] and zero.

    Works on scalars (per-tensor) and arrays (per-channel or per-block). Symmetric
    quantization maps the largest magnitude to `symmetric_divisor` steps; asymmetric
    spreads [rmin, rmax] over the whole integer range with a rounded zero point. Float8
    types are always symmetric: the largest magnitude maps to the type's max value.
    `min_scale` raises scales that would be smaller (used to keep int32 biases in range).
    `bits` narrows an integer type to fewer bits in the same container (7-bit weights).
    """
    rmin = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    rmax = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    if is_float8(dtype):
        f8 = FLOAT8_TYPES[DType(dtype)]
        absmax = np.maximum(-rmin, rmax)
        scale = round_scale(np.maximum(np.where(absmax > 0, absmax / f8.max_value, 1.0), min_scale), scale_type)
        return scale.astype(np.float32), np.zeros(scale.shape, dtype=f8.np_dtype)
    info = int_type(dtype, bits)
    if symmetric:
        absmax = np.maximum(-rmin, rmax)
        scale = np.where(absmax > 0, absmax / symmetric_divisor(info), 1.0)
        scale = round_scale(np.maximum(scale, min_scale), scale_type)
        zp = np.full(scale.shape, symmetric_zero_point(info), dtype=np.float64)
    else:
        span = rmax - rmin
        scale = np.where(span > 0, span / (info.qmax - info.qmin), 1.0)
        scale = round_scale(np.maximum(scale, min_scale), scale_type)
        zp = np.clip(np.rint(info.qmin - rmin / scale), info.qmin, info.qmax)
    return scale.astype(np.float32), zp.astype(info.np_dtype)


# Integer types whose codes plus zero points float32 holds exactly: `quantize` rounds them
# to nearest even in float32 (a ratio of 2^24 or more clips in them whatever its rounding).
FLOAT32_EXACT = frozenset({DType.INT4, DType.UINT4, DType.INT8, DType.UINT8})


def round_values(x: np.ndarray, round_method: str) -> np.ndarray:
    """Round to integers: half_even (as QuantizeLinear), half_up (ties away from zero, as
    C's round()), floor or ceil."""
    if round_method == "half_even":
        return np.rint(x)
    if round_method == "half_up":
        return np.sign(x) * np.floor(np.abs(x) + 0.5)
    if round_method == "floor":
        return np.floor(x)
    if round_method == "ceil":
        return np.ceil(x)
    raise ValueError(f"unknown round_method {round_method!r}")


def broadcast_param(
    param: np.ndarray, shape: tuple[int, ...] | int, axis: int | None, block_size: int | None = None
) -> np.ndarray:
    """Expand a parameter so it broadcasts against a tensor of `shape`.

    Per-tensor: unchanged. Per-channel: a vector laid along `axis`. Per-block: a tensor of
    the same rank whose `axis` has one entry per block of `block_size`.
    `shape` may be given as a rank for per-tensor and per-channel parameters.
    """
    param = np.asarray(param)
    if axis is None or param.ndim == 0:
        return param
    rank = shape if isinstance(shape, int) else len(shape)
    axis %= rank
    if block_size:
        return np.repeat(param, block_size, axis=axis).take(range(shape[axis]), axis=axis)
    target = [1] * rank
    target[axis] = param.size
    return param.reshape(target)


def quantize(
    x: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray,
    dtype: DType | str,
    axis: int | None = None,
    round_method: str = "half_even",
    block_size: int | None = None,
    bits: int | None = None,
) -> np.ndarray:
    """Quantize like ONNX QuantizeLinear (saturate=1): saturate(round(x / scale) + zero_point).

    `bits` saturates to a narrower range than the dtype's (7-bit weights in int8)."""
    if is_float8(dtype):
        x = np.asarray(x, dtype=np.float64)
        s = broadcast_param(np.asarray(scale, dtype=np.float64), x.shape, axis, block_size)
        f8 = FLOAT8_TYPES[DType(dtype)]
        return np.clip(x / s, -f8.max_value, f8.max_value).astype(np.float32).astype(f8.np_dtype)
    info = int_type(dtype, bits)
    x = np.asarray(x, dtype=np.float32)
    s = broadcast_param(np.asarray(scale, dtype=np.float64), x.shape, axis, block_size).astype(np.float32)
    z = broadcast_param(np.asarray(zero_point, dtype=np.float64), x.shape, axis, block_size)
    # QuantizeLinear divides in float32: ties must fall where onnxruntime's fall.
    ratio = np.asarray(x / s)
    if round_method == "half_even" and DType(dtype) in FLOAT32_EXACT:  # same codes, no float64 copies
        np.rint(ratio, out=ratio)
        ratio += z.astype(np.float32)
        return np.clip(ratio, info.qmin, info.qmax, out=ratio).astype(info.np_dtype)
    q = round_values(ratio.astype(np.float64), round_method) + z
    return np.clip(q, info.qmin, info.qmax).astype(info.np_dtype)


# Integer codes of each size widened to a type that holds the difference of two of them.
WIDENED = {1: np.int16, 2: np.int32}


def dequantize(
    q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int | None = None,
    block_size: int | None = None,
) -> np.ndarray:
    """Dequantize like ONNX DequantizeLinear: (q - zero_point) * scale, in float32."""
    q = np.asarray(q)
    s = broadcast_param(np.asarray(scale, dtype=np.float32), q.shape, axis, block_size)
    if q.dtype.name.startswith("float8"):
        return (q.astype(np.float32) * s).astype(np.float32)
    # q - zero_point exactly, in the narrowest integer type that holds it (int16 for 8-bit
    # codes: a quarter of int64's memory traffic on a 400 MB weight), then float32 as before
    wide = WIDENED.get(q.dtype.itemsize, np.int64) if np.issubdtype(q.dtype, np.integer) else np.int64
    z = broadcast_param(np.asarray(zero_point), q.shape, axis, block_size).astype(wide)
    out = (q.astype(wide) - z).astype(np.float32)
    out *= s
    return out


# Ranges beyond this come from masking sentinels (float min, -1e38): no integer grid can
# hold both them and the ordinary values, so such tensors stay float, and statistics past
# it (an input mean dragged there by one such value) are not used.
MAX_QUANTIZABLE_RANGE = 1e30
