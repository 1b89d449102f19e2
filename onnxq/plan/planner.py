"""Decide, before calibration, how every tensor of the model will be quantized.

The plan names the activation tensors to calibrate (and the spec each is calibrated
for), the weights, biases and constants to quantize offline, the activations absorbed
into the op before them, and the nodes left in float with the reason why. Each node is
offered to the registered strategies (`plan/strategies`), which record their decisions
in a `Draft`; an int4 embedding and the LM head it is tied to are paired to share one
stored weight (`plan/tied`), and the link ops that gain nothing quantized are pruned
(`plan/prune`). A GELU written out as elementwise nodes stays float inside (`graph/gelu.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from onnxq.config.resolve import float_reason, resolve_node_config
from onnxq.config.spec import Config, DType, ScaleType
from onnxq.graph.gelu import decomposed_gelus
from onnxq.numerics.qmath import FLOAT_TARGETS
from onnxq.plan import strategies
from onnxq.plan.draft import Draft
from onnxq.plan.kernel_pairs import runnable
from onnxq.plan.plan import QuantPlan
from onnxq.plan.prune import prune
from onnxq.plan.tied import tie_tables
from onnxq.target.profile import TargetProfile

# Why a decomposed GELU's nodes stay float (`graph/gelu.py`).
INSIDE_GELU = ("inside a GELU written out as elementwise nodes: one activation function, which onnxruntime can "
               "fuse into one float kernel")
# Activation types that convert the op instead of quantizing it: the float cast keeps a GELU's nodes.
_CAST_TYPES = frozenset({*FLOAT_TARGETS, DType.FLOAT32})


def inside_gelus(model: ir.Model, config: Config) -> dict[str, str]:
    """The nodes of each decomposed GELU a static recipe would quantize, with the reason
    they stay float. Left to the usual rules: a node or its op type named by an override
    (`layer_quant_config`, `layer_type_quant_config`), dynamic recipes (no Q/DQ to stop
    the fusion), and power-of-two recipes (XINT8: integer-only hardware, where a float
    GELU would leave the accelerator)."""
    kept = {}
    for gelu in decomposed_gelus(model.graph):
        for node in gelu:
            if node.name in config.layer_quant_config or node.op_type in config.layer_type_quant_config:
                continue
            cfg = resolve_node_config(config, node.name, node.op_type)
            spec = cfg.output_tensors or cfg.input_tensors if cfg is not None else None
            if spec is not None and spec.dtype not in _CAST_TYPES and not spec.is_dynamic \
                    and spec.scale_type != ScaleType.POWER_OF_TWO:
                kept[node.name] = INSIDE_GELU
    return kept


def plan_node(draft: Draft, node: ir.Node, keep_float: Mapping[str, str]) -> None:
    """Offer `node` to each registered strategy until one decides (`plan/strategies`)."""
    if node.name in keep_float:
        draft.float_node(node, keep_float[node.name], as_given=True)
        return
    cfg = resolve_node_config(draft.config, node.name, node.op_type)
    if cfg is None:
        why = float_reason(draft.config, node.name, node.op_type)
        draft.float_node(node, why, as_given=why.startswith("excluded"))  # the user's exclusion, as they wrote it
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
    keep_float = {**inside_gelus(model, config), **(keep_float or {})}
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
