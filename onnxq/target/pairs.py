"""Pair-safe int8 weights: the largest 8-bit scale that the saturating x86 kernels hold.

On AVX2/AVX512-BW without VNNI, onnxruntime's u8 x s8 kernels add the products of each
pair of adjacent weights along the reduction axis K in int16 (`vpmaddubsw`). For any
uint8 activation the pair (w0, w1) is exact iff |w0 + w1| <= 128 (docs/kernels.md,
section 2). 7-bit weights (|w| <= 64) meet that by halving every channel's resolution.
Most pairs are far from the limit, so instead each channel gets the scale

    s = max(max|w|, max over pairs |w[2j] + w[2j+1]|) / 127,

which keeps |q| <= 127 and |q0 + q1| <= 127 + 1 (each code rounds by at most 1/2): never
coarser than 7 bits (a pair sum is at most 2 max|w|) and usually about 1.5x finer. Codes
are checked afterwards and the rare pair pushed over 128 by a rounded scale is pulled
back by one step, so the guarantee holds whatever the scale type.

K order (which weights pair up) depends on the kernel: MatMul and Gemm reduce along one
weight axis; QLinearConv flattens (taps, input channel) tap-major through the GEMM, and the
ConvSym kernel pairs input channels within each tap. `k_axes` lists the weight's reduction
axes major to minor; both pairings are held.
"""

from __future__ import annotations

import numpy as np

PAIR_LIMIT = 128  # |w0 + w1| of raw int8 codes that 2 x 255 x w cannot push past int16


def pair_indices(shape: tuple[int, ...], axis: int | None, k_axes: tuple[int, ...]) -> list[np.ndarray]:
    """Flat indices [channels, pairs, 2] of every weight pair the kernels add in int16.

    `axis` is the per-channel axis (None: one channel). Index -1 stands for the zero
    padding of an odd K.
    """
    ndim = len(shape)
    idx = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    lead = [axis] if axis is not None else []
    pairings = [tuple(k_axes)]
    if len(k_axes) > 1:
        pairings.append((k_axes[-1],))  # pairs within one tap (ConvSym)
    out = []
    for k in pairings:
        rest = [a for a in range(ndim) if a not in lead and a not in k]
        t = np.transpose(idx, lead + rest + list(k))
        channels = shape[axis] if axis is not None else 1
        size_k = int(np.prod([shape[a] for a in k]))
        t = t.reshape(channels, -1, size_k)
        if size_k % 2:
            t = np.concatenate([t, np.full(t.shape[:2] + (1,), -1, dtype=np.int64)], axis=2)
        out.append(t.reshape(channels, -1, 2))
    return out


def _gather(flat: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.append(flat, 0)[index]  # index -1 reads the appended zero


def pair_extent(w: np.ndarray, axis: int | None, k_axes: tuple[int, ...]) -> np.ndarray:
    """Per channel (scalar when `axis` is None): the largest |w0 + w1| over kernel pairs."""
    flat = np.asarray(w, dtype=np.float64).ravel()
    ext = np.zeros(w.shape[axis] if axis is not None else 1)
    for pairs in pair_indices(w.shape, axis, k_axes):
        if pairs.shape[1]:
            ext = np.maximum(ext, np.abs(_gather(flat, pairs).sum(axis=2)).max(axis=1))
    return ext if axis is not None else ext.reshape(())


def enforce_pairs(q: np.ndarray, w_scaled: np.ndarray, axis: int | None, k_axes: tuple[int, ...]) -> np.ndarray:
    """`q` with every kernel pair within |q0 + q1| <= 128: the code that rounded furthest
    away from its real value `w_scaled` (= w / scale) steps back toward zero."""
    q = np.array(q, copy=True)
    flat_q = q.reshape(-1)
    flat_w = np.asarray(w_scaled, dtype=np.float64).ravel()
    for pairs in pair_indices(q.shape, axis, k_axes):
        while True:
            sums = _gather(flat_q.astype(np.int64), pairs).sum(axis=2)
            bad = np.abs(sums) > PAIR_LIMIT
            if not bad.any():
                break
            cand = pairs[bad]  # [n, 2]
            sign = np.sign(sums[bad])[:, None]
            score = (_gather(flat_q.astype(np.float64), cand) - _gather(flat_w, cand)) * sign
            score = np.where(cand >= 0, score, -np.inf)  # never the padding
            pick = cand[np.arange(len(cand)), np.argmax(score, axis=1)]
            flat_q[pick] = (flat_q[pick].astype(np.int64) - np.sign(sums[bad]).astype(np.int64)).astype(q.dtype)
    return q
