"""Whether a quantized model's weights were rescaled per channel against the float model.

Cross-layer equalization, SmoothQuant and AWQ multiply a layer's weight rows or columns by
per-channel factors (and the neighbouring layer's by their inverse): the quantized model
computes the same function through tensors scaled differently from the float model's. A
tensor or layer compared with the float model's of the same name then measures that
scaling, not the quantization (MobileNet-v1 with CLE: a layer "alone" at 2.7 dB in a
model whose logits are at 24 dB). The scaling shows in the weights: a rescaled row or
column of the dequantized weight is the float one times a factor well away from 1 with
the same direction, which rounding cannot produce (it changes a channel's direction as
much as its length, or wipes it out).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.graph.fold import constant_array, dequantized_constant

WEIGHTED = ("Conv", "Gemm", "MatMul")
# A channel is rescaled when its factor is off 1 by more than this ratio at this cosine
# (AdaRound and the scale search shrink int4 rows by up to ~1.3x; CLE scales by 2-1000x).
FACTOR = 2.0
COSINE = 0.995


def _rescaled_along(wq: np.ndarray, wf: np.ndarray, axis: int) -> bool:
    """Whether some slice of `wq` along `axis` is its `wf` slice times a factor off 1."""
    q = np.moveaxis(wq, axis, 0).reshape(wq.shape[axis], -1).astype(np.float64)
    f = np.moveaxis(wf, axis, 0).reshape(wf.shape[axis], -1).astype(np.float64)
    if q.shape[1] < 2:
        return False  # one weight per channel: its factor and its rounding look alike
    dot, ff, qq = np.sum(q * f, axis=1), np.sum(f * f, axis=1), np.sum(q * q, axis=1)
    live = (ff > 0) & (qq > 0)
    factor = np.where(live, dot / np.where(live, ff, 1), 1.0)
    cosine = np.where(live, dot / np.sqrt(np.where(live, ff * qq, 1)), 0.0)
    return bool(np.any(live & (cosine > COSINE) & (np.abs(np.log(np.abs(factor) + 1e-30)) > np.log(FACTOR))))


def rescaled_layers(reference: ir.Model, quant: ir.Model) -> list[str]:
    """The quantized model's Conv/Gemm/MatMul nodes whose dequantized weight has a row or
    column rescaled against the weight of the float model's node of the same name."""
    floats = {n.name: n for n in reference.graph if n.op_type in WEIGHTED}
    found = []
    for node in quant.graph:
        twin = floats.get(node.name)
        if twin is None or len(node.inputs) < 2 or len(twin.inputs) < 2:
            continue
        if any(u.node.op_type == "BatchNormalization" for o in twin.outputs for u in o.uses()):
            continue  # folding the BatchNormalization scaled its rows, exactly like equalization
        dq = node.inputs[1].producer() if node.inputs[1] is not None else None
        plain = dq is not None and dq.op_type == "DequantizeLinear" and not layout.attr(dq, "block_size", 0)
        wq = dequantized_constant(dq) if plain else None
        wf = constant_array(twin.inputs[1])
        if wq is None or wf is None or wq.shape != wf.shape or wq.ndim < 2:
            continue
        out_axis, in_axis = layout.weight_axes(node, wq.ndim)
        if _rescaled_along(wq, wf, out_axis) or _rescaled_along(wq, wf, in_axis):
            found.append(node.name)
    return found
