"""Offline quantization of weights, constants and biases (pure numpy, no graph).

Symmetric 4-bit weights use the whole range [-8, 7] (uint4: [0, 15] around 8). Block
weights (per-group, weight-only: no bias, no QLinear kernel reads their scale) do it as
onnxruntime's blockwise quantizer does: the scale is signed, so the block's extreme value,
whatever its sign, lands on -8 and the other side keeps 7 steps. Per-channel and
per-tensor weights keep positive scales (their scales multiply into int32 bias scales):
-8 is used when the negative side is the larger, max(-min/8, max/7).

4-bit block weights can get a clipping-scale search (`search_clip_scales`): for every
block, shrink factors of the scale (`CLIP_GRID`), each with a least-squares refit of the
scale to the codes it gives, are scored by the block's squared reconstruction error,
optionally weighted per input channel by activation importance (mean x^2 over calibration
data), and the best is kept. It is vectorised over all blocks, processed in cache-sized
chunks, deterministic, and never worse than plain rounding for any block by its own
measure. Without importance it is off by default: on SmolLM2-135M (int4, blocks of 128)
the weight-MSE search lowers the weight error by 0.7 dB yet raises perplexity from 24.35 to
36.19, as it shrinks the large weights that meet outlier activations; weighted by
activation importance it lowers it to 20.46 (float 17.06). See benchmarks/llm_int4.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.calibrate.observers.options import parse_options
from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType
from onnxq.numerics.hqq import HqqOptions, hqq_zero_points
from onnxq.numerics.qmath import (
    MIN_SCALE,
    IntType,
    broadcast_param,
    compute_qparams,
    int_type,
    quantize,
    round_scale,
    symmetric_zero_point,
)
from onnxq.target.pairs import enforce_pairs, pair_extent

FOUR_BIT = frozenset({DType.INT4, DType.UINT4})
# Shrink factors of the scale tried per block: 1.0 (plain rounding) down to 0.5.
CLIP_GRID: tuple[float, ...] = tuple(1.0 - 0.05 * i for i in range(11))
# Elements per chunk of the search (1 MiB of float32): its temporaries stay in cache.
# Smaller chunks ran each pass faster alone but spent more of the time holding the GIL,
# so two threads searching chunks of one weight (`quantize_blockwise`) slowed down.
SEARCH_CHUNK = 1 << 18


@dataclass(frozen=True)
class QuantizedTensor:
    """Integer data plus the parameters that dequantize it: (q - zero_point) * scale."""

    data: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None  # per-channel (or per-block) axis of scale/zero_point, None per tensor
    block_size: int | None = None  # per-group: entries of `axis` sharing one scale


def channel_range(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Min and max over everything but `axis` (over everything when axis is None), as
    float64. Floating-point weights are reduced in their own type, which holds their min
    and max exactly (a float64 copy of VGG-19's 400 MB classifier weight took a second)."""
    w = np.asarray(w)
    if not np.issubdtype(w.dtype, np.floating) or w.dtype.itemsize < 4:
        w = w.astype(np.float64)
    if axis is None or w.ndim == 0:
        return np.asarray(w.min(), dtype=np.float64), np.asarray(w.max(), dtype=np.float64)
    axes = tuple(i for i in range(w.ndim) if i != axis)
    return w.min(axis=axes).astype(np.float64), w.max(axis=axes).astype(np.float64)


def full_range(spec: ResolvedSpec) -> bool:
    """Whether a weight of `spec` uses the whole 4-bit range (symmetric int4/uint4)."""
    return bool(spec.symmetric) and DType(spec.dtype) in FOUR_BIT


def full_range_scale(rmin: np.ndarray, rmax: np.ndarray, info: IntType, signed: bool) -> np.ndarray:
    """Unrounded symmetric scale (float64) reaching qmin as well as qmax.

    `signed`: the extreme value of [rmin, rmax] maps to qmin (scale = extreme / -8 for
    int4, negative when the extreme is positive), as onnxruntime's blockwise quantizer
    does. Otherwise the smallest positive scale covering both sides, max(-rmin/8, rmax/7).
    Ranges of zero get scale 1.
    """
    rmin = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    rmax = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    zp = symmetric_zero_point(info)
    below, above = zp - info.qmin, info.qmax - zp  # 8 and 7 steps
    if signed:
        scale = np.where(rmax > -rmin, rmax, rmin) / -below
    else:
        scale = np.maximum(-rmin / below, rmax / above)
    return np.where(scale != 0, scale, 1.0)


def stored_scale(scale: np.ndarray, scale_type: str, min_scale: np.ndarray | float,
                 dtype: type = np.float32) -> np.ndarray:
    """A signed scale as emitted: magnitude floored at `min_scale`, rounded per `scale_type`,
    cast to `dtype`; the sign is kept."""
    scale = np.asarray(scale, dtype=np.float64)
    return cast_scale(np.copysign(round_scale(np.maximum(np.abs(scale), min_scale), scale_type), scale), dtype)


def cast_scale(scale: np.ndarray, dtype: type) -> np.ndarray:
    """`scale` in `dtype`, keeping its sign and never rounding to 0 (float16 underflow)."""
    cast = np.asarray(scale).astype(dtype)
    tiny = np.finfo(dtype).smallest_subnormal
    return np.where(cast == 0, np.where(np.signbit(cast), -tiny, tiny), cast).astype(dtype)


def weight_qparams(
    rmin: np.ndarray, rmax: np.ndarray, spec: ResolvedSpec, min_scale: np.ndarray | float,
    signed: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32) and zero point of a weight range: full 4-bit range for symmetric
    int4/uint4 (signed scales only when `signed`), `compute_qparams` otherwise."""
    if not full_range(spec):
        return compute_qparams(rmin, rmax, spec.dtype, spec.symmetric, spec.scale_type, min_scale, spec.bits)
    info = int_type(spec.dtype, spec.bits)
    scale = stored_scale(full_range_scale(rmin, rmax, info, signed), spec.scale_type, min_scale)
    return scale, np.full(scale.shape, symmetric_zero_point(info)).astype(info.np_dtype)


def quantize_weight(
    w: np.ndarray,
    spec: ResolvedSpec,
    axis: int | None,
    min_scale: np.ndarray | float = MIN_SCALE,
    block_size: int | None = None,
    clip_search: bool | None = None,
    importance: np.ndarray | None = None,
    scale_dtype: type = np.float32,
) -> QuantizedTensor:
    """Quantize a weight with its min/max range: per tensor (axis None), per channel along
    `axis`, or per block of `block_size` along `axis` (per-group: see `quantize_blocks` for
    `clip_search`, `importance` and `scale_dtype`, here one weight per entry of `axis`).

    `min_scale` (per channel or scalar) floors the scale; see `bias_safe_weight_scale`.
    """
    if block_size:
        return _quantize_weight_blocks(w, spec, axis, block_size, min_scale, clip_search, importance, scale_dtype)
    rmin, rmax = channel_range(w, axis)
    if spec.pairs is not None:  # symmetric int8 that a saturating kernel must hold exactly
        rmax = np.maximum(np.maximum(-rmin, rmax), pair_extent(w, axis, spec.pairs))
        rmin = -rmax
    scale, zp = weight_qparams(rmin, rmax, spec, min_scale)
    q = quantize(w, scale, zp, spec.dtype, axis, spec.round_method, None, spec.bits)
    if spec.pairs is not None:
        scaled = w / broadcast_param(np.asarray(scale, dtype=np.float64), w.shape, axis if np.ndim(scale) else None)
        q = enforce_pairs(q, scaled, axis, spec.pairs)
    axis = axis if np.ndim(scale) else None
    return QuantizedTensor(q, np.asarray(scale), np.asarray(zp), axis)


def _quantize_weight_blocks(
    w: np.ndarray, spec: ResolvedSpec, axis: int, block: int, min_scale: np.ndarray | float,
    clip_search: bool | None, importance: np.ndarray | None, scale_dtype: type = np.float32,
) -> QuantizedTensor:
    """`quantize_weight` per block: blocks laid out as rows, quantized, laid back."""
    moved = np.moveaxis(np.asarray(w, dtype=np.float32), axis, -1)
    length, lead = moved.shape[-1], moved.shape[:-1]
    count = -(-length // block)
    # A block past the row's end is the row: its padding would be zeros alone, which change
    # no range or error (a mistyped 100000 had asked for an 18 GB temporary).
    width = min(block, length)
    if count * width != length:
        moved = np.concatenate([moved, np.zeros((*lead, count * width - length), np.float32)], axis=-1)
    if importance is not None:
        importance = block_importance(importance, width)
    q, scale, zp = quantize_blocks(moved.reshape(-1, width), spec, scale_dtype, min_scale=min_scale,
                                   clip_search=clip_search, importance=importance)
    q = np.moveaxis(q.reshape(*lead, count * width)[..., :length], -1, axis)
    scale, zp = (np.moveaxis(p.reshape(*lead, count), -1, axis) for p in (scale, zp))
    return QuantizedTensor(q, scale, zp, axis, block)


def searchable(spec: ResolvedSpec) -> bool:
    """Whether `spec`'s block weights get the clipping search (4-bit, round to nearest even)."""
    return DType(spec.dtype) in FOUR_BIT and spec.round_method == "half_even"


def block_importance(importance: np.ndarray, block: int) -> np.ndarray:
    """Per-entry importance along the blocked axis as [blocks, block] rows (zero-padded)."""
    importance = np.asarray(importance, dtype=np.float32).reshape(-1)
    rows = np.zeros(-(-importance.size // block) * block, dtype=np.float32)
    rows[: importance.size] = importance
    return rows.reshape(-1, block)


def quantize_blocks(
    blocks: np.ndarray,
    spec: ResolvedSpec,
    scale_dtype: type = np.float32,
    min_scale: np.ndarray | float = MIN_SCALE,
    clip_search: bool | None = None,
    grid: tuple[float, ...] = CLIP_GRID,
    importance: np.ndarray | None = None,
    float_zero_point: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize each row of `blocks` [M, block] with its own scale and zero point.

    `spec.calib_method` hqq optimises each zero point (`numerics.hqq`): a float one when
    `float_zero_point` (MatMulNBits takes it), else rounded onto the grid.

    Returns the codes [M, block] (in the dtype), scales [M] (`scale_dtype`, the type the
    kernel reads, so rounding happens with the scale it will use) and zero points [M].
    Symmetric 4-bit blocks use signed full-range scales. 4-bit blocks rounded half to even
    go through `search_clip_scales` over `grid` when `clip_search` is True, or when it is
    None and `importance` is given (see `search_clip_scales`); otherwise plain rounding.
    """
    blocks = np.asarray(blocks, dtype=np.float32)
    if plain_rounding(spec, clip_search, importance):
        rows = np.reshape(min_scale, (-1, 1)) if np.ndim(min_scale) else min_scale
        q, scale, zp = round_blocks(blocks[:, :, None], spec, scale_dtype, rows)
        return q[:, :, 0], scale[:, 0], zp[:, 0]
    scale, zp = weight_qparams(blocks.min(axis=1), blocks.max(axis=1), spec, min_scale, signed=True)
    scale = cast_scale(scale, scale_dtype)
    if spec.calib_method == "hqq":
        return _hqq_blocks(blocks, scale, zp, spec, float_zero_point)
    q, scale = search_clip_scales(blocks, scale, zp, spec, min_scale, grid, importance)
    return q, scale, zp


def plain_rounding(spec: ResolvedSpec, clip_search: bool | None, importance: np.ndarray | None) -> bool:
    """Whether `quantize_blocks` rounds each block plainly with its min/max scale: no HQQ
    and no clipping search (which only 4-bit weights get; see `quantize_blocks`)."""
    search = importance is not None if clip_search is None else clip_search
    return spec.calib_method != "hqq" and not (search and searchable(spec))


def round_blocks(blocks: np.ndarray, spec: ResolvedSpec, scale_dtype: type = np.float32,
                 min_scale: np.ndarray | float = MIN_SCALE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain rounding of blocks laid along axis 1 of `blocks` [R, block, C], each with its
    min/max scale (signed full range for symmetric 4-bit): codes [R, block, C], scales
    (`scale_dtype`) and zero points [R, C]. A weight [K, N] is blocked along K as
    [K / block, block, N] without a transposed copy, and the reductions run along
    contiguous rows (SmolLM2's weights, block 32, one core: 2.3 s -> 1.2 s)."""
    scale, zp = weight_qparams(blocks.min(axis=1), blocks.max(axis=1), spec, min_scale, signed=True)
    scale = cast_scale(scale, scale_dtype)
    q = quantize(blocks, scale[:, None], zp[:, None], spec.dtype, round_method=spec.round_method, bits=spec.bits)
    return q, scale, zp


def _hqq_blocks(blocks: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: ResolvedSpec,
                float_zero_point: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    info = int_type(spec.dtype, spec.bits)
    options = parse_options(HqqOptions, "hqq", spec.calib_options)
    z = hqq_zero_points(blocks, scale, zp.astype(np.float64), info, options)
    if not float_zero_point:
        z = np.clip(np.rint(z), info.qmin, info.qmax)
    q = np.clip(np.rint(blocks / scale.astype(np.float64)[:, None] + z[:, None]), info.qmin, info.qmax)
    return q.astype(info.np_dtype), scale, z.astype(np.float32) if float_zero_point else z.astype(info.np_dtype)


def search_clip_scales(
    blocks: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray,
    spec: ResolvedSpec,
    min_scale: np.ndarray | float = MIN_SCALE,
    grid: tuple[float, ...] = CLIP_GRID,
    importance: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of each block [M, block] minimising sum(h * (w - (q - zp) * scale)^2).

    h is 1, or `importance` [P, block]: block row r is weighted by importance[r % P] (per
    input channel mean x^2 of the activation the weight multiplies, so the error measured
    is that of the block's output; P = blocks per column). For each shrink factor a of
    `grid` the block is rounded with scale * a (zero points are kept: shrinking [rmin, rmax]
    toward zero leaves them unchanged), and both scale * a and the weighted least-squares
    scale of the codes it gives are scored. A block keeps plain rounding (a = 1) unless a
    candidate is strictly better when rechecked in float64 with the stored scale; an empty
    `grid` is plain rounding (codes equal to `quantize`'s). Works in chunks of
    `SEARCH_CHUNK` elements.
    """
    info = int_type(spec.dtype, spec.bits)
    rows = max(1, SEARCH_CHUNK // max(1, blocks.shape[1]))
    q = np.empty(blocks.shape, dtype=info.np_dtype)
    out = np.empty_like(scale)
    for start in range(0, len(blocks), rows):
        part = slice(start, start + rows)
        h = None
        if importance is not None and grid:
            h = importance[np.arange(start, min(start + rows, len(blocks))) % len(importance)]
        codes, out[part] = _search_chunk(blocks[part], scale[part], zero_point[part], info, spec,
                                         min_scale if np.ndim(min_scale) == 0 else min_scale[part], grid, h)
        q[part] = codes.astype(info.np_dtype)
    return q, out


def _codes(x: np.ndarray, factor: np.ndarray | np.float32, shift: np.ndarray | np.float32, info: IntType,
           out: np.ndarray | None = None) -> np.ndarray:
    """clip(rint(x * factor) + shift, qmin, qmax) - shift in float32: codes relative to the
    zero point `shift` (a scalar or one per row). The same values as clipping to
    [qmin - shift, qmax - shift] (integers, exact in float32); numpy's clip with per-row
    bounds ran 1.5x slower than the add, the scalar clip and the subtraction together."""
    c = np.multiply(x, factor, out=out)
    np.rint(c, out=c)
    if np.ndim(shift) == 0:
        return np.clip(c, info.qmin - shift, info.qmax - shift, out=c)
    c += shift
    np.clip(c, info.qmin, info.qmax, out=c)
    c -= shift
    return c


def _block_error(w: np.ndarray, codes: np.ndarray, scale: np.ndarray, h: np.ndarray | None) -> np.ndarray:
    """(Weighted) squared error per row in float64 of the float32 dequantization codes * scale."""
    r = w.astype(np.float64) - codes * scale.astype(np.float32)[:, None]
    return np.einsum("ij,ij->i", r if h is None else r * h, r)


def _search_chunk(
    w: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, info: IntType, spec: ResolvedSpec,
    min_scale: np.ndarray | float, grid: tuple[float, ...], h: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`search_clip_scales` on one chunk (weights `h` or None): integer codes (zero point
    included) and scales."""
    s0 = scale.astype(np.float64)
    z = zero_point.astype(np.float32)[:, None]
    shift = z[0, 0] if spec.symmetric else z  # one zero point for all: clip to scalars
    x = w / scale.astype(np.float32)[:, None]  # QuantizeLinear's float32 division
    plain = _codes(x, np.float32(1.0), shift, info)
    if not grid:
        return (plain + z).astype(np.int16), scale
    hx = x if h is None else h * x
    xx = np.einsum("ij,ij->i", hx, x, dtype=np.float64)
    factors = np.float32(1.0) / np.asarray(grid, dtype=np.float32)
    best_e, best_k, best_s = np.full(len(x), np.inf), np.zeros(len(x), np.intp), s0.copy()
    buffer, weighted = np.empty_like(x), np.empty_like(x)
    for k, factor in enumerate(factors):
        c = plain if factor == 1 else _codes(x, factor, shift, info, out=buffer)
        xc = np.einsum("ij,ij->i", hx, c).astype(np.float64)
        cc = np.einsum("ij,ij->i", c if h is None else np.multiply(h, c, out=weighted), c).astype(np.float64)
        refit = np.where(cc > 0, xc / np.where(cc > 0, cc, 1.0), grid[k])
        for t in (np.full(len(x), grid[k]), refit):
            s = stored_scale(s0 * t, spec.scale_type, min_scale, scale.dtype).astype(np.float64)
            t_used = s / s0  # error in units of s0^2: sum(h (x - t c)^2)
            e = xx - 2.0 * t_used * xc + t_used * t_used * cc
            better = e < best_e
            best_e[better], best_k[better], best_s[better] = e[better], k, s[better]
    codes = _codes(x, factors[best_k][:, None], shift, info)
    keep = _block_error(w, codes, best_s, h) < _block_error(w, plain, s0, h)
    codes = np.where(keep[:, None], codes, plain)
    return (codes + z).astype(np.int16), np.where(keep, best_s, s0).astype(scale.dtype)


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
    if not np.all(np.isfinite(scale32)) or np.any(scale32 <= 0):
        return None  # an input range past float32 (a masking value in the data): no grid holds the bias
    info = int_type(spec.dtype)
    ratio = np.rint(np.asarray(bias, dtype=np.float64) / scale32.astype(np.float64))
    if not np.all(np.isfinite(ratio)) or np.any(ratio > info.qmax) or np.any(ratio < info.qmin):
        return None
    zp = np.zeros(scale32.shape, dtype=info.np_dtype)
    return QuantizedTensor(ratio.astype(info.np_dtype), scale32, zp, 0 if scale32.ndim else None)
