"""Sufficient statistics of a layer's squared output error, accumulated as data streams.

For inputs extended by a constant 1 (so the bias is the last weight column), the error of
weights V on quantized inputs against float weights W on float inputs is

    sum_p |V xq_p - W xf_p|^2 = tr(V H V^T) - 2 tr(V T^T) + E,
    H = sum_p xq_p xq_p^T,  T = W C^T with C = sum_p xq_p xf_p^T,  E = sum_p |W xf_p|^2,

per group, over every position p of every sample. H and C are [g, K+1, K+1] in float64.
When the layer's loss runs through its activation (`sampled.py`), an evenly strided
sample of the positions is kept too: quantized input patches and float outputs, up to
`sample_cap` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from numpy.lib.stride_tricks import sliding_window_view

from onnxq.graph import layout

# Bytes of im2col patches formed at once; a batch is split by samples to stay below.
PATCH_BYTES = 64 << 20


def conv_patches(node: ir.Node, x: np.ndarray, kernel: tuple[int, ...], stride: int = 1, offset: int = 0) -> np.ndarray:
    """im2col of a convolution input x [B, C, *spatial]: [g, C/g * prod(kernel), B * positions],
    keeping every `stride`-th output position along each spatial axis from `offset`."""
    nd = len(kernel)
    geometry = layout.ConvGeometry.of(node, kernel)
    strides, dilations = geometry.strides, geometry.dilations
    pads = geometry.pads_for(x.shape[2:])
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + nd]) for i in range(nd)])
    span = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations))
    win = sliding_window_view(xp, span, axis=tuple(range(2, 2 + nd)))
    win = win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
              + tuple(slice(None, None, d) for d in dilations)]
    if stride > 1:
        win = win[(slice(None), slice(None)) + tuple(slice(offset % stride, None, stride) for _ in range(nd))]
    batch, channels = x.shape[:2]
    out = win.shape[2:2 + nd]
    perm = (1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd))
    g = layout.groups(node)
    return np.ascontiguousarray(win.transpose(perm)).reshape(g, channels // g * math.prod(kernel),
                                                             batch * math.prod(out))


def patches(node: ir.Node, x: np.ndarray, kernel: tuple[int, ...], stride: int = 1, offset: int = 0) -> np.ndarray:
    """The layer input as columns [g, K, P] that its weight matrices multiply (every
    `stride`-th position along each spatial axis, or every stride-th row, from `offset`)."""
    x = np.asarray(x, dtype=np.float32)
    if node.op_type == "Conv":
        return conv_patches(node, x, kernel, stride, offset)
    cols = x.reshape(-1, x.shape[-1])[offset % stride::stride].T
    if node.op_type == "Gemm":
        cols = cols * np.float32(layout.attr(node, "alpha", 1.0))
    return cols[None]


def position_stride(node: ir.Node, x: np.ndarray, kernel: tuple[int, ...], samples: int, cap: int) -> int:
    """The subsampling stride that keeps a layer's positions over `samples` samples near
    `cap` (at least 1): the statistics of a K x K matrix need far fewer positions than
    the early layers of a convolutional network have."""
    if node.op_type == "Conv":
        per_sample = math.prod(x.shape[2:]) if x.ndim > 2 else 1
        total = per_sample * samples
        return max(1, math.isqrt(max(total // max(cap, 1), 1)))
    rows = (x.size // max(x.shape[-1], 1)) // max(len(x), 1) * samples
    return max(1, rows // max(cap, 1))


def _sample_chunks(node: ir.Node, x: np.ndarray, kernel: tuple[int, ...]) -> int:
    """Samples per chunk so that a chunk's patches stay under `PATCH_BYTES`."""
    if node.op_type != "Conv" or x.ndim < 2:
        return max(1, x.shape[0] if x.ndim else 1)
    per_sample = x[0].size * math.prod(kernel) * 4
    return max(1, PATCH_BYTES // max(per_sample, 1))


@dataclass
class Gram:
    """H, C and E (see module doc) and the positions seen."""

    h: np.ndarray
    c: np.ndarray
    kernel: tuple[int, ...]  # a convolution's kernel shape, () for matrix layers
    stride: int = 1  # every stride-th position per spatial axis (rows for matrix layers)
    energy: float = 0.0
    positions: int = 0
    chunks: int = 0
    sample_cap: int = 0  # positions of the sample to keep (0: none)
    samples: int = 0  # calibration samples the data has (to stride the sample evenly)
    sample_every: int = 0
    kept_x: list[np.ndarray] = field(default_factory=list)
    kept_y: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def empty(cls, groups: int, k: int, kernel: tuple[int, ...], stride: int = 1, sample_cap: int = 0,
              samples: int = 0) -> Gram:
        return cls(np.zeros((groups, k + 1, k + 1)), np.zeros((groups, k + 1, k + 1)), kernel, stride,
                   sample_cap=sample_cap, samples=samples)

    def _keep(self, q: np.ndarray, y: np.ndarray, chunk_samples: int, offset: int) -> None:
        if not self.sample_every:
            total = q.shape[2] / max(chunk_samples, 1) * max(self.samples, chunk_samples)
            self.sample_every = max(1, math.ceil(total / self.sample_cap))
        pick = slice(offset % self.sample_every, None, self.sample_every)
        x = q[:, :, pick]
        self.kept_x.append(np.concatenate([x, np.ones((x.shape[0], 1, x.shape[2]), np.float32)], axis=1))
        self.kept_y.append(np.ascontiguousarray(y[:, :, pick]))  # a view would pin the whole chunk

    def sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The kept positions: input patches with a row of ones [g, K+1, P] and float
        outputs [g, M, P]."""
        return np.concatenate(self.kept_x, axis=2), np.concatenate(self.kept_y, axis=2)

    def update(self, node: ir.Node, w: np.ndarray, xq: np.ndarray, xf: np.ndarray) -> None:
        """Add one batch of the layer's quantized and float inputs (`w`: the float
        weights [g, M, K+1] with the bias column, for the energy)."""
        step = _sample_chunks(node, xq, self.kernel)
        w32 = w.astype(np.float32)
        for start in range(0, max(len(xq), 1), step):
            offset, self.chunks = self.chunks, self.chunks + 1  # positions taken rotate chunk by chunk
            q = patches(node, xq[start:start + step], self.kernel, self.stride, offset)
            f = patches(node, xf[start:start + step], self.kernel, self.stride, offset)
            k, count = q.shape[1], q.shape[2]
            self.h[:, :k, :k] += q @ q.transpose(0, 2, 1)
            self.c[:, :k, :k] += q @ f.transpose(0, 2, 1)
            qs, fs = q.sum(axis=2, dtype=np.float64), f.sum(axis=2, dtype=np.float64)
            self.h[:, :k, k] += qs
            self.h[:, k, :k] += qs
            self.c[:, :k, k] += qs
            self.c[:, k, :k] += fs
            self.h[:, k, k] += count
            self.c[:, k, k] += count
            y = w32[:, :, :k] @ f + w32[:, :, k:]
            self.energy += float(np.einsum("gmp,gmp->", y, y, dtype=np.float64))
            self.positions += count
            if self.sample_cap:
                self._keep(q, y, len(xq[start:start + step]), offset)
