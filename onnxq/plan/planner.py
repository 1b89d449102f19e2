"""Decide, before calibration, how every tensor of the model will be quantized.

The plan names the activation tensors to calibrate (and the spec each is calibrated
for), the weights, biases and constants to quantize offline, the activations absorbed
into the op before them, and the nodes left in float with the reason why. Each node is
offered to the registered strategies (`plan/strategies`), which record their decisions
in a `Draft`; an int4 embedding and the LM head it is tied to are paired to share one
stored weight (`plan/tied`), and the link ops that gain nothing quantized are pruned
(`plan/prune`).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnxq.config.resolve import float_reason, resolve_node_config
from onnxq.config.spec import Config
from onnxq.plan import strategies
from onnxq.plan.draft import Draft
from onnxq.plan.kernel_pairs import runnable
from onnxq.plan.plan import QuantPlan
from onnxq.plan.prune import prune
from onnxq.plan.tied import tie_tables
from onnxq.target.profile import TargetProfile


def plan_node(draft: Draft, node: ir.Node, keep_float: Mapping[str, str]) -> None:
    """Offer `node` to each registered strategy until one decides (`plan/strategies`)."""
    if node.name in keep_float:
        draft.float_node(node, keep_float[node.name])
        return
    cfg = resolve_node_config(draft.config, node.name, node.op_type)
    if cfg is None:
        draft.float_node(node, float_reason(draft.config, node.name, node.op_type))
        return
    cfg, relaxed = runnable(node, cfg)
    if relaxed is not None:
        draft.float_inputs[node.name] = relaxed
    for strategy in strategies.ordered():
        decision = strategy.claim(node, cfg, draft)
        if decision is None:
            continue
        if isinstance(decision, strategies.Refuse):
            draft.float_node(node, decision.reason)
        elif isinstance(decision, strategies.Lower):
            draft.lower(node, strategy.name, decision.spec)
            if strategy.counted:
                draft.quantized(node)
        return


def plan_quantization(
    model: ir.Model, config: Config, keep_float: Mapping[str, str] | None = None,
    target: TargetProfile | None = None,
) -> QuantPlan:
    """Walk the graph in topological order and decide what each tensor becomes.

    `keep_float` names nodes (with the reason) that earlier passes require to stay float.
    `target` narrows int8 weights where its kernels saturate (None: leave them 8-bit).
    """
    keep_float = keep_float or {}
    draft = Draft({node.name: node for node in model.graph}, config, target)
    for node in model.graph:
        if node.name in draft.fused_activations:
            continue
        plan_node(draft, node, keep_float)
    tie_tables(draft, model.graph)
    prune(draft, model.graph)
    # a relaxed node is told of only where its weight was quantized after all
    draft.float_inputs = {n: why for n, why in draft.float_inputs.items()
                          if n in draft.quantized_nodes or n in draft.lowered}
    return draft.freeze()
