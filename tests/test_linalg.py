"""GPTQ's inverse Cholesky factor (`numerics/linalg.py`) equals cholesky(inv(H)).T."""

import numpy as np
import pytest

from onnxq.numerics.linalg import inverse_cholesky_upper


@pytest.mark.parametrize("k", [1, 7, 128, 129, 576, 1000])
def test_factor_matches_the_inverse_then_cholesky(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((2 * k + 8, k)) * rng.gamma(1.0, 1.0, k)  # uneven channels, as activations are
    h = x.T @ x / len(x)
    h[np.diag_indices(k)] += 0.01 * np.mean(np.diag(h))  # GPTQ's damping
    u = inverse_cholesky_upper(h)
    reference = np.linalg.cholesky(np.linalg.inv(h)).T
    assert np.array_equal(u, np.triu(u)) and np.all(np.diag(u) > 0)
    np.testing.assert_allclose(u, reference, rtol=1e-7, atol=1e-9 * np.abs(reference).max())
    np.testing.assert_allclose(u.T @ u @ h, np.eye(k), atol=1e-8)


def test_a_float32_factor_is_the_float64_one_rounded():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 129))
    h = x.T @ x / len(x) + 0.01 * np.eye(129)
    u32 = inverse_cholesky_upper(h, np.float32)
    assert u32.dtype == np.float32 and u32.flags.c_contiguous
    assert np.array_equal(u32, inverse_cholesky_upper(h).astype(np.float32))


def test_the_factor_is_the_same_on_any_number_of_cores(monkeypatch):
    """The recursion's products run in fixed row slices on the pool: one core or two give
    the same bits (GPTQ's output must not depend on the machine)."""
    import onnxq.parallel as parallel

    rng = np.random.default_rng(11)
    x = rng.standard_normal((1500, 700)) * rng.gamma(1.0, 1.0, 700)
    h = x.T @ x / len(x) + 0.01 * np.eye(700)
    two = inverse_cholesky_upper(h)
    monkeypatch.setattr(parallel, "cpu_count", lambda: 1)
    assert np.array_equal(inverse_cholesky_upper(h), two)
