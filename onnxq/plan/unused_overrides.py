"""Overrides the plan had no use for, said in the summary rather than dropped in silence:
an absorbed Relu/Clip's own specs (it runs inside the op before it, one kernel), an
output spec on a data-movement op (its output reuses its input's parameters), a weight
spec on an op without a weight, a node override on an excluded node, an op-type
override for an op type the model lacks, and integer grid settings (`--per-tensor`,
`--per-group`) on float16/bfloat16 weights where no weight was put on a grid."""

from __future__ import annotations

import functools

import onnx_ir as ir

from onnxq.config.presets import PRESETS, get_preset
from onnxq.config.resolve import is_excluded
from onnxq.config.spec import ACTIVATION_CLASSES, Config
from onnxq.notes import Note, Topic
from onnxq.numerics.qmath import FLOAT_TARGETS
from onnxq.plan.plan import Kind, QuantPlan
from onnxq.plan.rules import DYNAMIC_OPS, OP_RULES, OutputMode
from onnxq.plan.strategies.gather_int4 import table_array

# Op types a weight spec applies to: those with a weight input in the rules table, and the
# dynamic kernels' (LSTM).
WEIGHTED_OPS = frozenset({op for op, rule in OP_RULES.items() if rule.weight_input is not None} | DYNAMIC_OPS)

# A weight spec's settings for a grid (integer or float8 scales), which a float16/bfloat16
# cast of the weights has no use for (`bits` there is refused: `config/validate.py`).
GRID_FIELDS = ("qscheme", "group_size", "ch_axis", "symmetric", "scale_type")


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
        if where.startswith("layer_quant_config") and is_excluded(config, node.name):
            why = "the node is excluded (exclude wins over every override)"
        elif level.weight is not None and node.op_type not in WEIGHTED_OPS:
            where += " weight"
            why = f"a {node.op_type} has no weight (weight specs are for {', '.join(sorted(WEIGHTED_OPS))})"
        elif level.weight is not None and _table_as_input(node, plan):
            where += " weight"
            why = ("a static recipe quantizes a Gather's table as its input (input_tensors), the values it "
                   "passes on: set input_tensors float32 for the weight spec to apply, or float_op_types: [Gather] to "
                   "keep it float")
        elif node.name in plan.fused_activations and given:
            why = "it runs inside the op before it (one kernel): set that op's output_tensors"
        elif (rule := OP_RULES.get(node.op_type)) is not None and rule.output is OutputMode.SHARED \
                and level.output_tensors is not None and node.name in plan.quantized_nodes:
            where += " output_tensors"
            why = "a data-movement op's output reuses its input's parameters: set the producer's output_tensors"
        else:
            continue
        unused.setdefault(where, (why, []))[1].append(node.name)
    found = [Note(Topic.CONFIG, f"{where} has no effect" + ("" if where.startswith("layer_quant_config") else
                  f" on {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}") + f": {why}", tuple(names))
             for where, (why, names) in unused.items()]
    found.extend(_grid_on_cast(plan, config))
    present = {node.op_type for node in model.graph}
    absent = [op for op in config.layer_type_quant_config if op not in present and op not in _preset_op_types()]
    if absent:
        found.append(Note(Topic.CONFIG, f"layer_type_quant_config: {', '.join(absent)} has no effect: the model has "
                          f"no {' or '.join(absent)} node"))
    return found


def _table_as_input(node: ir.Node, plan: QuantPlan) -> bool:
    """Whether `node` is a Gather whose constant table the plan quantizes with the input's
    activation spec (static recipes), where a weight spec does not reach it (encoder
    trial: `Gather: {weight: {dtype: float32}}` had been ignored without a word)."""
    table = node.inputs[0] if node.op_type == "Gather" and node.inputs else None
    if table is None or table_array(table) is None:  # a Gather of an activation (CLS pooling): no table (review)
        return False
    planned = plan.tensors.get(table.name)
    return planned is not None and planned.kind is not Kind.WEIGHT


def _grid_on_cast(plan: QuantPlan, config: Config) -> list[Note]:
    """A note per level whose float16/bfloat16 weight spec sets grid fields, where no weight
    of the plan was put on a grid (FP16 with `--per-tensor` had done nothing, silently).
    With some weight on a grid the fields may reach it through inheritance: nothing said."""
    if any(tensor.kind is Kind.WEIGHT for tensor in plan.tensors.values()):
        return []
    levels = [("global_quant_config", config.global_quant_config),
              *((f"layer_type_quant_config: {op}", level) for op, level in config.layer_type_quant_config.items()),
              *((f"layer_quant_config: {name}", level) for name, level in config.layer_quant_config.items())]
    notes = []
    below = getattr(config.global_quant_config.weight, "dtype", None)  # what a level without a dtype inherits
    for where, level in levels:
        spec = level.weight if level is not None else None
        dtype = getattr(spec, "dtype", None) or below
        if dtype not in FLOAT_TARGETS:
            continue
        given = [f"{name} {getattr(getattr(spec, name), 'value', getattr(spec, name))}" for name in GRID_FIELDS
                 if getattr(spec, name) is not None]
        if given:
            notes.append(Note(Topic.CONFIG, f"{where} weight {', '.join(given)} has no effect: {dtype.value} weights are "
                              "cast, not put on a grid of scales (--per-tensor, --per-channel, --per-group and the "
                              "other grid settings are for integer and float8 weights)"))
    return notes


@functools.cache
def _preset_op_types() -> frozenset[str]:
    """Op types some preset overrides (W8_DYNAMIC's Conv, the weight-only presets' Gemm and
    Gather): written for every model, so a model without them is no news."""
    return frozenset(op for name in PRESETS for op in get_preset(name).layer_type_quant_config)
