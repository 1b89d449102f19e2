"""AdaRound's soft rounding, shared by the layer-wise (`adaround.py`) and the block
(`block_fit.py`) optimisers: the rectified sigmoid h(V) = clip(sigmoid(V) (ZETA - GAMMA)
+ GAMMA, 0, 1) that chooses between the code below and the code above each weight, the
logits V that start it at a given h, and the gradient of the regulariser
sum(1 - |2h - 1|^beta) that drives every h to 0 or 1 (Nagel et al., ICML 2020)."""

from __future__ import annotations

import numpy as np

ZETA, GAMMA = 1.1, -0.1
SPAN = np.float32(ZETA - GAMMA)


def start_logits(h: np.ndarray) -> np.ndarray:
    """V (float32) with h(V) = h, h kept 1e-4 inside the sigmoid's range."""
    p = np.clip((h - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p)).astype(np.float32)


def rectified_sigmoid(v: np.ndarray, sig: np.ndarray | None = None,
                      soft: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sigmoid(V), h(V), where h's gradient passes), written into `sig` and `soft` when given."""
    sig = np.negative(v, out=sig)
    np.exp(sig, out=sig)
    sig += 1
    np.reciprocal(sig, out=sig)
    soft = np.multiply(sig, SPAN, out=soft)
    soft += np.float32(GAMMA)
    active = (soft > 0) & (soft < 1)  # the rectified sigmoid's gradient is 0 outside
    np.clip(soft, 0, 1, out=soft)
    return sig, soft, active


def regulariser_gradient(soft: np.ndarray, beta: float, weight: float, out: np.ndarray | None = None,
                         scratch: np.ndarray | None = None) -> np.ndarray:
    """d/dh of `weight` x sum(1 - |2h - 1|^beta) at h = `soft`, written into `out` (with
    `scratch` for 2h - 1) when given."""
    d = np.multiply(soft, 2, out=scratch)
    d -= 1
    out = np.abs(d, out=out)
    out **= np.float32(beta - 1)
    out *= np.float32(weight * 2 * beta)
    out *= np.sign(d, out=d)
    return out


def beta_at(step: int, steps: int, warm_start: float, start: float, end: float) -> float | None:
    """The regulariser's exponent at `step` of `steps`: None during the first `warm_start`
    share, then annealed from `start` to `end` (cosine)."""
    warm = int(warm_start * steps)
    if step < warm:
        return None
    rel = (step - warm) / max(steps - warm, 1)
    return end + 0.5 * (start - end) * (1 + np.cos(rel * np.pi))
