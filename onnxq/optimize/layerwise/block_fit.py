"""Learn the rounding of a block's layers together, against the block's output error.

Layer-wise AdaRound minimises each layer's own output error. What reaches the model's
output is that error after the block's nonlinearities, its activations' rounding, its
residual branch and, at the tail, the global pooling that averages per-position errors
away: a block objective (BRECQ, Li et al., ICLR 2021) spends the rounding freedom where
the block's output feels it. Here every weight of the block's layers again chooses between
the codes below and above w / s (s: the scale the layer-wise pass chose), with AdaRound's
rectified sigmoid h(V) and its annealed regulariser, and Adam follows the gradient of

    |f_q(x_q) - f(x_f)|^2 / |f(x_f)|^2

through the emitted block (`block_ops.py`: the deployed rounding of every activation,
passed straight through where it does not saturate), on mini-batches of the samples the
block keeps. V starts from the layer-wise codes (h = `START` toward them): the block pass
refines a good rounding rather than starting over. The codes round h at 1/2 and are kept
only where the block's error on its samples drops below the layer-wise codes'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize.layerwise.adam import Adam
from onnxq.optimize.layerwise.block_ops import OPS
from onnxq.optimize.layerwise.blocks import Block
from onnxq.optimize.layerwise.grid import code_grid
from onnxq.optimize.layerwise.layers import Layer, from_matrices, to_channels, to_matrices
from onnxq.optimize.layerwise.soft_rounding import (
    SPAN,
    rectified_sigmoid,
    regulariser_gradient,
    start_logits,
)

# h of the layer-wise code at the start: the rectified sigmoid is then 2.2 logits from
# saturating, so a weight can still change its mind, while the block starts where the
# layer-wise pass left it.
START = 0.85


@dataclass
class Learnable:
    """One layer's rounding choice: codes `base` + h(v) `movable` (relative to the zero
    point, [g, M, K]) times `scale` [g, M, 1]; `codes` are the layer-wise ones."""

    layer: Layer
    weight: str  # the emitted graph's name of the weight the layer reads
    shape: tuple[int, ...]
    scale: np.ndarray
    base: np.ndarray
    movable: np.ndarray
    v: np.ndarray
    codes: np.ndarray

    @classmethod
    def of(cls, layer: Layer, qnode: ir.Node, qt: QuantizedTensor) -> Learnable:
        """The layer's choice around its codes `qt` (integer weights: `blocks.py` refuses float8)."""
        w = layer.weight_array()
        wm = to_matrices(layer.node, w.astype(np.float64))
        g, m, _ = wm.shape
        zp = to_channels(qt.zero_point, g, m)
        grid = code_grid(layer.weight.spec, zp)
        scale = to_channels(qt.scale, g, m)
        codes = to_matrices(layer.node, qt.data.astype(np.float64)) - zp
        down, free = grid.brackets(wm / scale)
        free &= (codes == down) | (codes == down + 1)
        up = np.where(free, codes - down, 0.0)
        return cls(layer, qnode.inputs[1].name, tuple(w.shape), scale.astype(np.float32),
                   np.where(free, down, codes).astype(np.float32), free.astype(np.float32),
                   start_logits(np.where(up > 0, START, 1 - START)), codes)

    def soft(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The weights at h(v) in the layer's stored layout, h, and where h's gradient passes."""
        sig, h, active = rectified_sigmoid(self.v)
        w = (self.base + self.movable * h) * self.scale
        return from_matrices(self.layer.node, w, self.shape), h, sig * (1 - sig) * active

    def hard(self, codes: np.ndarray | None = None) -> np.ndarray:
        """The weights of `codes` (default: h rounded at 1/2) in the stored layout."""
        codes = self.learned_codes() if codes is None else codes
        return from_matrices(self.layer.node, (codes * self.scale).astype(np.float32), self.shape)

    def learned_codes(self) -> np.ndarray:
        return self.base + self.movable * (self.v >= 0)


class BlockGraph:
    """The block's nodes, run forward and backward in numpy with the weights given."""

    def __init__(self, block: Block, constants: Mapping[str, np.ndarray], learned: set[str]) -> None:
        """`learned`: the weights every run is given (their DequantizeLinear is not run);
        a name in `constants` replaces what its node would compute (a re-solved bias)."""
        self.block = block
        self.learned = learned
        self.values = dict(constants)
        self.nodes: list[ir.Node] = []
        requires = set(self.learned) | {block.start}
        for node in block.nodes:
            names = [v.name if v is not None else "" for v in node.inputs]
            if node.outputs[0].name in self.learned or node.outputs[0].name in self.values:
                continue  # a learned weight or a given bias replaces its DequantizeLinear
            if all(not n or n in self.values for n in names):  # constant: fold once
                self.values[node.outputs[0].name] = OPS[node.op_type].forward(node, self._ins(node, self.values))[0]
                continue
            self.nodes.append(node)
            if any(n in requires for n in names):
                requires.add(node.outputs[0].name)
        self.requires = requires

    @staticmethod
    def _ins(node: ir.Node, values: Mapping[str, np.ndarray]) -> list[np.ndarray | None]:
        return [values.get(v.name) if v is not None and v.name else None for v in node.inputs]

    def forward(self, x: np.ndarray, weights: Mapping[str, np.ndarray], keep: bool) -> tuple[np.ndarray, list]:
        values = {**self.values, **weights, self.block.start: x.astype(np.float32)}
        tape = []
        for node in self.nodes:
            out, cache = OPS[node.op_type].forward(node, self._ins(node, values))
            values[node.outputs[0].name] = out
            if keep:
                tape.append((node, cache))
        return values[self.block.end], tape

    def values_of(self, x: np.ndarray, weights: Mapping[str, np.ndarray], name: str, batch: int) -> np.ndarray:
        """Tensor `name` of the block for every sample of `x`, `batch` samples at a time."""
        parts = []
        for i in range(0, len(x), batch):
            values = {**self.values, **weights, self.block.start: x[i:i + batch].astype(np.float32)}
            for node in self.nodes:
                values[node.outputs[0].name] = OPS[node.op_type].forward(node, self._ins(node, values))[0]
                if node.outputs[0].name == name:
                    break
            parts.append(values[name] if name != self.block.start else x[i:i + batch].astype(np.float32))
        return np.concatenate(parts)

    def backward(self, tape: list, d_end: np.ndarray) -> dict[str, np.ndarray]:
        grads = {self.block.end: d_end}
        for node, cache in reversed(tape):
            dy = grads.pop(node.outputs[0].name, None)
            if dy is None:
                continue
            wanted = [v is not None and v.name in self.requires for v in node.inputs]
            for value, g in zip(node.inputs, OPS[node.op_type].backward(node, cache, dy, wanted)):
                if g is None or value is None:
                    continue
                grads[value.name] = grads[value.name] + g if value.name in grads else g
        return {name: grads[name] for name in self.learned if name in grads}


@dataclass(frozen=True)
class Rounding:
    """The optimiser's schedule: steps, Adam's step size, the regulariser's weight and its
    exponent per step (None while it is off)."""

    steps: int
    learning_rate: float
    reg_param: float
    beta: Callable[[int], float | None]


@dataclass
class Fit:
    before: float  # the block's relative output error with the layer-wise codes
    after: float  # with the learned codes
    codes: dict[str, np.ndarray]  # layer name -> learned codes (relative to the zero point)


def _batches(samples: int, batch: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    order: list[int] = []
    while len(order) < steps * batch:
        order.extend(rng.permutation(samples).tolist())
    return [np.array(order[i * batch:(i + 1) * batch]) for i in range(steps)]


def block_error(graph: BlockGraph, x: np.ndarray, target: np.ndarray, weights: Mapping[str, np.ndarray],
                batch: int) -> float:
    """Relative squared error of the block's output over every kept sample."""
    num = den = 0.0
    for i in range(0, len(x), batch):
        out, _ = graph.forward(x[i:i + batch], weights, keep=False)
        t = target[i:i + batch]
        num += float(np.sum(np.square(out - t, dtype=np.float64)))
        den += float(np.sum(np.square(t, dtype=np.float64)))
    return num / max(den, 1e-30)


def fit_block(graph: BlockGraph, learnables: list[Learnable], x: np.ndarray, target: np.ndarray,
              schedule: Rounding, positions: int) -> Fit:
    """Learn the rounding of the block of `graph` (module doc) on samples `x` (block
    start) and `target` (float block output); `positions`: output positions per step."""
    per_sample = max(math.prod(a.shape[2:]) if a.ndim > 2 else 1 for a in (x, target))
    batch = int(min(len(x), max(1, positions // max(per_sample, 1))))
    energy = float(np.mean(np.square(target, dtype=np.float64))) or 1e-30
    start = {item.weight: item.hard(item.codes) for item in learnables}
    before = block_error(graph, x, target, start, batch)
    adam = Adam(schedule.learning_rate)
    for step, rows in enumerate(_batches(len(x), batch, schedule.steps)):
        soft = {item.weight: item.soft() for item in learnables}
        out, tape = graph.forward(x[rows], {k: v[0] for k, v in soft.items()}, keep=True)
        e = out - target[rows]
        grads = graph.backward(tape, e * np.float32(2.0 / (e.size * energy)))
        beta = schedule.beta(step)
        for i, item in enumerate(learnables):
            _, h, slope = soft[item.weight]
            g = to_matrices(item.layer.node, grads.get(item.weight, np.zeros(item.shape, np.float32)))
            g = g * item.scale * item.movable
            if beta is not None and schedule.reg_param:
                g -= regulariser_gradient(h, beta, schedule.reg_param) * item.movable
            adam.step(i, item.v, (g * slope * SPAN).astype(np.float32))
    learned = {item.weight: item.hard() for item in learnables}
    after = block_error(graph, x, target, learned, batch)
    return Fit(before, after, {item.layer.name: item.learned_codes() for item in learnables})
