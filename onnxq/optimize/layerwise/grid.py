"""The codes a layer's weights may take, in units of the weight scale: what rounding to
nearest and AdaRound's up-or-down choice mean on each weight type.

Integer types (int2..int8, 7-bit and narrowed ones) have one code per integer in
[lo, hi] (relative to the zero point); float8 types (E4M3FN, E5M2) have the format's
finite values, spaced 2^-mantissa_bits of their binade apart, so a code's neighbours are
the next float8 values, not code +- 1. Everything that learns or searches codes
(AdaRound, AdaQuant, the scale search) asks the grid, so one code path serves both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from onnxq.config.spec import DType, QuantizationSpec
from onnxq.numerics.qmath import FLOAT8_TYPES, Float8Type, int_type, is_float8


@dataclass(frozen=True)
class IntegerGrid:
    """Integer codes in [lo, hi] (arrays broadcasting against the weights)."""

    lo: np.ndarray
    hi: np.ndarray

    def round(self, u: np.ndarray) -> np.ndarray:
        """The nearest codes to `u` (ties to even, as QuantizeLinear), saturated."""
        return np.clip(np.rint(u), self.lo, self.hi).astype(np.asarray(u).dtype, copy=False)

    def unsaturated(self, u: np.ndarray) -> np.ndarray:
        """Where rounding `u` does not saturate (the straight-through gradient passes)."""
        rounded = np.rint(u)
        return (rounded >= self.lo) & (rounded <= self.hi)

    def brackets(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The codes just below (or at) and above `u`, and whether both are on the grid."""
        down = np.floor(u)
        return down, (down >= self.lo) & (down + 1 <= self.hi)

    def up(self, down: np.ndarray) -> np.ndarray:
        """The code after `down`."""
        return down + 1

    def step(self, u: np.ndarray) -> None:
        """The spacing of the codes around `u`: None, one everywhere."""
        return None

    def store(self, codes: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return np.rint(codes).astype(dtype)


@dataclass(frozen=True)
class FloatGrid:
    """The finite values of a float8 type, saturating at +-max_value."""

    f8: Float8Type

    @functools.cached_property
    def values(self) -> np.ndarray:
        """Every finite value of the type, ascending, -0 folded into 0."""
        every = np.arange(256, dtype=np.uint8).view(self.f8.np_dtype).astype(np.float64)
        return np.unique(every[np.isfinite(every)]) + 0.0  # + 0.0: one zero, positive

    @property
    def lo(self) -> float:
        return -self.f8.max_value

    @property
    def hi(self) -> float:
        return self.f8.max_value

    def round(self, u: np.ndarray) -> np.ndarray:
        """The nearest float8 values to `u` (ties to even mantissa), saturated."""
        clipped = np.clip(np.asarray(u, dtype=np.float32), self.lo, self.hi)
        return clipped.astype(self.f8.np_dtype).astype(np.asarray(u).dtype)

    def unsaturated(self, u: np.ndarray) -> np.ndarray:
        """Where rounding `u` does not saturate (the straight-through gradient passes):
        up to half the top gap beyond +-max, as integer codes up to half a step."""
        return np.abs(u) <= self.hi + 0.5 * (self.values[-1] - self.values[-2])

    def brackets(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The value just below (or at) `u`, and whether a value follows it: a weight
        at or beyond +max, or below -max, has no choice to learn (one at -max has: -max or
        the value after it)."""
        at = np.searchsorted(self.values, u, side="right") - 1
        free = (at >= 0) & (at < self.values.size - 1)
        return self.values[np.clip(at, 0, self.values.size - 1)], free

    def up(self, down: np.ndarray) -> np.ndarray:
        """The value after `down` (itself at +max)."""
        at = np.searchsorted(self.values, down, side="right")
        return self.values[np.minimum(at, self.values.size - 1)]

    def step(self, u: np.ndarray) -> np.ndarray:
        """The gap between the float8 values around each `u` (at +-max, the top gap)."""
        down, _ = self.brackets(np.clip(u, self.lo, self.hi))
        gap = self.up(down) - down
        return np.where(gap > 0, gap, self.values[-1] - self.values[-2])

    def store(self, codes: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return self.round(codes).astype(dtype)


CodeGrid = IntegerGrid | FloatGrid


def code_grid(spec: QuantizationSpec, zero_point: np.ndarray) -> CodeGrid:
    """The grid of a weight quantized by `spec` with `zero_point` (per channel, [g, M, 1])."""
    if is_float8(spec.dtype):
        return FloatGrid(FLOAT8_TYPES[DType(spec.dtype)])
    info = int_type(spec.dtype, spec.bits)
    return IntegerGrid(info.qmin - zero_point, info.qmax - zero_point)
