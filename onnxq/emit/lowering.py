"""The lowering table: for each strategy of `plan/strategies` that claims whole nodes, the
function that rewrites them in the graph.

A lowering takes the model, the nodes its strategy claimed (name -> spec, in graph order),
the config and the weights algorithms quantized; it rewrites what it can in place and reports the nodes it had to leave
float (with why), the nodes it converted (for strategies counted only once converted) and
notes for the summary. Static QDQ is not in the table: `emit/qdq` lowers the tensors of
the plan, and runs first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config, DType


@dataclass
class LoweringReport:
    skipped: dict[str, str] = field(default_factory=dict)  # node -> why it stays float
    converted: list[str] = field(default_factory=list)  # nodes the lowering converted
    notes: list[str] = field(default_factory=list)


# fn(model, nodes, config, weights): `weights` is the pipeline's `plan.params.WeightCache`,
# where an algorithm may have pinned a node's quantized weight (GPTQ for MatMulNBits).
LoweringFn = Callable[[ir.Model, Mapping[str, "ResolvedSpec | DType"], Config, object], LoweringReport]


@dataclass(frozen=True)
class Lowering:
    strategy: str
    order: int  # lower runs first
    run: LoweringFn


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(strategy: str, order: int) -> Callable[[LoweringFn], LoweringFn]:
    """Register `fn(model, nodes, config[, weights])` as the lowering of the nodes
    `strategy` claims (a lowering that needs no pinned weights may omit `weights`)."""
    def decorate(fn: LoweringFn) -> LoweringFn:
        if strategy in LOWERINGS:
            raise ValueError(f"a lowering for {strategy!r} is already registered")
        takes_weights = len(inspect.signature(fn).parameters) >= 4
        run = fn if takes_weights else (lambda model, nodes, config, weights: fn(model, nodes, config))
        LOWERINGS[strategy] = Lowering(strategy, order, run)
        return fn
    return decorate


def ordered() -> list[Lowering]:
    return sorted(LOWERINGS.values(), key=lambda lowering: (lowering.order, lowering.strategy))


def claimed_nodes(
    graph: ir.Graph, nodes: Mapping[str, ResolvedSpec], check: Callable[[ir.Node, ResolvedSpec], str | None],
) -> tuple[list[tuple[ir.Node, ResolvedSpec]], dict[str, str]]:
    """The claimed nodes a lowering can still rewrite (`check` gives why not, or None),
    in the order given, and the others with the reason."""
    by_name = {node.name: node for node in graph}
    ready, skipped = [], {}
    for name, spec in nodes.items():
        node = by_name.get(name)
        reason = "no node of this name in the graph" if node is None else check(node, spec)
        if reason:
            skipped[name] = reason
        else:
            ready.append((node, spec))
    return ready, skipped
