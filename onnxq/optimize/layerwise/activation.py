"""The activation after a layer, as a function and its derivative, for a loss through it.

AdaRound's paper and AMCT minimise the error of the layer followed by its activation:
after a ReLU6 an error on an output the activation clips away costs nothing, so the
rounding can spend its freedom on the outputs that reach the next layer (MobileNet-v1
int4 per-channel weights: most pointwise outputs are negative before their ReLU6).

`following(graph, node, shape, spatial)` returns the `Activation` that is the layer output's only
consumer (none when the output feeds anything else too, or is a graph output: its error
then counts in full). Each op type is one entry of `ACTIVATIONS`, built from the node.
Values are laid out as the layer's outputs [g, M, P] (`layers.to_matrices`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.graph.fold import constant_array

Array = np.ndarray


@dataclass(frozen=True)
class Activation:
    """f and f' of one activation node, elementwise on float32 arrays [g, M, P]."""

    op_type: str
    forward: Callable[[Array], Array]
    derivative: Callable[[Array], Array]


def _constant(node: ir.Node, index: int) -> Array | None:
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    return constant_array(node.inputs[index])


def _relu(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation:
    return Activation("Relu", lambda y: np.maximum(y, 0), lambda y: (y > 0).astype(np.float32))


def _clip(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation | None:
    bounds = layout.clip_bounds(node)
    if bounds is None:
        return None  # a bound computed at run time
    lo, hi = bounds
    return Activation("Clip", lambda y: np.clip(y, lo, hi),
                      lambda y: ((y > lo) & (y < hi)).astype(np.float32))


def _leaky(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation:
    alpha = np.float32(layout.attr(node, "alpha", 0.01))
    return Activation("LeakyRelu", lambda y: np.where(y > 0, y, alpha * y),
                      lambda y: np.where(y > 0, np.float32(1), alpha))


def _prelu(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation | None:
    slope = _constant(node, 1)
    if slope is None:
        return None
    # Broadcast from the right: only the channel axis (spatial + 1 from the end) may vary.
    channel = spatial
    if any(d != 1 for i, d in enumerate(reversed(slope.shape)) if i != channel):
        return None  # a slope per position
    if slope.size not in (1, shape[0] * shape[1]):
        return None
    s = slope.astype(np.float32).reshape(-1)
    s = s.reshape(1, 1, 1) if s.size == 1 else s.reshape(shape[0], shape[1], 1)
    return Activation("PRelu", lambda y: np.where(y > 0, y, s * y),
                      lambda y: np.where(y > 0, np.float32(1), s))


def _sigmoid_of(y: Array) -> Array:
    return 1 / (1 + np.exp(-np.clip(y, -60, 60)))


def _sigmoid(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation:
    def derivative(y: Array) -> Array:
        s = _sigmoid_of(y)
        return s * (1 - s)
    return Activation("Sigmoid", _sigmoid_of, derivative)


def _tanh(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation:
    return Activation("Tanh", np.tanh, lambda y: 1 - np.tanh(y) ** 2)


def _erf(x: Array) -> Array:
    """erf to 1.5e-7 (Abramowitz and Stegun 7.1.26); numpy has none."""
    t = 1 / (1 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1 - poly * np.exp(-x * x))


def _gelu(node: ir.Node, shape: tuple[int, int], spatial: int) -> Activation:
    approximate = layout.attr(node, "approximate", "none")
    approximate = approximate.decode() if isinstance(approximate, bytes) else str(approximate)
    c = np.float32(math.sqrt(2 / math.pi))
    if approximate == "tanh":
        def forward(y: Array) -> Array:
            return 0.5 * y * (1 + np.tanh(c * (y + 0.044715 * y ** 3)))

        def derivative(y: Array) -> Array:
            th = np.tanh(c * (y + 0.044715 * y ** 3))
            return 0.5 * (1 + th) + 0.5 * y * (1 - th ** 2) * c * (1 + 3 * 0.044715 * y ** 2)
    else:
        def forward(y: Array) -> Array:
            return 0.5 * y * (1 + _erf(y / np.float32(math.sqrt(2))))

        def derivative(y: Array) -> Array:
            return 0.5 * (1 + _erf(y / np.float32(math.sqrt(2)))) + y * np.exp(-0.5 * y * y) * (c / 2)
    return Activation("Gelu", forward, derivative)


ACTIVATIONS: dict[str, Callable[[ir.Node, tuple[int, int], int], Activation | None]] = {
    "Relu": _relu,
    "Clip": _clip,
    "LeakyRelu": _leaky,
    "PRelu": _prelu,
    "Sigmoid": _sigmoid,
    "Tanh": _tanh,
    "Gelu": _gelu,
}


def following(graph: ir.Graph, node: ir.Node, shape: tuple[int, int], spatial: int = 0) -> Activation | None:
    """The activation that alone reads `node`'s output, or None; `shape`: (groups, outputs
    per group) of the layer's weight matrices; `spatial`: axes after the channel axis in
    the output (a convolution's spatial axes; 0 when channels are last)."""
    out = node.outputs[0]
    uses = list(out.uses())
    if len(uses) != 1 or out in graph.outputs:
        return None
    consumer, index = uses[0]
    make = ACTIVATIONS.get(consumer.op_type)
    if make is None or index != 0 or consumer.domain not in ("", "ai.onnx"):
        return None
    return make(consumer, shape, spatial)
