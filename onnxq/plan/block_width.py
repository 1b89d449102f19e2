"""Weight blocks no wider than the rows they cut.

MatMulNBits and GatherBlockQuantized store each row (a MatMul weight's K inputs, a table's
embedding dimension) in whole blocks, the last one padded. A block wider than the row
pads it to the block's width: SmolLM2-135M (K = 576 and 1536) in blocks of 4096 was a
340 MB file, against 82 MB in blocks of 128 and 540 MB in float (LLM trial). A plan whose
padding more than doubles a row is refused before any weight is quantized; a small model's
rows padded by less (K = 72 in the preset's blocks of 128: no smaller power of two pads
less) are stored as they are.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxq.graph.fold import constant_array
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.gather_int4 import table_array

# The lowerings that store rows in blocks, and where each node's row length is.
ROW_LENGTH = {
    "matmul_nbits": lambda node: _dim(constant_array(node.inputs[1]), 0),
    "gather_block_quantized": lambda node: _dim(table_array(node.inputs[0]), 1),
}


def _dim(array: object, axis: int) -> int | None:
    shape = getattr(array, "shape", None)
    return int(shape[axis]) if shape is not None and len(shape) == 2 else None


def oversized_blocks(graph: ir.Graph, plan: QuantPlan) -> str | None:
    """Why `plan`'s blocks cannot be stored (module doc), or None where every block fits
    its rows."""
    nodes = {node.name: node for node in graph}
    wide: list[tuple[int, int, str]] = []  # (row length, block, node)
    for strategy, row_length in ROW_LENGTH.items():
        for name, spec in plan.nodes_for(strategy).items():
            block, length = getattr(spec, "group_size", None), row_length(nodes[name]) if name in nodes else None
            if block and length and -(-length // block) * block > 2 * length:
                wide.append((length, int(block), name))
    if not wide:
        return None
    shortest, block, name = min(wide)
    fits = max((b for b in (16, 32, 64, 128) if shortest % b == 0), default=16)
    return (f"group_size {block} is more than twice the rows of {len(wide)} weights ({name}: {shortest}): "
            f"MatMulNBits and GatherBlockQuantized pad each row to whole blocks, so they would store mostly padding; "
            f"give a group size up to {shortest} ({fits} divides it: no padding)")
