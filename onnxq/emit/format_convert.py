"""The `convert` command: a quantized model rewritten into another format (QOperator
integer kernels, `qoperator.py`; QDQ or float, `qoperator_expand.py`)."""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from onnxq.emit.qoperator import to_qoperator
from onnxq.emit.qoperator_expand import to_float, to_qdq
from onnxq.emit.qoperator_kernels import FormatReport
from onnxq.errors import ModelError, OnnxqError
from onnxq.graph.edit import drop_unused_initializers
from onnxq.graph.load import read_model
from onnxq.graph.normalize import infer_shapes
from onnxq.graph.quantized import describe, extended_ops, opaque_kernels, quantized_ops
from onnxq.graph.save import check_output_path, save_model

FORMATS: dict[str, Callable[[ir.Model], FormatReport]] = {
    "qoperator": to_qoperator,
    "qdq": to_qdq,
    "float": to_float,
}


def convert_format(model: ir.Model, to: str) -> FormatReport:
    """`model` rewritten in place into format `to` (qdq, qoperator or float)."""
    report = FORMATS[to](model)
    drop_unused_initializers(model.graph)
    model.graph.sort()
    return report


def convert_model(source: str, output: str, to: str) -> str:
    """Read a quantized model, write it in format `to` (atomically; never over the input)
    and return one summary line. A model with no Q/DQ or integer kernel is refused."""
    if to not in FORMATS:
        raise OnnxqError(f"unknown format {to!r}; use one of: {', '.join(FORMATS)}")
    check_output_path(output, source)
    model = read_model(source)
    if any(v.dtype is None for node in model.graph for v in node.outputs):
        infer_shapes(model)  # another tool's model (onnxruntime's quantize_static) leaves them untyped
    if extended := extended_ops(model):
        raise ModelError(f"{source} holds onnxq's extended Q/DQ ops ({describe(extended)}, --format qdq-ext) that "
                         "convert cannot rewrite; quantize the float model again with --format qdq or qoperator, "
                         "or run this one with onnxq run / onnxq compare")
    if not quantized_ops(model):
        raise ModelError(f"{source} has no QuantizeLinear/DequantizeLinear or integer kernel: it is not a "
                         "quantized model; quantize it first with onnxq quantize")
    opaque = opaque_kernels(model)
    if opaque and to == "float":
        raise ModelError(f"{source} holds weight-only or dynamic kernels ({describe(opaque)}) that convert "
                         "cannot turn back into float ops; quantize the float model again instead")
    report = convert_format(model, to)
    report.left = opaque
    save_model(model, output)
    return f"onnxq: {source} -> {output}\n  {report.note(to)}"
