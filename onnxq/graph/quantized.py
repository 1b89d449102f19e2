"""Which nodes show that a model is already quantized.

`quantize` refuses such a model (a second set of Q/DQ on top of the first quantizes
twice and measures nothing), `inspect` says so, and `convert` names the kernels it cannot
rewrite. Q/DQ pairs and onnxruntime's integer kernels (QLinear*, QGemm, ...) are
rewritable; weight-only and dynamic kernels are not.
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

# Kernels that hold quantized weights or quantize at run time, whose float form convert
# does not rebuild.
OPAQUE_KERNELS = ("MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "ConvInteger", "DynamicQuantizeLinear",
                  "DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulFpQ4", "QAttention",
                  "QEmbedLayerNormalization", "QOrderedMatMul", "MatMulBnb4")
DOMAINS = ("", "ai.onnx", "com.microsoft")
# onnxq's own fake-quantization ops of the qdq-ext format (`onnxq.runtime` registers them).
EXTENDED_DOMAIN = "ai.onnx.contrib"
EXTENDED_OPS = ("OnnxqQuantizeDequantize", "OnnxqBlockQuantizeDequantize")


def integer_kernel(node: ir.Node) -> bool:
    """One of onnxruntime's integer kernels that a Q/DQ model becomes in QOperator format
    (QLinearConv, QGemm, ...), which `convert` rewrites."""
    op = node.op_type
    return node.domain in DOMAINS and (op.startswith("QLinear") or op in ("QGemm", "MatMulIntegerToFloat"))


def _quantized_op(node: ir.Node) -> bool:
    """A quantization op, or a DequantizeLinear of stored codes (a constant) or of a
    QuantizeLinear's output; one that turns a graph input into float (a uint8 image
    scaled by 1/255) is preprocessing of a float model."""
    op = node.op_type
    if node.domain not in DOMAINS:
        return False
    if op == "DequantizeLinear":
        source = node.inputs[0] if node.inputs else None
        producer = source.producer() if source is not None else None
        return source is not None and (source.const_value is not None or (
            producer is not None and producer.op_type in ("QuantizeLinear", "Constant")))
    return op == "QuantizeLinear" or op in OPAQUE_KERNELS or integer_kernel(node)


def _nodes(model: ir.Model):
    """Every node, in subgraphs (If, Loop, Scan bodies) too."""
    return ir.traversal.RecursiveGraphIterator(model.graph)


def quantized_ops(model: ir.Model) -> Counter:
    """Op type -> count of the nodes that belong to a quantized model (subgraphs included)."""
    return Counter(n.op_type for n in _nodes(model) if _quantized_op(n))


def opaque_kernels(model: ir.Model) -> Counter:
    """Op type -> count of weight-only and dynamic kernels (`OPAQUE_KERNELS`)."""
    return Counter(n.op_type for n in _nodes(model) if n.domain in DOMAINS and n.op_type in OPAQUE_KERNELS)


def extended_ops(model: ir.Model) -> Counter:
    """Op type -> count of onnxq's extended Q/DQ ops (`--format qdq-ext`, `onnxq.runtime`)."""
    return Counter(n.op_type for n in _nodes(model) if n.domain == EXTENDED_DOMAIN and n.op_type in EXTENDED_OPS)


def describe(ops: Counter, limit: int = 4) -> str:
    """'QuantizeLinear x9, DequantizeLinear x21' (the most frequent first)."""
    items = [f"{op} x{n}" for op, n in ops.most_common(limit)]
    return ", ".join(items) + (", ..." if len(ops) > limit else "")
