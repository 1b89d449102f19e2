"""The nodes that reduce a statistic of a tensor inside the calibration session
(`statistics.py` says what each statistic is and why it is reduced there): ReduceMin /
ReduceMax for ranges, float32 sums per sample for means (by GlobalAveragePool for images
of fixed size, which runs on onnxruntime's blocked layout) and depthwise Convs of ones or
MatMuls with 0/1 tap matrices for a convolution's window means (`tap_nodes`); the few
numbers per sample these leave are summed over the samples in numpy (`statistics.py`)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

if TYPE_CHECKING:  # statistics.py imports this module
    from onnxq.calibrate.statistics import Statistic
    from onnxq.graph.layout import ConvGeometry


def _suffix(stat: Statistic) -> str:
    """Names of the nodes computing `stat`: one per statistic of a tensor (window means of
    convolutions of different geometry reading the same tensor included)."""
    geometry = f"_{zlib.crc32(repr(stat.window).encode()):08x}" if stat.window is not None else ""
    return f"__onnxq_{stat.reduce}_{stat.axis}{geometry}".replace("-", "m")


# The name ending of a mean's per-sample sums, which the session returns to be summed over
# the samples in numpy (`_sum_nodes`).
EACH = "_each"
_SUMMABLE = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _reduce(op: str, source: ir.Value, axes: list[int], keepdims: int, name: str, opset: int) -> list[ir.Node]:
    """One Reduce* node over `axes` (an input from the opset where the op takes it so)."""
    out = ir.Value(name=name)
    if opset >= (13 if op == "ReduceSum" else 18):
        constant = ir.node("Constant", [], {"value": ir.Tensor(np.array(axes, np.int64))}, name=name + "_axes",
                           outputs=[ir.Value(name=name + "_axes")])
        return [constant, ir.node(op, [source, constant.outputs[0]], {"keepdims": keepdims}, outputs=[out],
                                  name=name)]
    return [ir.node(op, [source], {"keepdims": keepdims, "axes": axes}, outputs=[out], name=name)]


def _cast(source: ir.Value, to: ir.DataType, name: str) -> ir.Node:
    return ir.node("Cast", [source], {"to": to}, name=name, outputs=[ir.Value(name=name)])


def _float32(value: ir.Value, name: str) -> list[ir.Node]:
    """A Cast of a float16/bfloat16 `value` to float32 (sums of halves lose the data's
    precision), or nothing."""
    if value.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return [_cast(value, ir.DataType.FLOAT, name + "_f32")]
    return []


def _shape(counted: ir.Value, name: str) -> ir.Node:
    """The Shape of the tensor a sum was taken over: the count its mean divides by."""
    return ir.node("Shape", [counted], name=name + "_shape", outputs=[ir.Value(name=name + "_shape")])


def reduction_nodes(value: ir.Value, stat: Statistic, opset: int) -> tuple[list[ir.Node], list[ir.Value]] | None:
    """Nodes computing `stat` of one batch inside the session, and their outputs (for sums,
    the batch's sum and the tensor's shape, which gives the count). None for Gram matrices
    and when the rank is unknown or a sum's type is not a float (reduced in numpy)."""
    rank = len(value.shape) if value.shape is not None else None
    if rank is None or rank < 2 or stat.reduce == "gram":
        return None  # rank 1: Reduce* with no axes would reduce the channel axis too
    name = value.name + _suffix(stat)
    axis = stat.axis % rank
    axes = [i for i in range(rank) if i != axis]
    if stat.reduce in ("mean", "windows"):
        return _sum_nodes(value, stat.reduce, axes, name, opset)
    nodes: list[ir.Node] = []
    source = value
    if stat.reduce == "absmax":
        nodes.append(ir.node("Abs", [value], name=name + "_abs", outputs=[ir.Value(name=name + "_abs")]))
        source = nodes[-1].outputs[0]
    nodes += _reduce("ReduceMin" if stat.reduce == "min" else "ReduceMax", source, axes, 0, name, opset)
    return nodes, [nodes[-1].outputs[0]]


@dataclass(frozen=True)
class Taps:
    """Window sums reduced inside the session (`tap_nodes`): the nodes, their output (each
    sample's sums [N, C, taps...], where a stride that does not divide the input leaves
    more positions than taps along an axis), the taps per axis and the number of output
    positions."""

    nodes: list[ir.Node]
    outputs: list[ir.Value]
    kernel: tuple[int, ...]
    positions: int

    def means(self, sums: np.ndarray) -> np.ndarray:
        """[C, prod(kernel)] as `ConvGeometry.window_means` gives them, from the sums."""
        return sums.reshape(len(sums), -1).astype(np.float64) / max(self.positions, 1)

    def total(self, each: np.ndarray) -> tuple[np.ndarray, int]:
        """The batch's window sums [C, taps...] in float32 from each sample's [N, C, taps...],
        and the samples they count."""
        taps = each[(slice(None), slice(None), *(slice(k) for k in self.kernel))]
        return taps.sum(axis=0, dtype=np.float32), len(each)


def tap_nodes(value: ir.Value, stat: Statistic, on_cpu: bool = True) -> Taps | None:
    """A `windows` statistic of a 1-d or 2-d convolution's float input of known size reduced
    inside the session to each sample's window sums, N x C x taps numbers summed over the
    samples in numpy (`Taps.total`): by depthwise Convs of ones where onnxruntime's CPU
    provider (`on_cpu`) keeps the image on its blocked layout (`_conv_taps`), by MatMuls
    with 0/1 tap matrices elsewhere (`_matmul_taps`; GPU providers run them as GEMMs).
    None (the ReduceSum over the samples, `_sum_nodes`): an unknown size or channel count,
    or an axis with no output position."""
    shape = value.shape
    if (stat.window is None or shape is None or len(shape) not in (3, 4) or stat.axis % len(shape) != 1
            or value.dtype not in _SUMMABLE or not all(isinstance(d, int) for d in shape[1:])):
        return None
    spatial = [int(d) for d in shape[2:]]
    outputs = stat.window.output_shape(spatial)
    if min(outputs) < 1:
        return None
    name = value.name + _suffix(stat)
    nodes = _float32(value, name)
    source = nodes[-1].outputs[0] if nodes else value
    # onnxruntime (1.32) runs a depthwise Conv on its blocked layout where the channels are
    # a multiple of 4; with 3 (an RGB input) a Conv of ones took 6x the MatMuls' time
    blocked = on_cpu and len(spatial) == 2 and int(shape[1]) % 4 == 0 and source.dtype == ir.DataType.FLOAT
    made = _conv_taps if blocked else _matmul_taps
    nodes += made(source, stat.window, spatial, int(shape[1]), name)
    return Taps(nodes, [nodes[-1].outputs[0]], stat.window.kernel, math.prod(outputs))


def _conv_taps(source: ir.Value, geometry: ConvGeometry, spatial: list[int], channels: int,
               name: str) -> list[ir.Node]:
    """Along each spatial axis, a depthwise Conv of ones whose kernel spans the convolution's
    output positions (dilated by its stride, strided by its dilation, padded as it is) puts
    at position t the sum of what tap t reads (`ConvGeometry.reads`). They run on the blocked
    layout the image is on, where MatMuls made the Conv before them reorder its output
    (MobileNet-v1's calibration pass at batch 2, 100 runs: MatMuls and reorders 0.29 s of
    1.29 s, Convs of ones 0.17 s)."""
    nd, pads, outputs = len(spatial), geometry.pads_for(spatial), geometry.output_shape(spatial)
    nodes: list[ir.Node] = []
    for axis in reversed(range(nd)):  # the last axis first: the image shrinks to taps along it
        k, stride, dilation = geometry.kernel[axis], geometry.strides[axis], geometry.dilations[axis]
        span = stride * (outputs[axis] - 1) + 1
        # the end padding that leaves k positions, where it is not negative (else more, cut in `Taps.total`)
        end = max(0, (k - 1) * dilation + span - spatial[axis] - pads[axis])
        kernel, dilations, strides, padding = [1] * nd, [1] * nd, [1] * nd, [0] * (2 * nd)
        kernel[axis], dilations[axis], strides[axis] = outputs[axis], stride, dilation
        padding[axis], padding[axis + nd] = pads[axis], end
        step = f"{name}_axis{axis}"
        ones = ir.node("Constant", [], {"value": ir.Tensor(np.ones([channels, 1, *kernel], np.float32))},
                       name=step + "_ones", outputs=[ir.Value(name=step + "_ones")])
        # typed attributes: ir.node's inference of list attributes' types took 0.25 ms a node
        attributes = [ir.AttrInt64("group", channels), ir.AttrInt64s("kernel_shape", kernel),
                      ir.AttrInt64s("dilations", dilations), ir.AttrInt64s("strides", strides),
                      ir.AttrInt64s("pads", padding)]
        nodes += [ones, ir.Node("", "Conv", [source, ones.outputs[0]], attributes, name=step,
                                outputs=[ir.Value(name=step)])]
        source = nodes[-1].outputs[0]
    return nodes


def _matmul_taps(source: ir.Value, geometry: ConvGeometry, spatial: list[int], channels: int,
                 name: str) -> list[ir.Node]:
    """The last axis contracted with its 0/1 tap matrix (`ConvGeometry.reads`) by a MatMul
    on the right, the one before it by a MatMul on the left (no transpose: onnxruntime's
    Transpose of the small result took 0.97 s of a MobileNet-v1 calibration)."""
    matrices, _ = geometry.reads(spatial)
    nodes: list[ir.Node] = []

    def product(step: str, reads: np.ndarray, left: bool) -> None:
        nonlocal source
        dtype = np.float64 if source.dtype == ir.DataType.DOUBLE else np.float32
        constant = ir.node("Constant", [], {"value": ir.Tensor(np.ascontiguousarray(reads, dtype))},
                           name=step + "_reads", outputs=[ir.Value(name=step + "_reads")])
        pair = [constant.outputs[0], source] if left else [source, constant.outputs[0]]
        nodes.extend([constant, ir.node("MatMul", pair, name=step, outputs=[ir.Value(name=step)])])
        source = nodes[-1].outputs[0]

    if len(matrices) == 2:  # [taps, H] @ [N, C, H, W]: [N, C, taps, W]
        product(name + "_rows", matrices[0], left=True)
    product(name + "_columns", matrices[-1].T, left=False)  # [..., W] @ [W, taps]
    return nodes


def _sum_nodes(value: ir.Value, reduce: str, axes: list[int], name: str,
               opset: int) -> tuple[list[ir.Node], list[ir.Value]] | None:
    """A mean's batch sum (module doc): per sample in float32 over `axes` but the first, then
    over the first in double (in numpy, where a per-sample sum was taken here: the outputs
    are then those sums and the tensor's shape); for windows, the sum over the samples (axis 0) in float32."""
    if value.dtype not in _SUMMABLE:
        return None
    nodes = _float32(value, name)
    counted = value
    source = nodes[-1].outputs[0] if nodes else value
    each = False  # whether a per-sample sum is taken here (not a float32 Cast alone)
    if reduce == "windows":
        nodes += _reduce("ReduceSum", source, [0], 0, name, opset)
    else:
        spatial = value.shape.dims[2:] if value.shape is not None else ()
        if axes == [0, 2, 3] and source.dtype == ir.DataType.FLOAT and all(isinstance(d, int) for d in spatial):
            # each sample's channel mean, counted once per sample (its shape is [N, C, 1, 1];
            # every sample has the same positions, the size being fixed): GlobalAveragePool
            # runs on onnxruntime's blocked layout, where ReduceSum, and a Shape of the
            # image, made the Conv before them reorder their output
            nodes.append(ir.node("GlobalAveragePool", [source], name=name + EACH,
                                 outputs=[ir.Value(name=name + EACH)]))
            source = counted = nodes[-1].outputs[0]
            each = True
        elif len(axes) > 1:  # positions of each sample in float32: thousands of terms, not the data
            nodes += _reduce("ReduceSum", source, axes[1:], 1, name + EACH, opset)
            source = nodes[-1].outputs[0]
            each = True
        if each:
            # each sample's sums come back (`EACH`), a few numbers per channel, summed over the
            # samples in double in numpy (`statistics.per_sample_sum`): a Cast and a ReduceSum
            # per tensor and batch were a fifth of MobileNet-v1's calibration pass
            nodes.append(_shape(counted, name))
            return nodes, [source, nodes[-1].outputs[0]]
        if value.dtype != ir.DataType.DOUBLE:
            nodes.append(_cast(source, ir.DataType.DOUBLE, name + "_f64"))
            source = nodes[-1].outputs[0]
        nodes += _reduce("ReduceSum", source, axes, 0, name, opset)
    total = nodes[-1].outputs[0]
    nodes.append(_shape(counted, name))
    return nodes, [total, nodes[-1].outputs[0]]
