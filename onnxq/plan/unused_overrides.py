"""Overrides the plan had no use for, said in the summary rather than dropped in silence:
an absorbed Relu/Clip's own specs (it runs inside the op before it, one kernel) and an
output spec on a data-movement op (its output reuses its input's parameters)."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.config.spec import ACTIVATION_CLASSES, Config
from onnxq.notes import Note, Topic
from onnxq.plan.plan import QuantPlan
from onnxq.plan.rules import OP_RULES, OutputMode


def _override(config: Config, node: ir.Node) -> tuple[str, object] | None:
    """The override level that names `node` (its node override, else its op type's)."""
    if node.name in config.layer_quant_config:
        return f"layer_quant_config: {node.name}", config.layer_quant_config[node.name]
    if node.op_type in config.layer_type_quant_config:
        return f"layer_type_quant_config: {node.op_type}", config.layer_type_quant_config[node.op_type]
    return None


def unused_override_notes(model: ir.Model, plan: QuantPlan, config: Config) -> list[Note]:
    """A note per override level whose activation specs the plan did not apply, with why."""
    unused: dict[str, tuple[str, list[str]]] = {}
    for node in model.graph:
        found = _override(config, node)
        if found is None:
            continue
        where, level = found
        given = [tc for tc in ACTIVATION_CLASSES if getattr(level, tc) is not None]
        if node.name in plan.fused_activations and given:
            why = "it runs inside the op before it (one kernel): set that op's output_tensors"
        elif (rule := OP_RULES.get(node.op_type)) is not None and rule.output is OutputMode.SHARED \
                and level.output_tensors is not None and node.name in plan.quantized_nodes:
            why = "a data-movement op's output reuses its input's parameters: set the producer's output_tensors"
        else:
            continue
        unused.setdefault(where, (why, []))[1].append(node.name)
    return [Note(Topic.CONFIG, f"{where} has no effect" + ("" if where.startswith("layer_quant_config") else
                 f" on {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}") + f": {why}", tuple(names))
            for where, (why, names) in unused.items()]
