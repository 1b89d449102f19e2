"""Fold inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm before it.

BN(y) = s * (y - mean) + beta with s = gamma / sqrt(var + eps), applied per output
channel, so it can be absorbed by scaling that channel's weights and rewriting its bias.
The float model computes the same function afterwards, and the quantizer sees one
weight tensor instead of a weight plus a float affine op it cannot quantize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.graph.edit import set_constant
from onnxq.graph.fold import constant_array
from onnxq.optimize.context import PassContext, PassResult
from onnxq.optimize.registry import register_pass

FOLDABLE = {"Conv", "ConvTranspose", "Gemm"}


@dataclass(frozen=True)
class FoldBatchNormConfig:
    """Options of the `fold_batchnorm` pass.

    skip_fusion_layers: names of BatchNormalization nodes, or of their producers, to leave
      unfolded.
    """

    ALGORITHM: ClassVar[str] = "fold_batchnorm"

    skip_fusion_layers: tuple[str, ...] = ()


def _bn_scale_shift(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    params = [constant_array(v) for v in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    scale = gamma / np.sqrt(var + float(layout.attr(bn, "epsilon", 1e-5)))
    return scale, beta - mean * scale


def _scaled_weight(node: ir.Node, w: np.ndarray, scale: np.ndarray) -> np.ndarray | None:
    """The weight with output channel c multiplied by scale[c], or None if not foldable."""
    if node.op_type == "Gemm" and (layout.attr(node, "beta", 1.0) != 1.0 or w.ndim != 2):
        return None
    return w * layout.out_channel_factor(node, w.shape, scale)


def _fold(graph: ir.Graph, node: ir.Node, bn: ir.Node) -> bool:
    scale_shift = _bn_scale_shift(bn)
    w = constant_array(node.inputs[1])
    if scale_shift is None or w is None:
        return False
    scale, shift = scale_shift
    bias_value = node.inputs[2] if len(node.inputs) > 2 else None
    b = constant_array(bias_value) if bias_value is not None else np.zeros(scale.shape)
    if b is None or b.size not in (1, scale.size):
        return False
    new_w = _scaled_weight(node, w.astype(np.float64), scale)
    if new_w is None:
        return False
    new_b = np.broadcast_to(b.reshape(-1), scale.shape) * scale + shift
    set_constant(graph, node, 1, new_w.astype(w.dtype), f"{node.name}_bn_weight")
    set_constant(graph, node, 2, new_b.astype(w.dtype), f"{node.name}_bn_bias")
    out, bn_out = node.outputs[0], bn.outputs[0]
    name = bn_out.name
    bn_out.replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(bn, safe=True)
    bn_out.name = None
    out.name = name
    return True


@register_pass("fold_batchnorm", options=FoldBatchNormConfig, rewrites=("weights", "biases", "graph"))
def fold_batchnorm(model: ir.Model, opts: FoldBatchNormConfig, ctx: PassContext) -> str | PassResult:
    """Fold every BN that alone consumes a Conv/ConvTranspose/Gemm output.

    Options: `FoldBatchNormConfig` (a misspelled option is an error naming the nearest).
    """
    skip = set(opts.skip_fusion_layers)
    graph = model.graph
    folded, kept = 0, []
    for bn in [n for n in graph if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]:
        why = _unfoldable(bn, skip)
        if why is None and _fold(graph, bn.inputs[0].producer(), bn):
            folded += 1
        else:
            kept.append(f"{bn.name} ({why or 'weights or statistics not constant'})")
    if not folded and not kept:  # said only where asked for: as a default it runs on every model
        return PassResult("no BatchNormalization", idle=True)
    note = f"{folded} BatchNormalization folded"
    return note + (f", {len(kept)} kept: {', '.join(kept[:5])}" if kept else "")


def _unfoldable(bn: ir.Node, skip: set[str]) -> str | None:
    """Why `bn` cannot fold into the node before it; None where it can. A BatchNormalization
    with more outputs than Y is in training mode whether or not anything reads them (ONNX
    before opset 14; onnxruntime then normalizes by each batch's own statistics): folding
    its running statistics would change what the model computes (legacy trial: an
    opset-7 one with five outputs had been kept as having 'no foldable producer')."""
    producer = bn.inputs[0].producer()
    if bn.name in skip or (producer is not None and producer.name in skip):
        return "skip_fusion_layers"
    if producer is None or producer.op_type not in FOLDABLE:
        return f"after {producer.op_type if producer is not None else 'a graph input'}, not {'/'.join(sorted(FOLDABLE))}"
    if any(v is not None and v.name for v in bn.outputs[1:]):
        return "in training mode: it outputs its batch statistics"
    if bn.attributes.get_int("training_mode", 0):  # opset 14 on
        return "in training mode (training_mode 1)"
    if len(producer.outputs[0].uses()) != 1 or producer.outputs[0].is_graph_output():
        return f"its {producer.op_type}'s output is read elsewhere too"
    return None
