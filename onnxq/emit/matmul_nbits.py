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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import int_type
from onnxq.numerics.weights import block_importance, quantize_blocks

CONTRIB = "com.microsoft"
BITS: dict[DType, int] = {DType.INT4: 4, DType.UINT4: 4, DType.INT8: 8, DType.UINT8: 8}
FLOAT_TYPES: dict[ir.DataType, type] = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class BlockQuantized:
    """A weight in MatMulNBits' layout (see the module docstring)."""

    packed: np.ndarray  # uint8 [N, k_blocks, blob_size]
    scales: np.ndarray  # [N, k_blocks]
    zero_points: np.ndarray | None  # packed uint8 [N, ceil(k_blocks * bits / 8)], or None
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


def quantize_blockwise(w: np.ndarray, spec: ResolvedSpec, scale_dtype: type = np.float32,
                       clip_search: bool | None = None, importance: np.ndarray | None = None) -> BlockQuantized:
    """Quantize W [K, N] per block of `spec.group_size` rows of each column
    (`onnxq.numerics.weights.quantize_blocks`: full-range signed scales for symmetric 4-bit).

    `importance` [K]: mean square of each input channel of A over calibration data; with
    it the 4-bit clipping search minimises each block's output error. `clip_search`: None
    searches only with `importance`, True always, False never."""
    bits, block = BITS[spec.dtype], int(spec.group_size)
    k, n = w.shape
    k_blocks = -(-k // block)
    padded = np.zeros((n, k_blocks * block), dtype=np.float32)
    padded[:, :k] = np.asarray(w).T
    if importance is not None:
        importance = block_importance(importance, block)
    q, scale, zp = quantize_blocks(padded.reshape(n * k_blocks, block), spec, scale_dtype,
                                   clip_search=clip_search, importance=importance)
    offset = -int_type(spec.dtype).qmin  # stored unsigned: int4 -8..7 -> 0..15
    stored = (q.astype(np.int16) + offset).astype(np.uint8).reshape(n, k_blocks, block)
    zp_stored = (zp.astype(np.int16) + offset).astype(np.uint8).reshape(n, k_blocks)
    default_zp = 1 << (bits - 1)
    zero_points = None if np.all(zp_stored == default_zp) else pack_bits(zp_stored, bits)
    return BlockQuantized(pack_bits(stored, bits), scale.reshape(n, k_blocks), zero_points, k, n, bits, block)


def dequantize_blockwise(bq: BlockQuantized) -> np.ndarray:
    """W [K, N] as MatMulNBits sees it: (q - zero_point) * scale, in float32."""
    k_blocks = bq.scales.shape[1]
    q = unpack_bits(bq.packed, bq.bits, bq.block_size).astype(np.float32)  # [N, k_blocks, block]
    if bq.zero_points is None:
        zp = np.full((bq.n, k_blocks), 1 << (bq.bits - 1), dtype=np.float32)
    else:
        zp = unpack_bits(bq.zero_points, bq.bits, k_blocks).astype(np.float32)
    w = (q - zp[..., None]) * bq.scales.astype(np.float32)[..., None]
    return w.reshape(bq.n, -1)[:, : bq.k].T


def _weight_dtype(node: ir.Node) -> ir.DataType | None:
    weight = node.inputs[1]
    return weight.dtype if weight.dtype is not None else ir.DataType.FLOAT


def can_use_matmul_nbits(node: ir.Node, spec: ResolvedSpec) -> str | None:
    """Why `node` cannot become MatMulNBits with `spec`, or None when it can."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} is not a MatMul"
    if spec.dtype not in BITS:
        return f"weight dtype {spec.dtype} not supported by MatMulNBits (int4/uint4/int8/uint8)"
    block = spec.group_size
    if block is None or block < 16 or block & (block - 1):
        return f"group_size {block} is not a power of two >= 16, as MatMulNBits' block_size must be"
    w = constant_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if w is None:
        return "weight (input 1) is not a constant"
    if w.ndim != 2:
        return f"weight has rank {w.ndim}; MatMulNBits takes a rank-2 weight"
    if w.shape[0] < 1 or w.shape[1] < 1:
        return f"weight shape {w.shape} is empty"
    if _weight_dtype(node) not in FLOAT_TYPES:
        return f"weight is {_weight_dtype(node)}; MatMulNBits takes float32 or float16"
    a = node.inputs[0]
    if a.dtype is not None and a.dtype != _weight_dtype(node):
        return f"input is {a.dtype} but the weight is {_weight_dtype(node)}"
    if a.shape is not None and len(a.shape) < 2:
        return "input has rank < 2; MatMulNBits needs A of rank >= 2"
    return None


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


def emit_matmul_nbits(model: ir.Model, nodes: Mapping[str, ResolvedSpec],
                      accuracy_level: int = 0, clip_search: bool | None = None,
                      importance: Mapping[str, np.ndarray] | None = None) -> dict[str, str]:
    """Rewrite the MatMuls in `nodes` (name -> weight spec) as MatMulNBits, in place.

    `accuracy_level` is MatMulNBits' attribute (0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
    computation of A). `importance` (node name -> mean x^2 of each of A's K channels over
    calibration data) and `clip_search` drive the 4-bit clipping search, see
    `quantize_blockwise`. Returns the skipped nodes with the reason.
    """
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")
    graph = model.graph
    editor = GraphEditor(graph)
    by_name = {node.name: node for node in graph}
    skipped: dict[str, str] = {}
    for name, spec in nodes.items():
        node = by_name.get(name)
        reason = "no node of this name in the graph" if node is None else can_use_matmul_nbits(node, spec)
        if reason:
            skipped[name] = reason
            continue
        scale_dtype = FLOAT_TYPES[_weight_dtype(node)]
        bq = quantize_blockwise(constant_array(node.inputs[1]), spec, scale_dtype, clip_search,
                                (importance or {}).get(name))
        _replace_with_nbits(graph, editor, node, bq, accuracy_level)
    if len(skipped) < len(nodes):
        model.opset_imports.setdefault(CONTRIB, 1)
    return skipped
