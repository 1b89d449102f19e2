"""A tied embedding and LM head (`plan/tied.py`) lowered together, one stored weight for both.

The LM head becomes MatMulNBits as any MatMul does (its weight pinned by an algorithm, or
rounded here), and the embedding becomes GatherBlockQuantized on the same bytes:
MatMulNBits' B [N, k_blocks, blob] through a Reshape to [N, k_blocks * blob], its scales
[N, k_blocks] and packed zero points as they are. onnxruntime 1.32's MatMulNBits refuses a
2-D B, and a 3-D table would need reshaped scales and a reshaped output, so the Reshape
of the initializer (what onnxruntime-genai's builder writes) is the one extra node, and no
extra byte on disk. Float zero points (HQQ) have no GatherBlockQuantized form: that pair
keeps two copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config
from onnxq.emit.gather_block_quantized import replace_with_gather_block_quantized
from onnxq.emit.lowering import LoweringReport, claimed_nodes
from onnxq.emit.matmul_nbits import CONTRIB, block_quantized, replace_with_nbits
from onnxq.graph.edit import GraphEditor
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.gather_int4 import can_use_gather_block_quantized
from onnxq.plan.strategies.matmul_nbits import can_use_matmul_nbits
from onnxq.plan.tied import GATHER, MATMUL, copied_pairs


@dataclass(frozen=True)
class Shared:
    """The LM head's stored weight as GatherBlockQuantized reads it."""

    stored: list[ir.Value | None]  # data (B through a Reshape), scales, zero points or None
    block_size: int
    bits: int


def _lower_head(model: ir.Model, edit: GraphEditor, head: ir.Node, spec: ResolvedSpec, config: Config,
                weights: object) -> Shared | str:
    """Rewrite the LM head as MatMulNBits; what the embedding reads of it, or why it cannot."""
    bq = block_quantized(head, spec, weights)
    if bq.zero_points is not None and bq.zero_points.dtype != np.uint8:
        return "its float zero points (HQQ) have no GatherBlockQuantized form"
    if bq.k % bq.block_size:
        return f"its blocks of {bq.block_size} do not divide the hidden size {bq.k}"
    nbits = replace_with_nbits(model.graph, edit, head, bq, config.accuracy_level)
    model.opset_imports.setdefault(CONTRIB, 1)
    packed, rows = nbits.inputs[1], [bq.n, bq.packed[0].size]
    data = edit.add_node("Reshape", [packed, edit.initializer(f"{packed.name}_shape", np.array(rows, np.int64))],
                         f"{packed.name}_rows", dtype=packed.dtype, shape=ir.Shape(rows))
    return Shared([data, nbits.inputs[2], nbits.inputs[3] if len(nbits.inputs) > 3 else None], bq.block_size,
                  bq.bits)


def lower_tied(model: ir.Model, plan: QuantPlan, config: Config, weights: object = None) -> LoweringReport:
    """Lower each pair of `plan.tied` to MatMulNBits and GatherBlockQuantized sharing one
    weight, in place; the report lists both nodes as converted (the lowerings of their
    strategies then skip them) and says, per pair, how it was stored."""
    report = LoweringReport()
    if not plan.tied:
        return report
    graph = model.graph
    gathers, heads = plan.nodes_for(GATHER), plan.nodes_for(MATMUL)
    claimed = [*claimed_nodes(graph, {n: gathers[n] for n in plan.tied if n in gathers},
                              can_use_gather_block_quantized)[0],
               *claimed_nodes(graph, {t.head: heads[t.head] for t in plan.tied.values() if t.head in heads},
                              can_use_matmul_nbits)[0]]
    ready = {node.name: node for node, _ in claimed}  # the others are left to their own lowerings
    edit = GraphEditor(graph)
    shared: dict[str, Shared | str] = {}
    for name, tie in plan.tied.items():
        pair = f"tied embedding {name} and LM head {tie.head}"
        if tie.block_size is None:
            report.notes.append(f"{pair}: each stores its own copy: {tie.reason}")
            continue
        if name not in ready or (tie.head not in shared and tie.head not in ready):
            continue
        if tie.head not in shared:
            shared[tie.head] = _lower_head(model, edit, ready[tie.head], heads[tie.head], config, weights)
            report.converted.extend([] if isinstance(shared[tie.head], str) else [tie.head])
        head = shared[tie.head]
        if isinstance(head, str):
            report.notes.append(f"{pair}: each stores its own copy: {head}")
            continue
        replace_with_gather_block_quantized(model, edit, ready[name], head.stored, head.block_size, head.bits)
        report.converted.append(name)
        blocks = f"blocks of {tie.block_size}" + (f" ({tie.reason})" if tie.reason else "")
        report.notes.append(f"{pair}: one {'int4' if head.bits == 4 else '8-bit'} copy, MatMulNBits' weight read by "
                            f"GatherBlockQuantized, {blocks}")
    return report


def copied_notes(model: ir.Model, plan: QuantPlan) -> list[str]:
    """A note per tied pair the plan stores twice (`plan.tied.copied_pairs`; read before
    the Q/DQ lowering rewires the weights)."""
    return [f"tied embedding {gather} and LM head {head}: each stores its own quantized copy under a static recipe; "
            "the weight-only recipes store one (W8_GROUP128, W4_GROUP128)" for gather, head in copied_pairs(model.graph, plan)]
