"""Forward and backward passes in numpy for the ops of an emitted block, one entry per op type.

Block reconstruction (`block_fit.py`) differentiates a block of the emitted (QDQ) graph
with respect to its layers' weights: convolutions, matrix products, the activations
emission kept, residual Adds, pooling, reshapes (the activations are `activation.py`'s), and each activation's QuantizeLinear ->
DequantizeLinear pair, which rounds as deployed and passes the gradient straight through
where it does not saturate (the straight-through estimator; where it saturates, as an
absorbed ReLU6 does, the gradient is 0). Each op is `Op(forward, backward)`:

    forward(node, inputs) -> (output, cache)
    backward(node, cache, d_output, wanted) -> [d_input or None per input]

with `wanted[i]` False where input i needs no gradient (a constant, or a tensor nothing
learnable feeds). Arrays are float32, channels first (NCHW), as onnxruntime lays them out.
An op type missing from `OPS` makes the block ineligible (`blocks.py` says which).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.graph import layout
from onnxq.numerics.qmath import INT_TYPES, broadcast_param
from onnxq.optimize.layerwise.activation import ACTIVATIONS, Activation
from onnxq.optimize.layerwise.gram import conv_patches

Array = np.ndarray
Grads = list[Array | None]


@dataclass(frozen=True)
class Op:
    forward: Callable[[ir.Node, Sequence[Array | None]], tuple[Array, Any]]
    backward: Callable[[ir.Node, Any, Array, Sequence[bool]], Grads]


def _unbroadcast(grad: Array, shape: tuple[int, ...]) -> Array:
    """Sum `grad` down to `shape` (numpy broadcasting undone)."""
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


# ---------------------------------------------------------------- convolution

def _conv_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x, w = ins[0], ins[1]
    b = ins[2] if len(ins) > 2 else None
    kernel = tuple(w.shape[2:])
    g = layout.groups(node)
    cols = conv_patches(node, x, kernel)  # [g, C/g * prod(kernel), B * positions]
    wm = w.reshape(g, w.shape[0] // g, -1)
    geometry = layout.ConvGeometry.of(node, kernel)
    pads = geometry.pads_for(x.shape[2:])
    out = geometry.output_shape(x.shape[2:])
    y = np.matmul(wm, cols).reshape(w.shape[0], x.shape[0], *out)
    y = np.ascontiguousarray(np.moveaxis(y, 1, 0))
    if b is not None:
        y += b.reshape(1, -1, *([1] * len(kernel)))
    return y, (cols, wm, x.shape, w.shape, geometry, pads, out)


def _conv_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    cols, wm, x_shape, w_shape, geometry, pads, out = cache
    g = layout.groups(node)
    nd = len(out)
    dyt = np.moveaxis(dy, 1, 0).reshape(g, w_shape[0] // g, -1)  # [g, M, B * positions]
    grads: Grads = [None] * 3
    if wanted[1]:
        grads[1] = np.matmul(dyt, cols.transpose(0, 2, 1)).reshape(w_shape)
    if len(wanted) > 2 and wanted[2]:
        grads[2] = dy.sum(axis=(0, *range(2, 2 + nd)))
    if wanted[0]:
        dcols = np.matmul(wm.transpose(0, 2, 1), dyt)  # [g, C/g * prod(kernel), B * positions]
        kernel = tuple(w_shape[2:])
        dcols = dcols.reshape(x_shape[1], *kernel, x_shape[0], *out)
        padded = [x_shape[2 + i] + pads[i] + pads[i + nd] for i in range(nd)]
        dxp = np.zeros((x_shape[0], x_shape[1], *padded), dtype=np.float32)
        for tap in np.ndindex(*kernel):
            where = tuple(slice(t * d, t * d + s * (o - 1) + 1, s)
                          for t, d, s, o in zip(tap, geometry.dilations, geometry.strides, out))
            dxp[(slice(None), slice(None), *where)] += np.moveaxis(dcols[(slice(None), *tap)], 1, 0)
        grads[0] = dxp[(slice(None), slice(None), *(slice(pads[i], pads[i] + x_shape[2 + i]) for i in range(nd)))]
    return grads


# ---------------------------------------------------------------- matrix products

def _gemm_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    ta, tb = layout.gemm_transposes(node)
    alpha, beta = np.float32(layout.attr(node, "alpha", 1.0)), np.float32(layout.attr(node, "beta", 1.0))
    am, bm = (a.T if ta else a), (b.T if tb else b)
    y = alpha * (am @ bm)
    if c is not None:
        y = y + beta * c
    return y.astype(np.float32, copy=False), (am, bm, ta, tb, alpha, beta, None if c is None else c.shape)


def _gemm_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    am, bm, ta, tb, alpha, beta, c_shape = cache
    grads: Grads = [None] * 3
    if wanted[0]:
        da = alpha * (dy @ bm.T)
        grads[0] = da.T if ta else da
    if wanted[1]:
        db = alpha * (am.T @ dy)
        grads[1] = db.T if tb else db
    if len(wanted) > 2 and wanted[2] and c_shape is not None:
        grads[2] = _unbroadcast(beta * dy, c_shape)
    return grads


def _matmul_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    a, b = ins[0], ins[1]
    if b.ndim != 2:
        raise NotImplementedError("MatMul with a batched second input")
    return a @ b, (a, b)


def _matmul_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    a, b = cache
    grads: Grads = [None, None]
    if wanted[0]:
        grads[0] = dy @ b.T
    if wanted[1]:
        grads[1] = a.reshape(-1, a.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
    return grads


# ---------------------------------------------------------------- quantization

def _qparams(node: ir.Node, ins: Sequence[Array | None], ndim: int) -> tuple[Array, Array]:
    """Scale and zero point, laid along the node's axis where they are per axis."""
    scale = ins[1].astype(np.float32)
    zp = ins[2].astype(np.float32) if len(ins) > 2 and ins[2] is not None else np.zeros_like(scale)
    axis = int(layout.attr(node, "axis", 1)) if scale.size > 1 else None
    return broadcast_param(scale, ndim, axis), broadcast_param(zp, ndim, axis)


# Code ranges by the zero point's type (`blocks.py` refuses a QuantizeLinear without one).
CODE_RANGES = {np.dtype(t.np_dtype): (t.qmin, t.qmax) for t in INT_TYPES.values()}


def _quantize_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x = ins[0]
    scale, zp = _qparams(node, ins, x.ndim)
    lo, hi = CODE_RANGES[np.dtype(ins[2].dtype)]
    u = np.rint(x / scale) + zp
    inside = (u >= lo) & (u <= hi)
    return np.clip(u, lo, hi).astype(np.float32), (inside, scale)


def _quantize_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    inside, scale = cache
    return [np.where(inside, dy / scale, np.float32(0)).astype(np.float32) if wanted[0] else None]


def _dequantize_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    q = ins[0].astype(np.float32)
    scale, zp = _qparams(node, ins, q.ndim)
    return ((q - zp) * scale).astype(np.float32), scale


def _dequantize_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    return [dy * cache if wanted[0] else None]


# ---------------------------------------------------------------- elementwise

def activation_of(node: ir.Node) -> Activation | None:
    """The node's function and derivative from `activation.py` (the layer-wise loss's table)."""
    make = ACTIVATIONS.get(node.op_type)
    return make(node, (1, 1), 0) if make is not None and node.op_type != "PRelu" else None


def _activation_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    f = activation_of(node)
    return f.forward(ins[0]).astype(np.float32, copy=False), f.derivative(ins[0])


def _slope_backward(node: ir.Node, slope: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    return [dy * slope if wanted[0] else None]


def _add_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    return (ins[0] + ins[1]).astype(np.float32, copy=False), (ins[0].shape, ins[1].shape)


def _add_backward(node: ir.Node, shapes: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    return [_unbroadcast(dy, shapes[i]) if wanted[i] else None for i in range(2)]


def _mul_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    return (ins[0] * ins[1]).astype(np.float32, copy=False), (ins[0], ins[1])


def _mul_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    a, b = cache
    return [_unbroadcast(dy * b, a.shape) if wanted[0] else None,
            _unbroadcast(dy * a, b.shape) if wanted[1] else None]


# ---------------------------------------------------------------- pooling and shapes

def _gap_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x = ins[0]
    axes = tuple(range(2, x.ndim))
    return x.mean(axis=axes, keepdims=True), x.shape


def _gap_backward(node: ir.Node, shape: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    count = math.prod(shape[2:])
    return [np.broadcast_to(dy / np.float32(count), shape).astype(np.float32) if wanted[0] else None]


def _flatten_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x = ins[0]
    axis = int(layout.attr(node, "axis", 1))
    axis += x.ndim if axis < 0 else 0
    return x.reshape(math.prod(x.shape[:axis]), -1), x.shape


def _reshape_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x, shape = ins[0], [int(s) for s in ins[1]]
    if not layout.attr(node, "allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape), x.shape


def _squeeze_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x = ins[0]
    axes = ins[1] if len(ins) > 1 and ins[1] is not None else layout.attr(node, "axes", None)
    squeezed = np.squeeze(x, axis=None if axes is None else tuple(int(a) for a in np.ravel(axes)))
    return squeezed, x.shape


def _unsqueeze_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    x = ins[0]
    axes = ins[1] if len(ins) > 1 and ins[1] is not None else layout.attr(node, "axes", [])
    return np.expand_dims(x, tuple(int(a) for a in np.ravel(axes))), x.shape


def _reshape_backward(node: ir.Node, shape: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    return [dy.reshape(shape) if wanted[0] else None]


def _identity_forward(node: ir.Node, ins: Sequence[Array | None]) -> tuple[Array, Any]:
    return ins[0], None


def _identity_backward(node: ir.Node, cache: Any, dy: Array, wanted: Sequence[bool]) -> Grads:
    return [dy if wanted[0] else None]


OPS: dict[str, Op] = {
    "Conv": Op(_conv_forward, _conv_backward),
    "Gemm": Op(_gemm_forward, _gemm_backward),
    "MatMul": Op(_matmul_forward, _matmul_backward),
    "QuantizeLinear": Op(_quantize_forward, _quantize_backward),
    "DequantizeLinear": Op(_dequantize_forward, _dequantize_backward),
    "Relu": Op(_activation_forward, _slope_backward),
    "Clip": Op(_activation_forward, _slope_backward),
    "LeakyRelu": Op(_activation_forward, _slope_backward),
    "Sigmoid": Op(_activation_forward, _slope_backward),
    "Tanh": Op(_activation_forward, _slope_backward),
    "Gelu": Op(_activation_forward, _slope_backward),
    "Add": Op(_add_forward, _add_backward),
    "Mul": Op(_mul_forward, _mul_backward),
    "GlobalAveragePool": Op(_gap_forward, _gap_backward),
    "Flatten": Op(_flatten_forward, _reshape_backward),
    "Reshape": Op(_reshape_forward, _reshape_backward),
    "Squeeze": Op(_squeeze_forward, _reshape_backward),
    "Unsqueeze": Op(_unsqueeze_forward, _reshape_backward),
    "Identity": Op(_identity_forward, _identity_backward),
}
