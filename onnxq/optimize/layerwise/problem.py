"""A layer's optimisation problem (`Problem`: its quadratic loss in the codes, from the
statistics of its inputs) and what an optimiser returns (`Solution`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize.layerwise.activation import Activation
from onnxq.optimize.layerwise.gram import Gram, position_stride
from onnxq.optimize.layerwise.grid import CodeGrid, code_grid
from onnxq.optimize.layerwise.layers import (
    Layer,
    to_channels,
    to_matrices,
)
from onnxq.optimize.layerwise.replay import Replay
from onnxq.optimize.layerwise.sampled import BIAS_DAMPING, ThroughActivation


@dataclass
class Problem:
    """One layer's reconstruction, in code units of its weight grid.

    Weights are [g, M, K] matrices (`layers.to_matrices`); `h` [g, K+1, K+1] and `t`
    [g, M, K+1] are `gram.Gram`'s H and T per position, with `damping` times the mean
    diagonal of H holding weights near their float values where the data says nothing;
    `energy` is the float output's mean square per output channel and position.
    Codes are relative to the zero point and lie on `grid` (`grid.py`).
    """

    w: np.ndarray  # float weights [g, M, K]
    bias: np.ndarray  # [g, M]
    scale: np.ndarray  # [g, M, 1]
    grid: CodeGrid  # the codes the weight type has
    nearest: np.ndarray  # codes of nearest rounding as emitted [g, M, K]
    h: np.ndarray
    t: np.ndarray
    energy: float
    has_bias: bool  # whether the algorithm may change the bias
    per_channel: bool  # one scale per output channel (else one for the tensor)
    through: ThroughActivation | None = None  # the loss through the activation after the layer

    @property
    def reference(self) -> float:
        """The mean square the loss is relative to: of the float output, or through an
        activation of what passes it (so the regulariser keeps its weight)."""
        if self.through is None:
            return self.energy
        return max(self.through.energy, 1e-6 * self.energy)

    @property
    def outputs(self) -> int:
        return self.w.shape[0] * self.w.shape[1]

    @functools.cached_property
    def _h32(self) -> np.ndarray:
        return self.h.astype(np.float32)

    @functools.cached_property
    def _t32(self) -> np.ndarray:
        return self.t.astype(np.float32)

    @functools.cached_property
    def _t32k(self) -> np.ndarray:
        return np.ascontiguousarray(self._t32[:, :, :-1])

    def full(self, weights: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """[g, M, K+1]: weights with the bias column."""
        return np.concatenate([weights, bias[..., None]], axis=2)

    def loss(self, weights: np.ndarray, bias: np.ndarray) -> float:
        """Mean squared output error per output channel and position (through the
        activation when `through`), relative to the float output's mean square."""
        v = self.full(weights, bias)
        if self.through is not None:  # on the sample alone: never below 0, so no step can game it
            return self.through.sampled_loss(v.astype(np.float32))
        value = (np.sum(v * (v @ self.h)) - 2.0 * np.sum(v * self.t)) / self.outputs + self.energy
        return float(value / self.energy) if self.energy > 0 else float(value)

    def linear_bias(self, weights: np.ndarray) -> np.ndarray:
        """The bias minimising the output error before any activation for `weights` (the
        least-squares mean correction)."""
        k = weights.shape[2]
        num = self.t[:, :, k] - np.einsum("gmk,gk->gm", weights, self.h[:, :k, k])
        return num / np.maximum(self.h[:, k, k][:, None], 1e-30)

    def best_bias(self, weights: np.ndarray) -> np.ndarray:
        """The bias minimising the loss for `weights`."""
        linear = self.linear_bias(weights)
        return linear if self.through is None else self.through.best_bias(weights, linear)

    def gradient(self, full: np.ndarray, step: int, tune_bias: bool,
                 with_loss: bool = False) -> tuple[np.ndarray, float | None]:
        """The loss's gradient in the weights [g, M, K] at float32 weights with the bias
        column `full` [g, M, K+1], in units of 2 / (outputs x reference) (the mean of
        (V x_q - W x_f) x_q^T over positions), and with `with_loss` the loss there (through
        an activation: on step `step`'s mini-batch alone, as `loss`). With `tune_bias` the
        bias column first moves to (toward, through an activation) its best, in place."""
        k = self.w.shape[2]
        if self.through is not None:
            correction, curvature, loss = self.through.correction(full, step)
            grad = full @ self._h32 - self._t32
            grad += correction
            if tune_bias:  # one damped Gauss-Newton step per channel
                full[:, :, k] -= grad[:, :, k] / (curvature + BIAS_DAMPING)
            return grad[:, :, :k], loss
        if tune_bias:  # the minimum over the bias: its gradient is the partial one there
            full[:, :, k] = self.linear_bias(full[:, :, :k])
        if not with_loss:
            grad = full @ self._h32[:, :, :k]
            grad -= self._t32k
            return grad, None
        vh = full @ self._h32
        loss = float(np.sum(full * (vh - 2 * self._t32))) * (1.0 / (self.outputs * max(self.energy, 1e-30))) + 1.0
        return (vh - self._t32)[:, :, :k], loss


@dataclass
class Solution:
    """What an optimiser returns: codes [g, M, K] relative to the zero point, and
    optionally new float weights, a new bias [g, M] and new scales (like `Problem.scale`)."""

    codes: np.ndarray
    weights: np.ndarray | None = None
    bias: np.ndarray | None = None
    scale: np.ndarray | None = None


Optimiser = Callable[[Problem, object], Solution]


def layer_statistics(layer: Layer, replay: Replay, wbar: np.ndarray, kernel: tuple[int, ...], xq: str, xf: str,
                cap: int, sample_cap: int = 0) -> Gram:
    gram = None
    for batch in replay.inputs(list(dict.fromkeys([xq, xf]))):
        if gram is None:
            stride = position_stride(layer.node, batch[xq], kernel, replay.samples, cap)
            gram = Gram.empty(wbar.shape[0], wbar.shape[2] - 1, kernel, stride, sample_cap, replay.samples)
        gram.update(layer.node, wbar, batch[xq], batch[xf])
    return gram


def build_problem(layer: Layer, qt: QuantizedTensor, gram: Gram, damping: float, full: np.ndarray,
             activation: Activation | None = None, batch: int = 0) -> Problem:
    """The layer's `Problem` from its statistics; `full`: its float weights with the bias
    column, [g, M, K+1]; `activation`: the one after the layer, when the loss runs
    through it (on the positions `gram` sampled, `batch` per step)."""
    wm, bias = full[:, :, :-1], full[:, :, -1]
    g, m, k = wm.shape
    scale, zp = to_channels(qt.scale, g, m), to_channels(qt.zero_point, g, m)
    positions = max(gram.positions, 1)
    h, c = gram.h / positions, gram.c / positions
    t = full @ c.transpose(0, 2, 1)
    energy = gram.energy / positions / (g * m)
    # Damping: + delta |V - W|^2 on the weight part, delta a share of H's mean diagonal.
    diag = np.einsum("gii->gi", h[:, :k, :k])
    delta = damping * np.maximum(diag.mean(axis=1), 1e-12)  # per group
    h[:, np.arange(k), np.arange(k)] += delta[:, None]
    t[:, :, :k] += delta[:, None, None] * wm
    energy += float(np.sum(delta[:, None, None] * wm * wm)) / (g * m)
    nearest = to_matrices(layer.node, qt.data.astype(np.float64)) - zp
    through = None
    if activation is not None and gram.kept_x:
        through = ThroughActivation.build(activation, *gram.sample(), batch)
    return Problem(wm, bias, scale, code_grid(layer.weight.spec, zp), nearest, h, t, energy,
                   layer.bias is not None, qt.axis is not None, through)
