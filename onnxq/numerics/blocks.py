"""Block quantization of a weight in com.microsoft::MatMulNBits' stored layout (pure numpy:
the optimisers and the MatMulNBits lowering, `emit/matmul_nbits.py`, share it).

The constant weight W [K, N] is quantized per block of `block_size` consecutive rows
(along K) of each column n and stored in MatMulNBits' layout:

* B: uint8 [N, k_blocks, blob_size], blob_size = block_size * bits / 8; values are stored
  unsigned (signed values shifted by 2^(bits-1)); for 4 bits, element 2i of a block is
  the low nibble of byte i and element 2i+1 the high nibble.
* scales: [N, k_blocks], in the float type of A. Symmetric 4-bit scales are signed, as
  onnxruntime's own quantizer writes them: each block's extreme value lands on -8.
* zero_points: uint8 [N, ceil(k_blocks * bits / 8)] packed like B, only for asymmetric
  quantization; symmetric weights omit it and use the kernel's default 2^(bits-1).

K that is not a multiple of the block size is zero-padded to k_blocks * block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType
from onnxq.numerics.qmath import int_type
from onnxq.numerics.weights import block_importance, plain_rounding, quantize_blocks, round_blocks
from onnxq.parallel import cpu_count, ordered_map

# Bits per code of the types MatMulNBits stores.
BITS: dict[DType, int] = {d: int_type(d).bits for d in (DType.INT4, DType.UINT4, DType.INT8, DType.UINT8)}


@dataclass(frozen=True)
class BlockQuantized:
    """A weight in MatMulNBits' layout (see the module docstring)."""

    packed: np.ndarray  # uint8 [N, k_blocks, blob_size]
    scales: np.ndarray  # [N, k_blocks]
    zero_points: np.ndarray | None  # packed uint8 [N, ceil(k_blocks * bits / 8)], float [N, k_blocks], or None
    k: int
    n: int
    bits: int
    block_size: int


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned `bits`-bit values along the last axis into uint8, low bits first."""
    values = np.asarray(values, dtype=np.uint8)
    per_byte = 8 // bits
    pad = -values.shape[-1] % per_byte
    if pad:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], pad), np.uint8)], axis=-1)
    if bits == 8:
        return values
    if bits == 4:
        return values[..., 0::2] | (values[..., 1::2] << 4)
    grouped = values.reshape(*values.shape[:-1], -1, per_byte).astype(np.uint16)
    shifts = np.arange(per_byte, dtype=np.uint16) * bits
    return np.bitwise_or.reduce(grouped << shifts, axis=-1).astype(np.uint8)


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of `pack_bits`: the first `count` values along the last axis."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (np.asarray(packed, np.uint8)[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :count]


# Columns of W quantized at a time: the transposed slice and the temporaries stay in cache
# (SmolLM2's LM head, [576, 49152]: 0.6 s -> 0.2 s), and each column's result is the same.
CHUNK_ELEMENTS = 1 << 19


def quantize_blockwise(w: np.ndarray, spec: ResolvedSpec, scale_dtype: type = np.float32,
                       clip_search: bool | None = None, importance: np.ndarray | None = None) -> BlockQuantized:
    """Quantize W [K, N] per block of `spec.group_size` rows of each column
    (`onnxq.numerics.weights.quantize_blocks`: full-range signed scales for symmetric 4-bit).

    `importance` [K]: mean square of each input channel of A over calibration data; with
    it the 4-bit clipping search minimises each block's output error. `clip_search`: None
    searches only with `importance`, True always, False never."""
    block = int(spec.group_size)
    k, n = w.shape
    k_blocks = -(-k // block)
    # One block past the row's end is the row: its padding would move HQQ's zero point and
    # the clipping search's sums, and a block narrowed to the row must round the same (review).
    width = min(block, k)
    if importance is not None:
        importance = block_importance(importance, width)
    # optimised float zero points, which MatMulNBits takes in 4-bit blocks; 8-bit ones are
    # rounded onto the grid (onnxruntime refuses float zero points with 8 bits)
    float_zp = spec.calib_method == "hqq" and BITS[spec.dtype] == 4
    columns = max(1, min(CHUNK_ELEMENTS // (k_blocks * block), -(-n // cpu_count())))  # a chunk per core at least
    plain = plain_rounding(spec, clip_search, importance)

    def chunk(start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        part = np.asarray(w[:, start:start + columns], dtype=np.float32)
        if plain:  # blocked in W's own layout [k_blocks, block, columns]; only the packed codes transpose
            q, scale, zp = round_blocks(_blocked(part, block), spec, scale_dtype)
            q, scale, zp = q.transpose(2, 0, 1), scale.T, zp.T
        else:
            padded = np.zeros((part.shape[1], k_blocks * width), dtype=np.float32)
            padded[:, :k] = part.T
            q, scale, zp = quantize_blocks(padded.reshape(-1, width), spec, scale_dtype, clip_search=clip_search,
                                           importance=importance, float_zero_point=float_zp)
            if width < block:  # the stored block's tail: the code of 0.0, as quantizing its zero padding gives
                tail = np.broadcast_to(zero_code(zp, spec)[:, None], (len(q), block - width)).astype(q.dtype)
                q = np.concatenate([q, tail], axis=1)
        return packed_codes(q.reshape(-1, k_blocks, block), spec), scale.reshape(-1, k_blocks), zp.reshape(-1, k_blocks)

    # Chunks on every core (each column's result is its own): AWQ's final clipping of
    # SmolLM2's layers 6.9 s on one core.
    codes, scales, zeros = zip(*ordered_map(chunk, range(0, n, columns)))
    scale, zp = np.concatenate(scales), np.concatenate(zeros)
    bits = BITS[spec.dtype]
    return BlockQuantized(np.concatenate(codes), scale, stored_zero_points(zp, scale.dtype, spec), k, n, bits, block)


def zero_code(zp: np.ndarray, spec: ResolvedSpec) -> np.ndarray:
    """The code 0.0 rounds to in blocks of zero points `zp` (integer or float)."""
    info = int_type(spec.dtype, spec.bits)
    return np.clip(np.rint(np.asarray(zp, np.float64)), info.qmin, info.qmax)


def _blocked(w: np.ndarray, block: int) -> np.ndarray:
    """W [K, N] float32 as [K / block, block, N] blocks along K, zero rows padding the last."""
    k, n = w.shape
    k_blocks = -(-k // block)
    if k != k_blocks * block:
        w = np.concatenate([w, np.zeros((k_blocks * block - k, n), np.float32)])
    return w.reshape(k_blocks, block, n)


def rounded_blockwise(w: np.ndarray, spec: ResolvedSpec, scale_dtype: type = np.float32) -> np.ndarray:
    """W [K, N] plainly rounded to its blocks and back, float32: the values
    `dequantize_blockwise(quantize_blockwise(w, spec))` gives (integer zero points, no
    clipping search), computed in W's own layout without packing the codes, for searches
    that score many roundings (AWQ's candidates: 6.0 -> 2.6 ms on a [1536, 288] slice)."""
    k, n = w.shape
    q, scale, zp = round_blocks(_blocked(np.asarray(w, dtype=np.float32), int(spec.group_size)), spec, scale_dtype)
    out = q.astype(np.float32)
    out -= zp.astype(np.float32)[:, None]
    out *= scale.astype(np.float32)[:, None]
    return out.reshape(-1, n)[:k]


def packed_codes(q: np.ndarray, spec: ResolvedSpec) -> np.ndarray:
    """Signed codes [N, k_blocks, block] packed as MatMulNBits stores them (unsigned)."""
    offset = -int_type(spec.dtype).qmin  # stored unsigned: int4 -8..7 -> 0..15
    return pack_bits((q.astype(np.int16) + offset).astype(np.uint8), BITS[spec.dtype])


def stored_zero_points(zp: np.ndarray, scale_dtype: np.dtype, spec: ResolvedSpec) -> np.ndarray | None:
    """Zero points [N, k_blocks] as MatMulNBits stores them: float ones (HQQ) offset, in the
    scales' type; integer ones packed, or None when all are the kernel's default."""
    bits = BITS[spec.dtype]
    offset = -int_type(spec.dtype).qmin
    if np.issubdtype(zp.dtype, np.floating):
        return (zp.astype(np.float64) + offset).astype(scale_dtype)
    zp_stored = (zp.astype(np.int16) + offset).astype(np.uint8)
    return None if np.all(zp_stored == 1 << (bits - 1)) else pack_bits(zp_stored, bits)


def packed(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, spec: ResolvedSpec, k: int) -> BlockQuantized:
    """Signed codes [N, k_blocks, block] with scales and zero points [N, k_blocks] (integer,
    or float as HQQ gives them) in MatMulNBits' stored layout (module doc)."""
    n, _, block = q.shape
    return BlockQuantized(packed_codes(q, spec), scale, stored_zero_points(zp, scale.dtype, spec), k, n,
                          BITS[spec.dtype], block)


def dequantize_codes(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, block: int,
                     scale_dtype: type) -> np.ndarray:
    """W [K, N] from signed codes [N, K] and integer zero points and scales [N, k_blocks]
    (float64 holding `scale_dtype` values): the values `dequantize_blockwise` gives for
    them once packed ((q - zp) * scale in float32, the difference exact), without the
    packing and unpacking (1.5 s of SmolLM2's GPTQ), each block's parameters broadcast over
    its codes rather than gathered per code."""
    n, k = codes.shape
    zero, scale = zeros.astype(np.float32), scales.astype(scale_dtype).astype(np.float32)
    w = codes.astype(np.float32)
    whole = k // block * block
    blocked = w[:, :whole].reshape(n, -1, block)  # a view: the updates land in w
    blocked -= zero[:, :whole // block, None]
    blocked *= scale[:, :whole // block, None]
    if whole < k:  # the last, partial block
        w[:, whole:] -= zero[:, -1:]
        w[:, whole:] *= scale[:, -1:]
    return w.T


def dequantize_blockwise(bq: BlockQuantized) -> np.ndarray:
    """W [K, N] as MatMulNBits sees it: (q - zero_point) * scale, in float32."""
    k_blocks = bq.scales.shape[1]
    q = unpack_bits(bq.packed, bq.bits, bq.block_size).astype(np.float32)  # [N, k_blocks, block]
    if bq.zero_points is None:
        zp = np.full((bq.n, k_blocks), 1 << (bq.bits - 1), dtype=np.float32)
    elif bq.zero_points.dtype != np.uint8:  # float zero points (hqq)
        zp = bq.zero_points.astype(np.float32)
    else:
        zp = unpack_bits(bq.zero_points, bq.bits, k_blocks).astype(np.float32)
    w = (q - zp[..., None]) * bq.scales.astype(np.float32)[..., None]
    return w.reshape(bq.n, -1)[:, : bq.k].T
