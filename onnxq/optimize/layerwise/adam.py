"""Adam (Kingma & Ba 2015) on numpy arrays, in place."""

from __future__ import annotations

import numpy as np


class Adam:
    """One Adam state per parameter array; `step(param, grad)` updates `param` in place."""

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.state: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

    def step(self, key: int, param: np.ndarray, grad: np.ndarray, scale: np.ndarray | None = None) -> None:
        """One step; `scale`: a per-element factor of the step (a non-uniform grid's spacing)."""
        m, v, t = self.state.get(key, (np.zeros_like(param), np.zeros_like(param), 0))
        t += 1
        m *= self.beta1
        m += (1 - self.beta1) * grad
        v *= self.beta2
        v += (1 - self.beta2) * grad * grad
        mhat = m / (1 - self.beta1 ** t)
        vhat = v / (1 - self.beta2 ** t)
        update = self.lr * mhat / (np.sqrt(vhat) + self.eps)
        param -= update if scale is None else update * scale
        self.state[key] = (m, v, t)
