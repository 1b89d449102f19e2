"""Fold nodes whose inputs are all constant into initializers.

Old exporters produce weights with `ConstantOfShape`, `Unsqueeze` of constants, weight
`Transpose`s and the like. Quantization needs weights as initializers, so every such node
is evaluated once, with the ONNX reference implementation, and replaced by its result.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from onnxq.graph.edit import make_initializer

# Ops never folded: random, already-quantized weights (folding would dequantize them), or
# with side inputs we do not evaluate.
NO_FOLD = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "If",
    "Loop",
    "Scan",
}

# Results above this many elements stay as nodes (folding would bloat the model).
MAX_FOLD_ELEMENTS = 1 << 28


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The numpy value of a constant (initializer that is not a graph input), else None."""
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def _foldable(node: ir.Node) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in NO_FOLD:
        return False
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return False
    present = [v for v in node.inputs if v is not None]
    if node.op_type != "Constant" and not present:
        return False
    return all(constant_array(v) is not None for v in present)


def _evaluate(node: ir.Node, opset: int) -> list[np.ndarray] | None:
    proto = ir.serde.serialize_node(node)
    feeds = {v.name: constant_array(v) for v in node.inputs if v is not None}
    try:
        return ReferenceEvaluator(proto, opsets={"": opset}).run(None, feeds)
    except Exception:  # an op the reference cannot run stays a node; nothing is lost
        return None


def fold_constants(model: ir.Model) -> int:
    """Replace constant subexpressions by initializers, in topological order; count folded."""
    graph = model.graph
    opset = model.opset_imports.get("", 13)
    folded = 0
    for node in list(graph):
        if not _foldable(node):
            continue
        results = _evaluate(node, opset)
        if results is None or any(np.asarray(r).size > MAX_FOLD_ELEMENTS for r in results):
            continue
        if any(output.is_graph_output() for output in node.outputs):
            continue
        for output, result in zip(node.outputs, results):
            new = make_initializer(output.name, np.asarray(result))
            output.replace_all_uses_with(new)
            output.name = None
            graph.register_initializer(new)
        graph.remove(node, safe=True)
        folded += 1
    return folded
