"""Weight-only block quantization of MatMul into onnxruntime's com.microsoft::MatMulNBits:
the graph rewrite. The weight's arithmetic and stored layout are `numerics/blocks.py`'s."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config
from onnxq.emit.lowering import LoweringReport, claimed_nodes, register_lowering
from onnxq.graph.edit import GraphEditor, drop_unread
from onnxq.graph.fold import constant_array
from onnxq.numerics.blocks import BlockQuantized, quantize_blockwise
from onnxq.parallel import ordered_map
from onnxq.plan.strategies.matmul_nbits import FLOAT_TYPES, can_use_matmul_nbits, weight_dtype

CONTRIB = "com.microsoft"
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


def replace_with_nbits(graph: ir.Graph, editor: GraphEditor, node: ir.Node, bq: BlockQuantized,
                       accuracy_level: int) -> ir.Node:
    """Insert the MatMulNBits node, move the MatMul's output onto it and remove the MatMul;
    returns the new node."""
    prefix = node.name
    inputs = [
        node.inputs[0],
        editor.initializer(f"{prefix}_B_quantized", bq.packed),
        editor.initializer(f"{prefix}_scales", bq.scales),
    ]
    if bq.zero_points is not None:
        inputs.append(editor.initializer(f"{prefix}_zero_points", bq.zero_points))
    old = node.outputs[0]
    out = ir.Value(name=editor.unique(f"{prefix}_nbits"), shape=old.shape, type=old.type)
    attrs = {"K": bq.k, "N": bq.n, "bits": bq.bits, "block_size": bq.block_size,
             "accuracy_level": accuracy_level}
    new = ir.node("MatMulNBits", inputs, attrs, domain=CONTRIB, outputs=[out],
                  name=editor.unique(f"{prefix}_MatMulNBits"))
    graph.insert_before(node, new)
    name = old.name
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    weight = node.inputs[1]
    graph.remove(node, safe=True)
    old.name = None
    out.name = name
    drop_unread(graph, weight)
    return new


def block_quantized(node: ir.Node, spec: ResolvedSpec, weights: object = None, clip_search: bool | None = None,
                    importance: np.ndarray | None = None) -> BlockQuantized:
    """The MatMul's weight in MatMulNBits' layout: the one pinned for it in `weights` (a
    `WeightCache`: GPTQ's, AWQ's, HQQ's), else `quantize_blockwise`'s."""
    bq = weights.pinned_node(node.name, node.inputs[1]) if weights is not None else None
    if bq is not None:
        return bq
    return quantize_blockwise(constant_array(node.inputs[1]), spec, FLOAT_TYPES[weight_dtype(node)],
                              clip_search, importance)


def emit_matmul_nbits(model: ir.Model, nodes: Mapping[str, ResolvedSpec],
                      accuracy_level: int = 0, clip_search: bool | None = None,
                      importance: Mapping[str, np.ndarray] | None = None, weights: object = None) -> dict[str, str]:
    """Rewrite the MatMuls in `nodes` (name -> weight spec) as MatMulNBits, in place.

    `accuracy_level` is MatMulNBits' attribute (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
    computation of A). `importance` (node name -> mean x^2 of each of A's K channels over
    calibration data) and `clip_search` drive the 4-bit clipping search, see
    `quantize_blockwise`; `weights` (a `WeightCache`) may hold a node's weight already in
    MatMulNBits' layout (GPTQ). Returns the skipped nodes with the reason.
    """
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")
    graph = model.graph
    editor = GraphEditor(graph)
    ready, skipped = claimed_nodes(graph, nodes, can_use_matmul_nbits)

    def quantized(item: tuple[ir.Node, ResolvedSpec]) -> BlockQuantized:
        node, spec = item
        return block_quantized(node, spec, weights, clip_search, (importance or {}).get(node.name))

    # Weights are quantized on every core, ahead of the graph edits, which stay in order.
    for (node, _), bq in zip(ready, ordered_map(quantized, ready)):
        replace_with_nbits(graph, editor, node, bq, accuracy_level)
    if len(skipped) < len(nodes):
        model.opset_imports.setdefault(CONTRIB, 1)
    return skipped


@register_lowering("matmul_nbits", order=20)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    return LoweringReport(skipped=emit_matmul_nbits(model, nodes, config.accuracy_level, weights=weights))
