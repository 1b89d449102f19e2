"""Tied embeddings: an embedding Gather whose table is, transposed, the weight of a MatMul
lowered to MatMulNBits is planned to share that MatMul's int4 (or 8-bit) weight.

onnxruntime-genai's model builder ties the token embedding to the LM head: the LM head's
weight [hidden, vocab] is the one table, and the embedding gathers from its Transpose
(which load folds into a copy, `graph/fold.py`, or leaves as a node past
`MAX_FOLD_ELEMENTS`). MatMulNBits' B [vocab, k_blocks, blob] and GatherBlockQuantized's
uint8 data [vocab, hidden / 2] are the same bytes when the block size divides hidden, so
one stored copy serves both (`emit/tied.py`).

The pair takes the MatMul's spec: its quantization wins, so an algorithm's codes for the
LM head (GPTQ's) are the embedding's too. Its block size is the largest power of two
from 16 up to `HEAD_BLOCK` (or the group size, if smaller) that divides hidden; without
one, each keeps its own copy as before. The table is the model's most sensitive weight:
it turns the last hidden state into every logit and every token into the first, and
stored once it is worth finer blocks. SmolLM2-135M int4 (group 128), perplexity on
STS-B / GPL-3 text: RTN 23.47 / 42.14 at blocks of 64 (the largest that divides 576),
23.18 / 39.48 at 32; GPTQ 18.77 / 32.53 -> 18.55 / 31.95; for 1.97 MB (80.3 -> 82.2 MB,
the model builder's int4 86.5 MB).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.graph.fold import constant_array
from onnxq.plan.draft import Draft
from onnxq.plan.plan import Kind, Lowered, QuantPlan, Tie
from onnxq.plan.strategies.gather_int4 import can_use_gather_block_quantized, transposed_constant
from onnxq.plan.strategies.matmul_nbits import BITS

GATHER, MATMUL = "gather_block_quantized", "matmul_nbits"
MIN_BLOCK = 16  # both kernels' smallest block
HEAD_BLOCK = 32  # the pair's largest block (module doc)


def shared_block(hidden: int, group: int) -> int | None:
    """The largest power of two from MIN_BLOCK up to `group` that divides `hidden`, or None."""
    size = group
    while size >= MIN_BLOCK:
        if hidden % size == 0:
            return size
        size //= 2
    return None


def _heads(draft: Draft, graph: ir.Graph) -> list[tuple[ir.Node, ResolvedSpec]]:
    """The MatMuls lowered to 4- or 8-bit MatMulNBits, with their specs."""
    found = []
    for node in graph:
        low = draft.lowered.get(node.name)
        if low is not None and low.strategy == MATMUL and BITS.get(low.spec.dtype) in (4, 8):
            found.append((node, low.spec))
    return found


# Table rows compared at a time: a different table fails on the first slice, and no
# temporary grows with the table (SmolLM2's 49152 x 576 compares in 0.2 s).
ROWS = 256


def _is_transposed(table: np.ndarray, weight: np.ndarray) -> bool:
    """Whether `table` equals `weight`.T."""
    if table.shape != weight.shape[::-1] or table.dtype != weight.dtype:
        return False
    return all(np.array_equal(table[i:i + ROWS], weight[:, i:i + ROWS].T) for i in range(0, len(table), ROWS))


def _head_of(gather: ir.Node, heads: list[tuple[ir.Node, ResolvedSpec]]) -> tuple[ir.Node, ResolvedSpec] | None:
    """The MatMul whose weight `gather` reads transposed: through a Transpose, or as a folded copy."""
    source = transposed_constant(gather.inputs[0])
    if source is not None:
        return next(((node, spec) for node, spec in heads if node.inputs[1] is source), None)
    table = constant_array(gather.inputs[0])
    if table is None:
        return None
    return next(((node, spec) for node, spec in heads if _is_transposed(table, constant_array(node.inputs[1]))), None)


def tie_tables(draft: Draft, graph: ir.Graph) -> None:
    """Record each tied pair in `draft.tied` and give both nodes the pair's spec."""
    heads = _heads(draft, graph)
    if not heads:
        return
    for gather in graph:
        low = draft.lowered.get(gather.name)
        if low is None or low.strategy != GATHER:
            continue
        found = _head_of(gather, heads)
        if found is None:
            continue
        head, spec = found
        hidden, group = constant_array(head.inputs[1]).shape[0], int(spec.group_size)
        largest = min(group, HEAD_BLOCK) if BITS[spec.dtype] == 4 else group  # 8 bits need no finer blocks
        block = shared_block(hidden, largest)
        if block is None:
            draft.tied[gather.name] = Tie(head.name, None, f"no power of two from {MIN_BLOCK} to {group} "
                                          f"divides the hidden size {hidden}")
            continue
        shared = dataclasses.replace(spec, group_size=block)
        if can_use_gather_block_quantized(gather, shared) is not None:
            continue
        reason = ("" if block == group else f"the tied table's blocks are at most {HEAD_BLOCK}" if block == largest
                  else f"the hidden size {hidden} is not a multiple of {largest}")
        draft.tied[gather.name] = Tie(head.name, block, reason)
        draft.lowered[gather.name] = Lowered(GATHER, shared)
        draft.lowered[head.name] = Lowered(MATMUL, shared)


def copied_pairs(graph: ir.Graph, plan: QuantPlan) -> list[tuple[str, str]]:
    """(embedding Gather, LM head MatMul) pairs tied in the float model that the plan
    quantizes as two copies: a static recipe's 8-bit table (an activation's codes) beside
    the MatMul's 8-bit weight (families trial: Qwen2 U8S8 stored both, without a word)."""
    weights = {name for name, t in plan.tensors.items() if t.kind is Kind.WEIGHT}
    heads = [(node, None) for node in graph if node.op_type == "MatMul" and len(node.inputs) > 1
             and node.inputs[1] is not None and node.inputs[1].name in weights]
    pairs = []
    for gather in graph:
        if gather.op_type != "Gather" or gather.name in plan.tied or not gather.inputs \
                or gather.inputs[0] is None or gather.inputs[0].name not in plan.tensors:
            continue
        found = _head_of(gather, heads)
        if found is not None:
            pairs.append((gather.name, found[0].name))
    return pairs
