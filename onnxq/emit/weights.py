"""Offline quantization of weights, constants and biases (pure numpy, no graph)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.config.resolve import ResolvedSpec
from onnxq.qmath import MIN_SCALE, compute_qparams, int_type, quantize


@dataclass(frozen=True)
class QuantizedTensor:
    """Integer data plus the parameters that dequantize it: (q - zero_point) * scale."""

    data: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None  # per-channel (or per-block) axis of scale/zero_point, None per tensor
    block_size: int | None = None  # per-group: entries of `axis` sharing one scale


def block_range(w: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of each block of `block` entries along `axis` (zero-padded at the end)."""
    w = np.moveaxis(np.asarray(w, dtype=np.float64), axis, 0)
    blocks = -(-w.shape[0] // block)
    pad = blocks * block - w.shape[0]
    if pad:
        w = np.concatenate([w, np.zeros((pad,) + w.shape[1:])])
    w = w.reshape((blocks, block) + w.shape[1:])
    return np.moveaxis(w.min(axis=1), 0, axis), np.moveaxis(w.max(axis=1), 0, axis)


def channel_range(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Min and max over everything but `axis` (over everything when axis is None)."""
    w = np.asarray(w, dtype=np.float64)
    if axis is None or w.ndim == 0:
        return np.asarray(w.min()), np.asarray(w.max())
    axes = tuple(i for i in range(w.ndim) if i != axis)
    return w.min(axis=axes), w.max(axis=axes)


def quantize_weight(
    w: np.ndarray,
    spec: ResolvedSpec,
    axis: int | None,
    min_scale: np.ndarray | float = MIN_SCALE,
    block_size: int | None = None,
) -> QuantizedTensor:
    """Quantize a weight with its min/max range: per tensor (axis None), per channel along
    `axis`, or per block of `block_size` along `axis` (per-group).

    `min_scale` (per channel or scalar) floors the scale; see `bias_safe_weight_scale`.
    """
    if block_size:
        rmin, rmax = block_range(w, axis, block_size)
    else:
        rmin, rmax = channel_range(w, axis)
    scale, zp = compute_qparams(rmin, rmax, spec.dtype, spec.symmetric, spec.scale_type, min_scale)
    q = quantize(w, scale, zp, spec.dtype, axis, spec.round_method, block_size)
    axis = axis if np.ndim(scale) else None
    return QuantizedTensor(q, np.asarray(scale), np.asarray(zp), axis, block_size if axis is not None else None)


def bias_safe_weight_scale(
    bias: np.ndarray, input_scale: float, channels: int, bias_spec: ResolvedSpec
) -> np.ndarray:
    """Smallest weight scale per output channel that keeps bias / (s_in * s_w) in range.

    Channels whose weights are almost zero get tiny scales, and their bias would overflow
    int32; raising such a channel's weight scale costs nothing (its weights round to the
    same few levels) and keeps the bias quantizable. Half the int32 range is left free
    for accumulation.
    """
    limit = int_type(bias_spec.dtype).qmax / 2
    floor = np.abs(np.asarray(bias, dtype=np.float64).reshape(-1)) / (float(input_scale) * limit)
    if floor.size == channels or channels == 1:
        return np.maximum(floor if channels > 1 else floor.max(initial=0.0), MIN_SCALE)
    # grouped ConvTranspose: one weight scale serves several bias entries
    return np.maximum(floor.reshape(-1, channels).max(axis=0), MIN_SCALE)


def quantize_bias(
    bias: np.ndarray, input_scale: np.ndarray, weight_scale: np.ndarray, spec: ResolvedSpec
) -> QuantizedTensor | None:
    """Quantize a bias with scale = input_scale x weight_scale and zero point 0.

    Returns None when a value would overflow the bias dtype (the bias then stays float).
    """
    scale = np.asarray(input_scale, dtype=np.float64) * np.asarray(weight_scale, dtype=np.float64)
    if scale.size > 1 and scale.size != bias.size:
        if bias.size % scale.size:
            return None
        scale = np.tile(scale, bias.size // scale.size)  # grouped ConvTranspose: scales repeat
    scale32 = scale.astype(np.float32)
    info = int_type(spec.dtype)
    ratio = np.rint(np.asarray(bias, dtype=np.float64) / scale32.astype(np.float64))
    if np.any(ratio > info.qmax) or np.any(ratio < info.qmin):
        return None
    zp = np.zeros(scale32.shape, dtype=info.np_dtype)
    return QuantizedTensor(ratio.astype(info.np_dtype), scale32, zp, 0 if scale32.ndim else None)
