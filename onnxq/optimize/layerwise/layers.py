"""The layers layer-wise reconstruction can optimise, and their weights as matrices.

A layer's weight is viewed as per-group matrices W [g, M, K] (M outputs and K inputs per
group) so that its output is W @ x for the input patches x [g, K, P] (`gram.patches`):

    Conv   W [Mall, C/g, *kernel]  -> [g, Mall/g, C/g * prod(kernel)]   (channel-major taps)
    Gemm   B [K, N] or [N, K] (transB)  -> [1, N, K]
    MatMul B [K, N] (2-D)           -> [1, N, K]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.graph.edit import set_constant
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import is_float8, is_integer
from onnxq.plan import Kind, QuantPlan, TensorPlan

OP_TYPES = ("Conv", "Gemm", "MatMul")


@dataclass
class Layer:
    """One layer to optimise: its node in the float model and its weight's plan.

    bias: (node holding the bias, input index) or None when the layer has none that an
    algorithm may change (a MatMul, a Conv without one).
    """

    node: ir.Node
    weight: TensorPlan
    bias: tuple[ir.Node, int] | None

    @property
    def name(self) -> str:
        return self.node.name

    def weight_array(self) -> np.ndarray:
        return constant_array(self.node.inputs[1])

    def bias_array(self) -> np.ndarray:
        """The bias per output channel (zeros without one; Gemm's beta applied)."""
        w = self.weight_array()
        channels = layout.out_channels(self.node, w.shape)
        if self.bias is None:
            return np.zeros(channels)
        holder, index = self.bias
        value = holder.inputs[index] if index < len(holder.inputs) else None
        b = constant_array(value) if value is not None else None
        if b is None:
            return np.zeros(channels)
        return self.beta() * np.broadcast_to(b.astype(np.float64).reshape(-1), (channels,))

    def set_bias(self, graph: ir.Graph, values: np.ndarray) -> None:
        """Make the bias per output channel `values` (Gemm's beta undone, the stored shape
        and type kept); the layer must have one (`bias`)."""
        holder, index = self.bias
        old = constant_array(holder.inputs[index])
        new = (values / self.beta()).reshape(old.shape).astype(old.dtype)
        set_constant(graph, holder, index, new, f"{self.node.name}_bias")

    def beta(self) -> float:
        """Gemm's beta (1 for other layers): the stored bias times it is the bias added."""
        return layout.beta(self.node)


def to_matrices(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """The weight as [g, M, K] (see module doc)."""
    if node.op_type == "Conv":
        g = layout.groups(node)
        return w.reshape(g, w.shape[0] // g, -1)
    return layout.matrix_kn(node, w).T[None]


def from_matrices(node: ir.Node, m: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`to_matrices` undone: a weight of `shape`."""
    if node.op_type == "Conv":
        return m.reshape(shape)
    kn = m[0].T
    return kn.T if node.op_type == "Gemm" and layout.gemm_transposes(node)[1] else kn


def to_channels(per_channel: np.ndarray, g: int, rows: int) -> np.ndarray:
    """A per-output-channel (or scalar) parameter laid out as [g, M, 1]."""
    per_channel = np.asarray(per_channel, dtype=np.float64)
    if per_channel.size == 1:
        return np.full((g, rows, 1), float(per_channel.reshape(-1)[0]))
    return per_channel.reshape(g, rows, 1)


def _refusal(node: ir.Node, tensor: TensorPlan | None, w: np.ndarray | None) -> str | None:
    """Why `node` cannot be optimised, or None."""
    if tensor is None or tensor.kind is not Kind.WEIGHT or w is None:
        return "weight not quantized as a constant"
    if not (is_integer(tensor.spec.dtype) or is_float8(tensor.spec.dtype)):
        return f"weight type {tensor.spec.dtype} has no rounding to learn"
    if tensor.block_size:
        return "per-group weights are not supported yet"
    if len(node.inputs[1].uses()) > 1:
        return "weight shared with other nodes"
    if node.op_type == "MatMul" and w.ndim != 2:
        return "batched MatMul weight"
    if node.op_type == "Gemm" and layout.gemm_transposes(node)[0]:
        return "Gemm with transA"
    if node.op_type == "Conv" and w.ndim not in (3, 4, 5):
        return f"{w.ndim - 2}-D convolution"
    return None


def _bias_of(node: ir.Node, w: np.ndarray) -> tuple[ir.Node, int] | None:
    """Where the layer's bias is, when an algorithm may change it: a Conv's or Gemm's own
    constant bias input (a MatMul's bias, if any, is a later Add: it cancels out of the
    error and stays as it is)."""
    if node.op_type == "MatMul" or len(node.inputs) < 3 or node.inputs[2] is None:
        return None
    b = constant_array(node.inputs[2])
    if b is None or len(node.inputs[2].uses()) > 1 or b.size != layout.out_channels(node, w.shape):
        return None
    return node, 2


def find_layers(graph: ir.Graph, plan: QuantPlan, op_types: tuple[str, ...],
                skip: tuple[str, ...], named: tuple[str, ...] = ()) -> tuple[list[Layer], dict[str, str]]:
    """The quantized layers to optimise, in graph order, and why others are not: those of
    `op_types` and those `named` (of any type in OP_TYPES), less those in `skip`."""
    layers, refused = [], {}
    for node in graph:
        chosen = node.op_type in op_types or (node.name in named and node.op_type in OP_TYPES)
        if not chosen or node.domain not in ("", "ai.onnx") or node.name in skip:
            continue
        if node.name not in plan.quantized_nodes or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        if node.name in plan.lowered:
            refused[node.name] = f"lowered by the {plan.lowered[node.name].strategy} strategy"
            continue
        tensor = plan.tensors.get(node.inputs[1].name)
        w = constant_array(node.inputs[1])
        reason = _refusal(node, tensor, w)
        if reason is not None:
            refused[node.name] = reason
            continue
        layers.append(Layer(node, tensor, _bias_of(node, w)))
    return layers, refused
