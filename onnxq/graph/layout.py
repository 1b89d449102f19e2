"""Weight and channel geometry of the weighted ops, in one place.

Which axis of a weight holds the output and the input channels, how Gemm's transA/transB
and a convolution's groups rearrange them, and in what order the int8 GEMM walks the
reduction: the planner, the emitters and the optimisation passes ask here instead of
branching on op types and attributes themselves.

The ONNX weight layouts (channel index `g * per_group + j` where groups split a channel):

    Conv           W [M, C/group, *kernel]   out axis 0, in axis 1 (split by group)
    ConvTranspose  W [C, M/group, *kernel]   out axis 1 (split by group), in axis 0
    Gemm           B [K, N], [N, K] with transB (A [M, K], [K, M] with transA)
    MatMul         B [..., K, N]             out axis -1, in axis -2 (0 for a vector)
    Gather         table [rows, dim]         rows are its channels, blocks run along dim
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.graph.fold import constant_array

CONVS = ("Conv", "ConvTranspose")
MATRIX_OPS = ("Gemm", "MatMul")


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    """The value of attribute `name` of `node`, or `default` when it is absent."""
    found = node.attributes.get(name)
    return default if found is None else found.value


def groups(node: ir.Node) -> int:
    """A convolution's `group` attribute (1 when absent, and for ops without groups)."""
    return int(attr(node, "group", 1))


def beta(node: ir.Node) -> float:
    """The factor a layer's added bias is scaled by: Gemm's beta (alpha A B + beta C), else 1."""
    return float(attr(node, "beta", 1.0)) if node.op_type == "Gemm" else 1.0


def gemm_transposes(node: ir.Node) -> tuple[bool, bool]:
    """Gemm's (transA, transB): whether A is [K, M] and B is [N, K] (False for other ops)."""
    return bool(attr(node, "transA", 0)), bool(attr(node, "transB", 0))


def _unknown(node: ir.Node) -> ValueError:
    return ValueError(f"no weight layout known for {node.op_type}")


def weight_axes(node: ir.Node, rank: int) -> tuple[int, int]:
    """(output-channel axis, input-channel axis) of the op's weight, of rank `rank`.

    The output axis is the per-channel quantization axis; the input (reduction) axis is
    where per-group blocks run. A grouped Conv holds one group's input channels there
    (see `in_channels`)."""
    op = node.op_type
    if op == "Conv":
        return 0, 1
    if op == "ConvTranspose":
        return 1, 0
    if op == "Gemm":
        return (0, 1) if gemm_transposes(node)[1] else (1, 0)
    if op == "MatMul":
        return rank - 1, max(rank - 2, 0)
    if op == "Gather":
        return 0, rank - 1
    raise _unknown(node)


def weight_out_axis(node: ir.Node, rank: int) -> int:
    """The output-channel axis of the weight: the per-channel quantization axis."""
    return weight_axes(node, rank)[0]


def weight_in_axis(node: ir.Node, rank: int) -> int:
    """The input-channel (reduction) axis of the weight, along which per-group blocks run."""
    return weight_axes(node, rank)[1]


def k_axes(node: ir.Node, rank: int) -> tuple[int, ...] | None:
    """The weight's reduction axes in the order the int8 GEMM walks K (None: unknown).

    Conv runs as im2col, tap-major and input-channel-minor; MatMul and Gemm reduce along
    their single input axis."""
    if node.op_type == "Conv":
        return (*range(2, rank), 1)
    if node.op_type in MATRIX_OPS:
        return (weight_in_axis(node, rank),)
    return None


def is_depthwise(node: ir.Node, shape: Sequence[int]) -> bool:
    """Whether a Conv with weight `shape` has one input and one output channel per group
    (onnxruntime runs it with its depthwise kernel, not the GEMM)."""
    if node.op_type != "Conv":
        return False
    g = groups(node)
    return g > 1 and len(shape) > 1 and shape[1] == 1 and shape[0] == g


def _split_by_group(node: ir.Node, out: bool) -> bool:
    """Whether the output (`out`) or input channels sit on weight axis 1 split by group."""
    return node.op_type == ("ConvTranspose" if out else "Conv")


def _channel_axis(node: ir.Node, rank: int, out: bool) -> int:
    return weight_axes(node, rank)[0 if out else 1]


def _channels(node: ir.Node, shape: Sequence[int], out: bool) -> int:
    count = shape[_channel_axis(node, len(shape), out)]
    return count * groups(node) if _split_by_group(node, out) else count


def out_channels(node: ir.Node, shape: Sequence[int]) -> int:
    """How many output channels a weight of `shape` gives the op (all groups)."""
    return _channels(node, shape, out=True)


def in_channels(node: ir.Node, shape: Sequence[int]) -> int:
    """How many input channels the op with a weight of `shape` reads (all groups)."""
    return _channels(node, shape, out=False)


def act_channel_axis(node: ir.Node, rank: int) -> int:
    """The channel axis of the op's input activation, counted from the end (negative),
    for a weight of rank `rank`: a convolution's input has the rank of its weight."""
    if node.op_type in CONVS:
        return 1 - rank
    if node.op_type == "Gemm":
        return -2 if gemm_transposes(node)[0] else -1
    if node.op_type == "MatMul":
        return -1
    raise _unknown(node)


def along(factor: np.ndarray, axis: int) -> np.ndarray:
    """A per-channel `factor` shaped to broadcast along `axis` (negative) of a tensor."""
    return factor.reshape((-1,) + (1,) * (-axis - 1))


def matrix_kn(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """A Gemm or MatMul weight as [K, N] (Gemm's transB undone)."""
    return w.T if node.op_type == "Gemm" and gemm_transposes(node)[1] else w


def split_groups(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """A convolution weight viewed with its groups first: Conv [group, M/group, C/group,
    *kernel], ConvTranspose [group, C/group, M/group, *kernel]."""
    g = groups(node)
    return w.reshape((g, w.shape[0] // g) + w.shape[1:])


def _channel_factor(
    node: ir.Node, shape: Sequence[int], factor: np.ndarray, out: bool
) -> np.ndarray:
    g = groups(node)
    if _split_by_group(node, out) and g > 1:
        per_group = (g, 1, shape[1]) + (1,) * (len(shape) - 2)
        grouped = (g, shape[0] // g) + tuple(shape[1:])
        return np.broadcast_to(factor.reshape(per_group), grouped).reshape(shape)
    axis = _channel_axis(node, len(shape), out)
    return factor.reshape([-1 if i == axis else 1 for i in range(len(shape))])


def out_channel_factor(node: ir.Node, shape: Sequence[int], factor: np.ndarray) -> np.ndarray:
    """`factor` (one entry per output channel) shaped to multiply a weight of `shape`, so
    that output channel c is scaled by factor[c]."""
    return _channel_factor(node, shape, factor, out=True)


def in_channel_factor(node: ir.Node, shape: Sequence[int], factor: np.ndarray) -> np.ndarray:
    """`factor` (one entry per input channel) shaped to multiply a weight of `shape`, so
    that input channel c is scaled by factor[c]."""
    return _channel_factor(node, shape, factor, out=False)


def _channel_absmax(node: ir.Node, w: np.ndarray, out: bool) -> np.ndarray:
    if _split_by_group(node, out):
        wg = np.abs(split_groups(node, w))
        return wg.max(axis=(1,) + tuple(range(3, wg.ndim))).reshape(-1)
    axis = _channel_axis(node, w.ndim, out)
    return np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis))


def out_channel_absmax(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """max |w| per output channel."""
    return _channel_absmax(node, w, out=True)


def in_channel_absmax(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """max |w| per input channel (grouped convolutions: channel g * per_group + j)."""
    return _channel_absmax(node, w, out=False)


def apply_to_input(node: ir.Node, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The output per channel (no bias, no Gemm alpha) of a Conv, Gemm or 2-D MatMul with
    weight `w` whose input holds the constant x[c] in every position of channel c (Conv:
    away from zero padding)."""
    if node.op_type == "Conv":
        wg = split_groups(node, w)
        summed = wg.reshape(wg.shape[:3] + (-1,)).sum(axis=3)  # [group, out/group, in/group]
        return np.einsum("goi,gi->go", summed, x.reshape(wg.shape[0], wg.shape[2])).reshape(-1)
    if node.op_type not in MATRIX_OPS:
        raise _unknown(node)
    return w @ x if gemm_transposes(node)[1] and node.op_type == "Gemm" else x @ w


def clip_bounds(node: ir.Node) -> tuple[float, float] | None:
    """A Clip's (min, max), from its inputs (opset 11+) or attributes (older), -inf / inf
    where a bound is absent; None when a bound is computed at run time or not a scalar."""
    bounds = []
    for index, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        value = node.inputs[index] if index < len(node.inputs) else None
        if value is None:
            bounds.append(float(attr(node, name, default)))
            continue
        array = constant_array(value)
        if array is None or array.size != 1:
            return None
        bounds.append(float(array.reshape(-1)[0]))
    return bounds[0], bounds[1]


@dataclass(frozen=True)
class ConvGeometry:
    """Where a convolution's kernel reads its input: kernel size, strides, dilations and
    padding (explicit `pads`, or `auto_pad`, resolved per input size)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]
    auto_pad: str = "NOTSET"

    @classmethod
    def of(cls, node: ir.Node, kernel: Sequence[int]) -> ConvGeometry:
        nd = len(kernel)
        auto_pad = attr(node, "auto_pad", "NOTSET")
        return cls(tuple(int(k) for k in kernel), tuple(attr(node, "strides", [1] * nd)),
                   tuple(attr(node, "dilations", [1] * nd)), tuple(attr(node, "pads", [0] * (2 * nd))),
                   auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad))

    @property
    def pointwise(self) -> bool:
        """Every input position read once by one kernel tap: 1x1, stride 1, no padding."""
        return all(k == 1 for k in self.kernel) and all(s == 1 for s in self.strides) and (
            self.auto_pad in ("VALID", "SAME_UPPER", "SAME_LOWER") or not any(self.pads))

    def pads_for(self, spatial: Sequence[int]) -> list[int]:
        """[begin..., end...] zero padding for an input of size `spatial`."""
        nd = len(self.kernel)
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            pads = [0] * (2 * nd)
            for i in range(nd):
                out = -(-spatial[i] // self.strides[i])
                total = max(0, (out - 1) * self.strides[i] + (self.kernel[i] - 1) * self.dilations[i] + 1 - spatial[i])
                small = total // 2
                pads[i], pads[i + nd] = (small, total - small) if self.auto_pad == "SAME_UPPER" else (total - small, small)
            return pads
        return [0] * (2 * nd) if self.auto_pad == "VALID" else list(self.pads)

    def output_shape(self, spatial: Sequence[int]) -> tuple[int, ...]:
        """The output's spatial size for an input of size `spatial`."""
        pads, nd = self.pads_for(spatial), len(self.kernel)
        return tuple(self._outputs(i, spatial[i], pads[i], pads[i + nd]) for i in range(nd))

    def _outputs(self, axis: int, size: int, begin: int, end: int) -> int:
        """Output positions along `axis` for an input of `size` padded by `begin`, `end`."""
        k, stride, dilation = self.kernel[axis], self.strides[axis], self.dilations[axis]
        return max((size + begin + end - (k - 1) * dilation - 1) // stride + 1, 0)

    def window_means(self, x: np.ndarray) -> np.ndarray:
        """[C, prod(kernel)]: for each kernel tap, the mean over output positions of the
        (zero-padded) input values it reads, per channel of x [C, *spatial]. The mean
        output of the convolution is then sum over channels and taps of weight x this.

        Each spatial axis is contracted with a 0/1 matrix [taps, positions] marking the
        positions each tap reads (`reads`; padding reads zeros, so it has no column):
        a few small products in float64 instead of a padded copy summed once per tap
        (MobileNet-v1's 350 calls per calibration: 0.75 s -> 0.05 s)."""
        matrices, outputs = self.reads(x.shape[1:])
        sums = np.asarray(x, dtype=np.float64)
        for axis, reads in enumerate(matrices):
            sums = np.moveaxis(np.tensordot(reads, sums, axes=([1], [1 + axis])), 0, 1 + axis)
        return sums.reshape(len(sums), -1) / max(outputs, 1)

    def reads(self, spatial: Sequence[int]) -> tuple[list[np.ndarray], int]:
        """Per spatial axis, which input positions each tap reads ([taps, positions], 0/1),
        and the number of output positions, for an input of size `spatial`."""
        nd = len(self.kernel)
        pads = self.pads_for(spatial)
        matrices, outputs = [], 1
        for axis in range(nd):
            reads, out = self._reads(axis, spatial[axis], pads[axis], pads[axis + nd])
            matrices.append(reads)
            outputs *= out
        return matrices, outputs

    def _reads(self, axis: int, size: int, begin: int, end: int) -> tuple[np.ndarray, int]:
        """[kernel, size] 0/1: which input positions tap t reads along `axis` (positions
        t * dilation - begin + stride * o for each output o, inside the input), and the
        number of outputs along it."""
        k, stride, dilation = self.kernel[axis], self.strides[axis], self.dilations[axis]
        out = self._outputs(axis, size, begin, end)
        reads = np.zeros((k, size))
        for t in range(k):
            positions = t * dilation - begin + stride * np.arange(out)
            reads[t, positions[(positions >= 0) & (positions < size)]] = 1.0
        return reads, out
