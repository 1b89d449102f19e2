"""Reference arithmetic of the extended QDQ format (`onnxq.runtime` runs it in
onnxruntime through onnxruntime-extensions): what stock QuantizeLinear/DequantizeLinear
cannot express.

- `fake_quantize`: quantize-dequantize onto any integer grid [qmin, qmax] (2..32 bits,
  int32/uint32 included) with a chosen rounding mode, per tensor or per channel.
- `block_fake_quantize`: block floating point with one shared power-of-two exponent per
  block along an axis: OCP Microscaling MXINT8, MXFP8 (e4m3, e5m2), MXFP6 (e3m2, e2m3),
  MXFP4 (e2m1), blocks of 32; and BFP16 (8-bit sign-magnitude mantissas, blocks of 8).

Defined edge cases: NaN stays NaN; +-Inf saturates to the grid's ends in `fake_quantize`;
in a block format a block holding NaN or Inf becomes all NaN (its shared exponent has no
value); an all-zero block stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.config.spec import RoundMethod
from onnxq.numerics.qmath import round_values

ROUND_MODES = tuple(m.value for m in RoundMethod)  # rounding as `qmath.round_values` does it


def _along(param: np.ndarray, ndim: int, axis: int | None) -> np.ndarray:
    param = np.asarray(param, dtype=np.float64)
    if param.size == 1 or axis is None:
        return param.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = param.size
    return param.reshape(shape)


def fake_quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, qmin: int, qmax: int,
                  round_mode: str = "half_even", axis: int | None = None) -> np.ndarray:
    """(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale, in float32,
    computed in float64 so 32-bit grids are exact."""
    x = np.asarray(x, dtype=np.float64)
    s, z = _along(scale, x.ndim, axis), _along(zero_point, x.ndim, axis)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(round_values(x / s, round_mode) + z, qmin, qmax)
    return ((q - z) * s).astype(np.float32)


@dataclass(frozen=True)
class BlockFormat:
    """Elements of a shared-exponent block: a float type (exponent and mantissa bits, its
    largest normal) or, with `ebits` 0, signed integers of `mbits` magnitude bits."""

    name: str
    ebits: int
    mbits: int
    max_normal: float
    block_size: int

    @property
    def emax(self) -> int:
        """Exponent of the largest element: the shared exponent is the block's minus it."""
        return 0 if self.ebits == 0 else int(np.floor(np.log2(self.max_normal)))


BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("mxint8", 0, 6, 127 / 64, 32),  # 1.6 fixed point, implicit scale 2^-6
    BlockFormat("mxfp8_e4m3", 4, 3, 448.0, 32),
    BlockFormat("mxfp8_e5m2", 5, 2, 57344.0, 32),
    BlockFormat("mxfp6_e3m2", 3, 2, 28.0, 32),
    BlockFormat("mxfp6_e2m3", 2, 3, 7.5, 32),
    BlockFormat("mxfp4_e2m1", 2, 1, 6.0, 32),
    BlockFormat("bfp16", 0, 7, 127 / 64, 8),  # 8-bit sign-magnitude mantissas
)}


def _elements(v: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """`v` (already divided by the shared scale) rounded half to even onto the element
    grid, saturating at its largest value."""
    if fmt.ebits == 0:
        step = 2.0 ** -fmt.mbits
        return np.clip(np.rint(v / step), -(2 ** (fmt.mbits + 1) - 1), 2 ** (fmt.mbits + 1) - 1) * step
    bias = 2 ** (fmt.ebits - 1) - 1
    a = np.abs(v)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = 2.0 ** (np.maximum(e, 1 - bias) - fmt.mbits)  # below the normals: subnormal steps
    return np.sign(v) * np.minimum(np.rint(a / step) * step, fmt.max_normal)


def block_fake_quantize(x: np.ndarray, fmt: str | BlockFormat, axis: int = -1,
                        block_size: int | None = None) -> np.ndarray:
    """Quantize-dequantize `x` in block format `fmt` along `axis` (module doc): each block
    of `block_size` (default: the format's) shares the exponent 2^(floor(log2(max|x|)) -
    emax), clamped to E8M0's [-127, 127]; the last block is zero-padded."""
    fmt = BLOCK_FORMATS[fmt] if isinstance(fmt, str) else fmt
    block = block_size or fmt.block_size
    x = np.asarray(x, dtype=np.float32)
    moved = np.moveaxis(x, axis, -1).astype(np.float64)
    length = moved.shape[-1]
    pad = -length % block
    padded = np.concatenate([moved, np.zeros((*moved.shape[:-1], pad))], axis=-1) if pad else moved
    blocks = padded.reshape(*padded.shape[:-1], -1, block)
    finite = np.isfinite(blocks).all(axis=-1, keepdims=True)
    amax = np.max(np.abs(np.where(np.isfinite(blocks), blocks, 0.0)), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - fmt.emax, -127)
    scale = 2.0 ** np.clip(exp, -127, 127)
    out = np.where(finite, _elements(np.where(finite, blocks, 0.0) / scale, fmt) * scale, np.nan)
    out = out.reshape(padded.shape)[..., :length]
    return np.moveaxis(out, -1, axis).astype(np.float32)
