"""Weight-only block quantization of MatMul into onnxruntime's com.microsoft::MatMulNBits.

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

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config
from onnxq.emit.lowering import LoweringReport, claimed_nodes, register_lowering
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.graph.load import drop_pages
from onnxq.numerics.qmath import int_type
from onnxq.numerics.weights import block_importance, plain_rounding, quantize_blocks, round_blocks
from onnxq.parallel import ordered_map
from onnxq.plan.strategies.matmul_nbits import BITS, FLOAT_TYPES, can_use_matmul_nbits, weight_dtype

CONTRIB = "com.microsoft"
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


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
    if importance is not None:
        importance = block_importance(importance, block)
    float_zp = spec.calib_method == "hqq"  # optimised float zero points, which MatMulNBits takes
    columns = max(1, CHUNK_ELEMENTS // (k_blocks * block))
    codes, scales, zeros = [], [], []
    plain = plain_rounding(spec, clip_search, importance)
    for start in range(0, n, columns):
        part = np.asarray(w[:, start:start + columns], dtype=np.float32)
        if plain:  # blocked in W's own layout [k_blocks, block, columns]; only the packed codes transpose
            if k != k_blocks * block:
                part = np.concatenate([part, np.zeros((k_blocks * block - k, part.shape[1]), np.float32)])
            q, scale, zp = round_blocks(part.reshape(k_blocks, block, -1), spec, scale_dtype)
            q, scale, zp = q.transpose(2, 0, 1), scale.T, zp.T
        else:
            padded = np.zeros((part.shape[1], k_blocks * block), dtype=np.float32)
            padded[:, :k] = part.T
            q, scale, zp = quantize_blocks(padded.reshape(-1, block), spec, scale_dtype, clip_search=clip_search,
                                           importance=importance, float_zero_point=float_zp)
        codes.append(packed_codes(q.reshape(-1, k_blocks, block), spec))
        scales.append(scale.reshape(-1, k_blocks))
        zeros.append(zp.reshape(-1, k_blocks))
    scale, zp = np.concatenate(scales), np.concatenate(zeros)
    bits = BITS[spec.dtype]
    return BlockQuantized(np.concatenate(codes), scale, stored_zero_points(zp, scale.dtype, spec), k, n, bits, block)


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


def _replace_with_nbits(graph: ir.Graph, editor: GraphEditor, node: ir.Node, bq: BlockQuantized,
                        accuracy_level: int) -> None:
    """Insert the MatMulNBits node, move the MatMul's output onto it and remove the MatMul."""
    prefix = node.name
    inputs = [
        node.inputs[0],
        editor.initializer(f"{prefix}_B_quantized", bq.packed),
        editor.initializer(f"{prefix}_scales", bq.scales),
    ]
    if bq.zero_points is not None:
        inputs.append(editor.initializer(f"{prefix}_zero_points", bq.zero_points))
    old = node.outputs[0]
    out = ir.Value(name=editor.unique(f"{prefix}_nbits"), shape=old.shape, type=old.type)
    attrs = {"K": bq.k, "N": bq.n, "bits": bq.bits, "block_size": bq.block_size,
             "accuracy_level": accuracy_level}
    new = ir.node("MatMulNBits", inputs, attrs, domain=CONTRIB, outputs=[out],
                  name=editor.unique(f"{prefix}_MatMulNBits"))
    graph.insert_before(node, new)
    name = old.name
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    weight = node.inputs[1]
    graph.remove(node, safe=True)
    old.name = None
    out.name = name
    if not weight.uses() and not weight.is_graph_output():
        graph.initializers.pop(weight.name, None)
        _release(weight.const_value)


def _release(tensor: object) -> None:
    """Unmap a replaced weight kept in an external data file, or drop the pages of one
    mapped at load (`graph.load.drop_pages`), so it leaves the process (a >2 GB model
    otherwise ends with every weight resident); unmapping is skipped while something
    still holds a view of it."""
    drop_pages(tensor)
    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):
            tensor.release()


def emit_matmul_nbits(model: ir.Model, nodes: Mapping[str, ResolvedSpec],
                      accuracy_level: int = 0, clip_search: bool | None = None,
                      importance: Mapping[str, np.ndarray] | None = None, weights: object = None) -> dict[str, str]:
    """Rewrite the MatMuls in `nodes` (name -> weight spec) as MatMulNBits, in place.

    `accuracy_level` is MatMulNBits' attribute (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
    computation of A). `importance` (node name -> mean x^2 of each of A's K channels over
    calibration data) and `clip_search` drive the 4-bit clipping search, see
    `quantize_blockwise`; `weights` (a `WeightCache`) may hold a node's weight already in
    MatMulNBits' layout (GPTQ). Returns the skipped nodes with the reason.
    """
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")
    graph = model.graph
    editor = GraphEditor(graph)
    ready, skipped = claimed_nodes(graph, nodes, can_use_matmul_nbits)

    def quantized(item: tuple[ir.Node, ResolvedSpec]) -> BlockQuantized:
        node, spec = item
        bq = weights.pinned_node(node.name, node.inputs[1]) if weights is not None else None
        if bq is not None:
            return bq
        return quantize_blockwise(constant_array(node.inputs[1]), spec, FLOAT_TYPES[weight_dtype(node)],
                                  clip_search, (importance or {}).get(node.name))

    # Weights are quantized on every core, ahead of the graph edits, which stay in order.
    for (node, _), bq in zip(ready, ordered_map(quantized, ready)):
        _replace_with_nbits(graph, editor, node, bq, accuracy_level)
    if len(skipped) < len(nodes):
        model.opset_imports.setdefault(CONTRIB, 1)
    return skipped


@register_lowering("matmul_nbits", order=20)
def _lower(model: ir.Model, nodes: Mapping[str, ResolvedSpec], config: Config, weights: object = None) -> LoweringReport:
    return LoweringReport(skipped=emit_matmul_nbits(model, nodes, config.accuracy_level, weights=weights))
