"""Fold nodes whose inputs are all constant into initializers.

Old exporters produce weights with `ConstantOfShape`, `Unsqueeze` of constants, weight
`Transpose`s and the like. Quantization needs weights as initializers, so every such node
is evaluated once, with the ONNX reference implementation, and replaced by its result.
Only tensor results are folded: a constant sequence or optional (SequenceConstruct of
initializers, Optional of one) stays a node, since an initializer can only be a tensor.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from onnxq.graph.edit import make_initializer
from onnxq.numerics.qmath import dequantize

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


def is_constant(value: ir.Value | None) -> bool:
    """Whether `value` is a constant: an initializer that is not a graph input."""
    return value is not None and value.const_value is not None and not value.is_graph_input()


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The numpy value of a constant (`is_constant`), else None."""
    return value.const_value.numpy() if is_constant(value) else None


def _outputs_are_tensors(node: ir.Node, opset: int) -> bool:
    """Whether the schema makes every output a tensor when the inputs are tensors.

    An output is a tensor when its type constraint allows only tensors, or when it shares
    its type parameter with an input (Identity, If): folded inputs are always tensors.
    """
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return False
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    input_params = {formal.type_str for formal in schema.inputs}
    return all(
        formal.type_str in input_params
        or all(t.startswith("tensor(") for t in allowed.get(formal.type_str, [formal.type_str]))
        for formal in schema.outputs
    )


def _foldable(node: ir.Node, opset: int) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in NO_FOLD:
        return False
    if not _outputs_are_tensors(node, opset):
        return False
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return False
    present = [v for v in node.inputs if v is not None]
    if node.op_type != "Constant" and not present:
        return False
    if any(_shared_quantized(v) for v in present):
        return False
    return all(constant_array(v) is not None for v in present)


# Elements from which a shared integer constant is not folded into a copy.
SHARED_QUANTIZED_ELEMENTS = 1 << 16


def _shared_quantized(value: ir.Value) -> bool:
    """A large integer initializer that a quantized kernel (com.microsoft: MatMulNBits) or a
    DequantizeLinear and other nodes read: an already-quantized table (MatMulNBits' B read by
    GatherBlockQuantized through a Reshape, as onnxq writes a tied LM head and embedding).
    Folded, its copy would store the table twice (SmolLM2 int4 quantized again: 82.2 ->
    96.4 MB). Other integer constants (shapes, index tables) fold as before."""
    if not is_constant(value) or len(value.uses()) < 2 or not value.const_value.dtype.is_integer():
        return False
    if not any(use.node.domain == "com.microsoft" or use.node.op_type == "DequantizeLinear" for use in value.uses()):
        return False
    return math.prod(value.const_value.shape) >= SHARED_QUANTIZED_ELEMENTS  # without reading its bytes


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
        if not _foldable(node, opset):
            continue
        results = _evaluate(node, opset)
        if results is None or not all(isinstance(r, np.ndarray | np.generic) for r in results):
            continue
        if any(np.asarray(r).size > MAX_FOLD_ELEMENTS for r in results):
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


def dequantized_constant(node: ir.Node) -> np.ndarray | None:
    """The float value a DequantizeLinear of constants gives (per axis or per block), in its
    scale's type; None when its data or scale is not constant."""
    arrays = [constant_array(v) if v is not None else None for v in node.inputs[:3]]
    if arrays[0] is None or arrays[1] is None:
        return None
    axis = node.attributes.get("axis")
    block = node.attributes.get("block_size")
    zp = arrays[2] if len(arrays) > 2 and arrays[2] is not None else np.zeros_like(arrays[1], dtype=np.int32)
    return dequantize(arrays[0], arrays[1], zp, axis.as_int() if axis is not None else 1,
                      block.as_int() if block is not None else None).astype(arrays[1].dtype)
