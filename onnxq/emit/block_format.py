"""Block formats in the qdq-ext format: an `OnnxqBlockQuantizeDequantize` (onnxq.runtime)
on each configured activation input of Conv/Gemm/MatMul, blocks along its reduction axis,
and the weight stored already block-quantized-dequantized (the same values the op would
give, computed once), blocks along the weight's input axis."""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec, resolve_node_config
from onnxq.config.spec import Config
from onnxq.emit.lowering import LoweringReport, claimed_nodes, register_lowering
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.graph.layout import weight_in_axis
from onnxq.numerics.extended import block_fake_quantize
from onnxq.numerics.qmath import BLOCK_DTYPES
from onnxq.runtime import BLOCK_OP, DOMAIN


def _activation_axis(node: ir.Node) -> int:
    """The axis of input 0 that the op reduces over: channels for Conv, else the last
    (Gemm with transA reduces over axis 0)."""
    if node.op_type == "Conv":
        return 1
    trans = node.attributes.get("transA")
    return 0 if node.op_type == "Gemm" and trans is not None and trans.as_int() else -1


@register_lowering("block_format", order=5)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    graph = model.graph
    edit = GraphEditor(graph)
    ready, skipped = claimed_nodes(graph, nodes, lambda node, spec: None)
    report = LoweringReport(skipped=skipped)
    for node, _ in ready:
        cfg = resolve_node_config(config, node.name, node.op_type)
        act = cfg.input_tensors if cfg.input_tensors is not None and cfg.input_tensors.dtype in BLOCK_DTYPES else None
        weight = cfg.weight if cfg.weight is not None and cfg.weight.dtype in BLOCK_DTYPES else None
        for index in (0, 1):
            value = node.inputs[index]
            array = constant_array(value)
            if array is not None and index == 1 and weight is not None:
                fake = block_fake_quantize(array, str(weight.dtype), weight_in_axis(node, array.ndim))
                node.replace_input_with(1, edit.initializer(f"{value.name}_{weight.dtype}", fake.astype(array.dtype)))
            elif array is None and act is not None:
                axis = _activation_axis(node) if index == 0 else -2
                out = edit.add_node(BLOCK_OP, [value], f"{value.name}_{act.dtype}",
                                    {"format": str(act.dtype), "block_size": 0, "axis": axis},
                                    dtype=value.dtype, shape=value.shape, domain=DOMAIN)
                node.replace_input_with(index, out)
        model.opset_imports.setdefault(DOMAIN, 1)
        report.converted.append(node.name)
    if report.converted:
        report.notes.append(f"block formats: {len(report.converted)} nodes through {BLOCK_OP}; run the model with "
                            "onnxq.runtime.InferenceSession (onnxruntime-extensions)")
    return report
