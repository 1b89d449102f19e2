"""The nodes that reduce a statistic of a tensor inside the calibration session
(`statistics.py` says what each statistic is and why it is reduced there): ReduceMin /
ReduceMax for ranges, float32 sums per sample for means (by GlobalAveragePool for images
of fixed size, which runs on onnxruntime's blocked layout) and MatMuls with 0/1 tap
matrices for a convolution's window means (`tap_nodes`); the few numbers per sample these
leave are summed over the samples in numpy (`statistics.py`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

if TYPE_CHECKING:  # statistics.py imports this module
    from onnxq.calibrate.statistics import Statistic


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
    sample's sums [N, C, taps...]), and the number of output positions."""

    nodes: list[ir.Node]
    outputs: list[ir.Value]
    positions: int

    def means(self, sums: np.ndarray) -> np.ndarray:
        """[C, prod(kernel)] as `ConvGeometry.window_means` gives them, from the sums."""
        return sums.reshape(len(sums), -1).astype(np.float64) / max(self.positions, 1)

    @staticmethod
    def total(each: np.ndarray) -> tuple[np.ndarray, int]:
        """The batch's window sums [C, taps...] in float32 from each sample's [N, C, taps...],
        and the samples they count."""
        return each.sum(axis=0, dtype=np.float32), len(each)


def tap_nodes(value: ir.Value, stat: Statistic, opset: int) -> Taps | None:
    """A `windows` statistic of a 1-d or 2-d convolution's input reduced inside the session
    where its spatial size is known: the last axis contracted with its 0/1 tap matrix
    (`ConvGeometry.reads`) by a MatMul on the right, the one before it by a MatMul on the
    left (no transpose: onnxruntime's Transpose of the small result took 0.97 s of a
    MobileNet-v1 calibration). A batch comes back as N x C x taps numbers, summed over the
    samples in numpy (`Taps.total`), not the C x positions image whose contraction in numpy
    took 0.2 s of MobileNet-v1's 2.1 s quantize. None: the ReduceSum over the samples
    (`_sum_nodes`)."""
    shape = value.shape
    if (stat.window is None or shape is None or len(shape) not in (3, 4) or stat.axis % len(shape) != 1
            or value.dtype not in _SUMMABLE or not all(isinstance(d, int) for d in shape[2:])):
        return None
    matrices, positions = stat.window.reads([int(d) for d in shape[2:]])
    name = value.name + _suffix(stat)
    nodes = _float32(value, name)
    source = nodes[-1].outputs[0] if nodes else value
    dtype = np.float64 if source.dtype == ir.DataType.DOUBLE else np.float32

    def product(step: str, reads: np.ndarray, left: bool) -> None:
        nonlocal source
        constant = ir.node("Constant", [], {"value": ir.Tensor(np.ascontiguousarray(reads, dtype))},
                           name=step + "_reads", outputs=[ir.Value(name=step + "_reads")])
        pair = [constant.outputs[0], source] if left else [source, constant.outputs[0]]
        nodes.extend([constant, ir.node("MatMul", pair, name=step, outputs=[ir.Value(name=step)])])
        source = nodes[-1].outputs[0]

    if len(matrices) == 2:  # [taps, H] @ [N, C, H, W]: [N, C, taps, W]
        product(name + "_rows", matrices[0], left=True)
    product(name + "_columns", matrices[-1].T, left=False)  # [..., W] @ [W, taps]
    # [N, C, taps...] comes back, each sample's window sums, summed over the samples in numpy
    # (`Taps.total`) where a ReduceSum and a Shape per tensor and batch cost more than that
    return Taps(nodes, [source], positions)


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
