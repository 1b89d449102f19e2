"""The layer's error through its activation: exact statistics plus a sampled correction.

With an activation f after the layer (`activation.py`) the error is no longer quadratic
in the weights, so the input statistics of `gram.py` alone do not give it. Per position,

    (f(y_q) - f(y_f))^2 = (y_q - y_f)^2 + [(f(y_q) - f(y_f))^2 - (y_q - y_f)^2],

and the first term summed over every position is the exact quadratic loss of the Gram
statistics. Only the bracket, which is zero wherever the activation is the identity
(a ReLU's positive side, inside a Clip's bounds), is estimated from positions the Gram
pass samples (quantized input patches x_q and float outputs y_f). This control variate
keeps the exactness of the statistics where the activation passes values through and
adds what its clipping forgives: the sampled loss alone (no exact part) lost 0.6 dB of
output SQNR on MobileNet-v1 int4 to sampling noise.

Each optimisation step estimates the bracket's gradient on one mini-batch of `batch`
positions, in a fixed shuffled order (deterministic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from onnxq.optimize.layerwise.activation import Activation

# Gauss-Newton steps per channel for the bias, and their damping (Levenberg-Marquardt:
# where the activation clips a channel's every sample its curvature is 0).
BIAS_ITERATIONS = 8
BIAS_DAMPING = 0.1


@dataclass
class ThroughActivation:
    """Sampled positions of one layer and the activation after it."""

    activation: Activation
    x: np.ndarray  # quantized input patches with a row of ones [g, K+1, P], float32, shuffled
    y: np.ndarray  # float output before the activation [g, M, P], float32
    target: np.ndarray  # f(y)
    batch: int

    @classmethod
    def build(cls, activation: Activation, x: np.ndarray, y: np.ndarray, batch: int) -> ThroughActivation:
        order = np.random.default_rng(0).permutation(x.shape[2])
        x = np.ascontiguousarray(x[:, :, order], dtype=np.float32)
        y = np.ascontiguousarray(y[:, :, order], dtype=np.float32)
        return cls(activation, x, y, activation.forward(y).astype(np.float32), max(1, min(batch, x.shape[2])))

    @functools.cached_property
    def energy(self) -> float:
        """The mean square of the activation's float output per output and position."""
        return float(np.mean(np.square(self.target, dtype=np.float64)))

    @property
    def positions(self) -> int:
        return self.x.shape[2]

    def _window(self, step: int | None) -> slice:
        if step is None:
            return slice(None)
        start = (step * self.batch) % self.positions
        return slice(start, start + self.batch)

    def sampled_loss(self, full: np.ndarray) -> float:
        """The error after the activation on the sample alone, relative to its mean square.
        Never below 0, unlike the loss the optimisers follow (exact part plus sampled
        bracket), which can be where the sample's clipped positions outweigh theirs in the
        statistics: a step that exploits that must not pass for better."""
        e = self.activation.forward(full @ self.x) - self.target
        return float(np.mean(np.square(e, dtype=np.float64))) / max(self.energy, 1e-30)

    def correction(self, full: np.ndarray, step: int | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """The bracket's mean over the positions of `step`'s mini-batch (all with None) for
        float32 weights with the bias column `full` [g, M, K+1]: its gradient / 2 [g, M, K+1],
        the mean squared activation slope per channel [g, M] (the bias's curvature / 2),
        and the batch's error after the activation alone, relative (as `sampled_loss`)."""
        window = self._window(step)
        x = self.x[:, :, window]
        residual, curvature, e_act = self._terms(full @ x, window)
        grad = (residual @ x.transpose(0, 2, 1)) * np.float32(1.0 / x.shape[2])
        value = float(np.mean(np.square(e_act, dtype=np.float64))) / max(self.energy, 1e-30)
        return grad, curvature, value

    def _terms(self, yq: np.ndarray, window: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For quantized outputs `yq` of the positions `window`: the bracket's residual
        f'(y_q) e_act - e_lin per position, the mean squared slope per channel and e_act."""
        e_act = self.activation.forward(yq) - self.target[:, :, window]
        slope = self.activation.derivative(yq)
        residual = e_act * slope - (yq - self.y[:, :, window])
        return residual, np.sum(slope * slope, axis=2) * np.float32(1.0 / yq.shape[2]), e_act

    def best_bias(self, weights: np.ndarray, linear: np.ndarray) -> np.ndarray:
        """The bias [g, M] of least loss for `weights` [g, M, K], from `linear`, the best
        bias of the exact quadratic part: Gauss-Newton per channel on every sample (the
        weights' output is computed once; only the bias moves)."""
        k = weights.shape[2]
        z = weights.astype(np.float32) @ self.x[:, :k]
        b = linear.astype(np.float32)
        for _ in range(BIAS_ITERATIONS):
            residual, curvature, _ = self._terms(z + b[..., None], slice(None))
            # d/db of the exact part / 2 is (b - linear) per position; of the bracket, its mean residual
            b -= (b - linear + residual.mean(axis=2)) / (curvature + BIAS_DAMPING)
        return b.astype(np.float64)
