"""The inverse Hessian's Cholesky factor GPTQ needs, without forming the inverse.

GPTQ wants the upper triangular U with H^-1 = U^T U (`cholesky(inv(H)).T`). With J the
exchange matrix (J = J^T = J^-1) and L the lower Cholesky factor of J H J:

    H^-1 = J (J H J)^-1 J = J L^-T L^-1 J = (J L^-1 J)^T (J L^-1 J),

and J L^-1 J is upper triangular with a positive diagonal, so it is U (the factor is
unique). That is one Cholesky (K^3 / 3 flops) and one triangular inverse (K^3 / 3, by
halves, in matrix products) where `inv` then `cholesky` cost 7 K^3 / 3: at K = 5632 (a
1.1B Llama's down projection) 120 against 420 GFLOP.

Both come from one recursion by halves that returns L^-1 alone: with J H J = [[A, B^T],
[B, C]], L11 = chol(A), L21 = B L11^-T, L22 = chol(C - L21 L21^T) and
L^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]], so L itself is never assembled and
nearly all the flops are matrix products, which run on every core in fixed row slices
(`_product`: the result does not depend on the core count). LAPACK's own factorisation
ran at a quarter of a product's rate here: K = 1536, one core, 128 ms against 72 ms
(2 cores); 30 of SmolLM2's down projections wait for it.
"""

from __future__ import annotations

import numpy as np

from onnxq.parallel import ordered_map

# Below this size a block is factored and inverted directly: recursion overhead beats its saving.
DIRECT = 64
# Rows of a product's left operand per task (`_product`); fixed, so results are the same on any core count.
PRODUCT_ROWS = 192


def inverse_cholesky_upper(h: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Upper triangular U with inv(h) = U^T U, for symmetric positive definite `h` (module
    doc), stored as `dtype` (computed in h's type: the one copy that reverses the axes
    also casts, where a cast after it cost GPTQ a second K x K copy per layer)."""
    inverse = inverse_cholesky_lower(h[::-1, ::-1])  # a view: no reversed K x K copy (254 MB at K = 5632)
    return np.ascontiguousarray(inverse[::-1, ::-1], dtype=dtype)


def inverse_cholesky_lower(h: np.ndarray) -> np.ndarray:
    """inv(L) for the lower Cholesky factor L of `h` (L L^T = h), by halves (module doc)."""
    n = h.shape[0]
    if n <= DIRECT:
        return np.tril(np.linalg.inv(np.linalg.cholesky(h)))
    k = n // 2
    a_inv = inverse_cholesky_lower(h[:k, :k])
    l21 = _product(h[k:, :k], a_inv.T)
    c_inv = inverse_cholesky_lower(h[k:, k:] - l21 @ l21.T)  # a symmetric product: numpy's syrk
    out = np.zeros_like(h)
    out[:k, :k], out[k:, k:] = a_inv, c_inv
    out[k:, :k] = -_product(c_inv, _product(l21, a_inv))
    return out


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b, `PRODUCT_ROWS` rows of `a` per task on every core (`ordered_map`)."""
    if len(a) < 2 * PRODUCT_ROWS:
        return a @ b
    cuts = [*range(0, len(a), PRODUCT_ROWS), len(a)]
    return np.concatenate(list(ordered_map(lambda r: a[r[0]:r[1]] @ b, list(zip(cuts[:-1], cuts[1:])))))
