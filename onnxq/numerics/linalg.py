"""The inverse Hessian's Cholesky factor GPTQ needs, without forming the inverse.

GPTQ wants the upper triangular U with H^-1 = U^T U (`cholesky(inv(H)).T`). With J the
exchange matrix (J = J^T = J^-1) and L the lower Cholesky factor of J H J:

    H^-1 = J (J H J)^-1 J = J L^-T L^-1 J = (J L^-1 J)^T (J L^-1 J),

and J L^-1 J is upper triangular with a positive diagonal, so it is U (the factor is
unique). That is one Cholesky (K^3 / 3 flops) and one triangular inverse (K^3 / 3, by
halves, in matrix products) where `inv` then `cholesky` cost 7 K^3 / 3: at K = 5632 (a
1.1B Llama's down projection) 120 against 420 GFLOP.
"""

from __future__ import annotations

import numpy as np

# Below this size a triangle is inverted directly: recursion overhead beats its saving.
DIRECT = 128


def inverse_cholesky_upper(h: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Upper triangular U with inv(h) = U^T U, for symmetric positive definite `h` (module
    doc), stored as `dtype` (computed in h's type: the one copy that reverses the axes
    also casts, where a cast after it cost GPTQ a second K x K copy per layer)."""
    lower = np.linalg.cholesky(h[::-1, ::-1])
    return np.ascontiguousarray(lower_triangular_inverse(lower)[::-1, ::-1], dtype=dtype)


def lower_triangular_inverse(lower: np.ndarray) -> np.ndarray:
    """inv(lower) for a lower triangular matrix, by halves:
    [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]."""
    n = lower.shape[0]
    if n <= DIRECT:
        return np.tril(np.linalg.inv(lower))
    k = n // 2
    a_inv = lower_triangular_inverse(lower[:k, :k])
    c_inv = lower_triangular_inverse(lower[k:, k:])
    out = np.zeros_like(lower)
    out[:k, :k], out[k:, k:] = a_inv, c_inv
    out[k:, :k] = -(c_inv @ (lower[k:, :k] @ a_inv))
    return out
