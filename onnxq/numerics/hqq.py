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

from onnxq.numerics.qmath import IntType


@dataclass(frozen=True)
class HqqOptions:
    """iterations, lp norm p, initial beta and its growth kappa (the paper's defaults)."""

    iterations: int = 20
    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01


def _shrink(x: np.ndarray, beta: float, p: float) -> np.ndarray:
    """argmin_e |e|^p + beta/2 (e - x)^2, approximately: sign(x) max(|x| - |x|^(p-1)/beta, 0)."""
    a = np.abs(x)
    with np.errstate(divide="ignore"):
        return np.sign(x) * np.maximum(a - np.power(np.maximum(a, 1e-12), p - 1) / beta, 0.0)


def hqq_zero_points(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray, info: IntType,
                    options: HqqOptions = HqqOptions()) -> np.ndarray:
    """Optimised float zero point of each row of `blocks` [M, B] with scales [M] (module doc)."""
    w = np.asarray(blocks, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)[:, None]
    z = np.asarray(zero, dtype=np.float64)[:, None].copy()
    best_z, best_err = z.copy(), np.full(z.shape, np.inf)
    beta = options.beta
    for _ in range(options.iterations):
        q = np.clip(np.rint(w / s + z), info.qmin, info.qmax)
        r = w - s * (q - z)
        err = np.mean(np.abs(r), axis=1, keepdims=True)
        better = err < best_err
        best_z, best_err = np.where(better, z, best_z), np.where(better, err, best_err)
        e = _shrink(r, beta, options.p)
        z = np.mean(q - (w - e) / s, axis=1, keepdims=True)
        beta *= options.kappa
    q = np.clip(np.rint(w / s + z), info.qmin, info.qmax)
    err = np.mean(np.abs(w - s * (q - z)), axis=1, keepdims=True)
    return np.where(err < best_err, z, best_z)[:, 0]
