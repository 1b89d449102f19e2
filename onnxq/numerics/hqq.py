"""Half-quadratic quantization (HQQ, Badri & Shaji 2023) of weight blocks, without data.

For each block the scale stays at its min-max value and the zero point z is optimised to
minimise the lp error (p < 1) of the dequantized block, sum |w - s (q - z)|^p, which
forgives a few large errors (outliers) in exchange for many small ones. Half-quadratic
splitting alternates three closed-form steps, with beta growing by kappa each time:

    q  = clip(round(w / s + z), qmin, qmax)
    e  = shrink_p(w - s (q - z), beta)           generalised soft threshold
    z  = mean(q - (w - e) / s)                   over the block

and keeps the z of the lowest mean absolute error seen (the iteration is not monotone).
The zero point is a float; MatMulNBits stores it as one, QDQ rounds it to the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.errors import ConfigError
from onnxq.numerics.qmath import IntType


@dataclass(frozen=True)
class HqqOptions:
    """iterations of the half-quadratic solver, the lp norm p (< 1 forgives outliers), the
    initial beta and its growth kappa (the paper's defaults)."""

    iterations: int = 20
    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ConfigError(f"hqq: iterations must be at least 1, got {self.iterations}")
        if not 0 < self.p <= 1:
            raise ConfigError(f"hqq: p must be in (0, 1], got {self.p}")
        if self.beta <= 0 or self.kappa < 1:
            raise ConfigError(f"hqq: beta must be > 0 and kappa >= 1, got beta {self.beta}, kappa {self.kappa}")


def _shrink(x: np.ndarray, beta: float, p: float) -> np.ndarray:
    """argmin_e |e|^p + beta/2 (e - x)^2, approximately: sign(x) max(|x| - |x|^(p-1)/beta, 0)."""
    a = np.abs(x)
    with np.errstate(divide="ignore"):
        shrunk = np.power(np.maximum(a, a.dtype.type(1e-12)), a.dtype.type(p - 1))
        shrunk *= a.dtype.type(-1.0 / beta)
        shrunk += a
        np.maximum(shrunk, 0, out=shrunk)
        return np.copysign(shrunk, x, out=shrunk)


# Rows solved at once: the solver holds a few float64 copies of its chunk, so a whole LLM
# weight (an lm_head of 28M values) never becomes gigabytes of temporaries.
CHUNK_VALUES = 1 << 20


def hqq_zero_points(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray, info: IntType,
                    options: HqqOptions = HqqOptions()) -> np.ndarray:
    """Optimised float zero point of each row of `blocks` [M, B] with scales [M] (module
    doc), solved in chunks of rows (each row is independent)."""
    rows = max(1, CHUNK_VALUES // max(blocks.shape[1], 1))
    return np.concatenate([_solve(blocks[i:i + rows], scale[i:i + rows], zero[i:i + rows], info, options)
                           for i in range(0, len(blocks), rows)]) if len(blocks) else np.zeros(0)


def _solve(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray, info: IntType,
           options: HqqOptions) -> np.ndarray:
    """The solver on one chunk, in units of each row's scale: with u = w/s, the residual
    is r = s (u - q + z), so the steps need one power per value and no division. float32
    throughout (zero points live in [qmin, qmax]; 7 digits are plenty) for speed."""
    s = np.asarray(scale, dtype=np.float32)[:, None]
    u = np.asarray(blocks, dtype=np.float32) / s
    z = np.asarray(zero, dtype=np.float32)[:, None].copy()
    best_z, best_err = z.copy(), np.full(z.shape, np.inf)
    q, d = np.empty_like(u), np.empty_like(u)
    beta = options.beta

    def residual(z: np.ndarray) -> np.ndarray:
        """q (in place) and d = u - q + z = r / s (in place) for zero points z."""
        np.add(u, z, out=q)
        np.rint(q, out=q)
        np.clip(q, info.qmin, info.qmax, out=q)
        np.subtract(u, q, out=d)
        np.add(d, z, out=d)
        return d

    for _ in range(options.iterations):
        d = residual(z)
        err = np.mean(np.abs(d), axis=1, keepdims=True) * s  # mean |r|
        better = err < best_err
        best_z, best_err = np.where(better, z, best_z), np.where(better, err, best_err)
        # e / s with e = shrink(r): z <- mean(q - (w - e) / s) = mean(q - u + e / s)
        e = _shrink(d * s, beta, options.p) / s
        z = np.mean(q - u + e, axis=1, keepdims=True)
        beta *= options.kappa
    err = np.mean(np.abs(residual(z)), axis=1, keepdims=True) * s
    return np.where(err < best_err, z, best_z)[:, 0].astype(np.float64)
