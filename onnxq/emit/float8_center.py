"""float8 activations centred per channel: Q(x - m) then DQ(.) + m.

float8's precision is relative to a value's magnitude (E4M3: 3 mantissa bits, a step of
1/8 to 1/16 of the value). A channel whose values sit on a large offset with a small
spread loses that spread: MobileNet-v1's early ReLU6 outputs hold channels at mean 2.67
with std 0.31, where E4M3 (MinMax scale) steps by 0.21, and a batch-norm-folded layer
after them amplifies what is lost: float8 on the first layer's output alone brings the
logits to 9 dB. An integer zero point would remove the offset, but onnxruntime refuses
float8 zero points other than 0; so the offset leaves as a per-channel Sub before the
QuantizeLinear and returns as an Add after each DequantizeLinear (float arithmetic,
exact), and float8 codes only the spread around the channel's calibration mean
(MobileNet FP8_E4M3: logit SQNR 6.5 -> 13.1 dB, top-1 70.9 -> 84.0, float 85.5).
A channel's offset is its mean, moved where needed so that no calibrated value leaves the
grid once shifted (a tensor whose range spans both signs would otherwise saturate on one
side). A Q/DQ whose saturation stands for a Relu/Clip kept after it still clips right:
values beyond the shifted range saturate to the same side.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.emit.float8 import is_float8_q, quantized_dtype
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor, values_by_name
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import FLOAT8_TYPES, is_float8
from onnxq.plan import Kind, QuantPlan

WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
# The largest value of each float8 type onnxq emits (QuantizeLinear saturates there).
FLOAT8_MAX = {ir.DataType(f8.onnx_type): f8.max_value for f8 in FLOAT8_TYPES.values()}


def _channel_axis(value: ir.Value) -> int | None:
    """The channel axis (negative) of `value`: as a weighted layer reading it sees it, else
    as the weighted layer producing it made it (Conv: axis 1; Gemm, MatMul: the last);
    None when neither says."""
    for use in value.uses():
        node = use.node
        if _weighted(node) and node.inputs[0] is value:
            return layout.act_channel_axis(node, len(node.inputs[1].shape))
    producer = value.producer()
    if _weighted(producer) and value.shape is not None:
        return 1 - len(value.shape) if producer.op_type in layout.CONVS else -1
    return None


def _weighted(node: ir.Node | None) -> bool:
    """A Conv/Gemm/MatMul of the standard domain whose weight's rank is known."""
    if node is None or node.op_type not in WEIGHTED or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    weight = node.inputs[1]
    return weight is not None and weight.shape is not None


def centering_requests(model: ir.Model, plan: QuantPlan) -> list[Statistic]:
    """The per-channel means of the float8 activations a weighted layer reads (collected
    with calibration)."""
    values = values_by_name(model.graph)
    stats = []
    for name, tensor in plan.tensors.items():
        value = values.get(tensor.source or name)
        if tensor.kind is not Kind.ACTIVATION or not is_float8(tensor.spec.dtype) or value is None:
            continue
        if value.shape is None or len(value.shape) < 2:
            continue
        axis = _channel_axis(value)
        if axis is not None and isinstance(value.shape[axis], int):  # a static axis: the offsets are constants
            stats += [Statistic(value.name, reduce, axis) for reduce in ("mean", "min", "max")]
    return stats


def _offset(stat: Statistic, mean: np.ndarray, statistics: Mapping[Statistic, np.ndarray | None],
            limit: float) -> np.ndarray | None:
    """The channel offsets: the means, moved where needed so that no calibrated value of a
    channel leaves the grid once shifted (|x - m| <= limit, what Q represents without
    saturating); None without the channel extremes."""
    lo = statistics.get(Statistic(stat.tensor, "min", stat.axis))
    hi = statistics.get(Statistic(stat.tensor, "max", stat.axis))
    if lo is None or hi is None or lo.shape != mean.shape or hi.shape != mean.shape:
        return None
    offset = np.clip(mean, hi - limit, lo + limit)
    return offset if np.all(np.isfinite(offset)) else None


def center_float8(model: ir.Model, means: Mapping[Statistic, np.ndarray | None]) -> int:
    """Move each float8 Q/DQ of a tensor with a measured channel mean onto the tensor minus
    that mean (module doc); the number of tensors centred."""
    graph = model.graph
    edit = GraphEditor(graph)
    quantizers = {n.outputs[0].name: n for n in graph if n.op_type == "QuantizeLinear" and n.outputs}
    done: set[str] = set()
    for stat, mean in sorted(means.items(), key=lambda item: item[0].tensor):
        q = quantizers.get(f"{stat.tensor}_q")
        if stat.reduce != "mean" or mean is None or stat.tensor in done or not is_float8_q(q):
            continue
        x, scale = q.inputs[0], constant_array(q.inputs[1])
        if x is None or x.shape is None or scale is None or scale.size != 1 or not np.all(np.isfinite(mean)):
            continue
        limit = float(scale.reshape(-1)[0]) * FLOAT8_MAX[quantized_dtype(q)]
        mean = _offset(stat, mean, means, limit)
        if mean is None:
            continue
        rank = len(x.shape)
        if x.shape[stat.axis % rank] != mean.size:
            continue
        shape = [1] * rank
        shape[stat.axis % rank] = mean.size
        dtype = np.float16 if x.dtype == ir.DataType.FLOAT16 else np.float32
        offset = edit.initializer(f"{stat.tensor}_channel_mean", mean.astype(dtype).reshape(shape))
        q.replace_input_with(0, edit.add_node("Sub", [x, offset], f"{stat.tensor}_centred", dtype=x.dtype,
                                              shape=x.shape))
        for use in list(q.outputs[0].uses()):
            if use.node.op_type == "DequantizeLinear":
                _restore_offset(graph, edit, use.node, offset)
        done.add(stat.tensor)
    return len(done)


def _restore_offset(graph: ir.Graph, edit: GraphEditor, dq: ir.Node, offset: ir.Value) -> None:
    """Add `offset` back after `dq`, for every reader of its output (the graph is sorted
    after emission, so the new node's place in it does not matter)."""
    out = dq.outputs[0]
    readers = [(use.node, use.idx) for use in list(out.uses())]
    restored = edit.add_node("Add", [out, offset], f"{out.name}_uncentred", dtype=out.dtype, shape=out.shape)
    for node, index in readers:
        node.replace_input_with(index, restored)
    if out.is_graph_output():
        outputs = graph.outputs
        outputs[outputs.index(out)] = restored
        restored.name, out.name = out.name, edit.unique(f"{out.name}_centred")
