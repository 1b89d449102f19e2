"""The blocks of an emitted graph that block reconstruction optimises as one.

A block starts where every path of the graph passes through one tensor (a cut: the input
of a chain layer, the input of a residual block, the pooled features before a classifier)
and ends at the next block's start, or at the graph's output. Consecutive cuts' segments
are merged until a block holds at least `layers` layers, and a short last block joins the
one before it: MobileNet-v1 gives depthwise + pointwise pairs (its last pair with the
pooling and the classifier), ResNet-20 its residual blocks, the stem joined to the first.

A block's start is taken before its first DequantizeLinear (the codes of the
QuantizeLinear before it), so every consumer of the quantized tensor (a residual branch
has two) reads it inside the block. A block whose nodes include an op type `block_ops`
cannot differentiate, or whose weights the block pass cannot round (pair-safe weights,
float8), is ineligible: its layers take the layer-wise pass alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.numerics.qmath import is_integer
from onnxq.optimize.layerwise.activation import ACTIVATIONS
from onnxq.optimize.layerwise.block_ops import CODE_RANGES, OPS, activation_of
from onnxq.optimize.layerwise.layers import Layer


@dataclass(frozen=True)
class Block:
    """Layers optimised together: their nodes in the emitted graph, graph order, from the
    tensor `start` to the tensor `end` (emitted graph's names); `float_end` is the float
    model's name of the tensor `end` approximates."""

    layers: tuple[Layer, ...]
    start: str
    end: str
    float_end: str
    nodes: tuple[ir.Node, ...]


def _is_const(value: ir.Value, graph: ir.Graph) -> bool:
    return value.const_value is not None or (value.name in graph.initializers)


def block_start(qnode: ir.Node) -> ir.Value:
    """The tensor a block starting at layer `qnode` starts from: the codes before its
    input's DequantizeLinear, else the input itself."""
    x = qnode.inputs[0]
    dq = x.producer()
    if dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0] is not None:
        q = dq.inputs[0].producer()
        if q is not None and q.op_type == "QuantizeLinear":
            return dq.inputs[0]
    return x


def between(graph: ir.Graph, start: ir.Value, end: ir.Value,
            order: Mapping[int, int] | None = None) -> list[ir.Node] | None:
    """The nodes that compute `end` from `start` and constants, in graph order (`order`:
    each node's position by id, computed when not given); None when `end` also depends on
    another input of the graph."""
    order = order if order is not None else {id(node): i for i, node in enumerate(graph)}
    nodes: dict[int, ir.Node] = {}
    stack = [end]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if value is None or value is start or id(value) in seen:
            continue
        seen.add(id(value))
        if _is_const(value, graph):
            continue
        node = value.producer()
        if node is None:
            return None  # a graph input other than `start`
        if id(node) not in nodes:
            nodes[id(node)] = node
            stack.extend(node.inputs)
    return sorted(nodes.values(), key=lambda n: order[id(n)])


def find_blocks(qgraph: ir.Graph, layers: Sequence[Layer], qnodes: Mapping[str, ir.Node], float_output: str,
                min_layers: int) -> tuple[list[Block], dict[str, str]]:
    """The blocks of `layers` (graph order) in the emitted graph `qgraph` (module doc),
    and why each layer left out is."""
    refused: dict[str, str] = {}
    if len(qgraph.outputs) != 1:
        return [], {layer.name: "the graph has several outputs" for layer in layers}
    output = qgraph.outputs[0]
    order = {id(node): i for i, node in enumerate(qgraph)}
    starts = [block_start(qnodes[layer.name]) for layer in layers]
    cuts = [i for i, s in enumerate(starts) if between(qgraph, s, output, order) is not None]
    for layer in layers[:cuts[0] if cuts else len(layers)]:
        refused[layer.name] = "before the first tensor every path passes through"
    spans: list[list[int]] = []
    for a, b in zip(cuts, [*cuts[1:], len(layers)]):
        if spans and len(spans[-1]) < min_layers:
            spans[-1].extend(range(a, b))
        else:
            spans.append(list(range(a, b)))
    if len(spans) > 1 and len(spans[-1]) < min_layers:
        spans[-2].extend(spans.pop())
    blocks = []
    for span in spans:
        first, after = span[0], span[-1] + 1
        if after < len(layers):
            end = qnodes[layers[after].name].inputs[0]
            float_end = layers[after].node.inputs[0].name
        else:
            end, float_end = output, float_output
        nodes = between(qgraph, starts[first], end, order)
        members = tuple(layers[i] for i in span)
        reason = _ineligible(nodes, members, qnodes)
        if reason is not None:
            refused.update({layer.name: reason for layer in members})
            continue
        blocks.append(Block(members, starts[first].name, end.name, float_end, tuple(nodes)))
    return blocks, refused


def _ineligible(nodes: list[ir.Node] | None, layers: tuple[Layer, ...], qnodes: Mapping[str, ir.Node]) -> str | None:
    """Why the block of `layers` over `nodes` cannot be learned, or None."""
    if nodes is None:
        return "its block reads a tensor from outside the block"
    if any(layer.weight.spec.pairs is not None for layer in layers):
        return "pair-safe weights (their kernel pairs are held in range layer by layer)"
    if any(not is_integer(layer.weight.spec.dtype) for layer in layers):
        return "float8 weights"
    inside = {n.name for n in nodes}
    if any(layer.name not in inside for layer in layers):
        return "its block does not compute it from the block's start"
    learned = {qnodes[layer.name].inputs[1].name for layer in layers}
    unsupported = sorted({n.op_type for n in nodes if not _supported(n, learned)})
    if unsupported:
        return f"its block has {', '.join(unsupported)}, which block reconstruction cannot differentiate"
    return None


def _supported(node: ir.Node, learned: set[str]) -> bool:
    """Whether `block_ops` computes `node` as onnxruntime does."""
    if node.op_type not in OPS or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ACTIVATIONS:
        return activation_of(node) is not None  # a Clip bound computed at run time, a PRelu
    if node.op_type == "QuantizeLinear":  # an integer type, named by a constant zero point
        zp = node.inputs[2] if len(node.inputs) > 2 else None
        return zp is not None and zp.const_value is not None and np.dtype(zp.const_value.dtype.numpy()) in CODE_RANGES
    if node.op_type == "MatMul":  # a learned layer's 2-D weight, not two activations
        return node.inputs[1] is not None and node.inputs[1].name in learned
    return True
