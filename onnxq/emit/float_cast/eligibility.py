"""Which assigned nodes can compute in float16/bfloat16: static checks against the ONNX
schema and constant ranges, and the islands rule (data movement alone gains nothing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from onnxq.emit.float_cast.probe import KernelProbe
from onnxq.emit.float_cast.types import Slots, fits
from onnxq.graph.fold import constant_array

# Ops kept in float32 by default. Softmax and the normalisations reduce many terms and
# exponentiate; the sum-like reductions and CumSum lose precision or overflow float16;
# Exp/Pow/Softplus/Reciprocal overflow float16 for ordinary inputs (exp(11) > 65504);
# Sqrt/Log usually see variances and probabilities near 0; Range/TopK/NMS/RoiAlign produce
# indices or coordinates that rounding changes. ReduceMax/Min, Erf and Resize are not
# listed: max/min are exact in any float type, erf is bounded, Resize computes its
# coordinates in float32 whatever its data type.
DEFAULT_KEEP_FLOAT32: tuple[str, ...] = (
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "RMSNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "Attention",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceProd",
    "CumSum",
    "Exp",
    "Pow",
    "Softplus",
    "Reciprocal",
    "Sqrt",
    "Log",
    "Range",
    "TopK",
    "NonMaxSuppression",
    "RoiAlign",
)

# Ops that only move, select or create data: alone between float32 nodes they gain nothing.
DATA_MOVEMENT = frozenset({
    "Constant", "ConstantOfShape",
    "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
    "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "DepthToSpace",
    "SpaceToDepth", "Dropout", "Shape", "Size", "Compress", "ReverseSequence", "Trilu", "Cast",
    "ScatterND", "ScatterElements", "Where",
})

# Cheap elementwise ops: converting them alone between float32 nodes costs two Casts and
# saves nothing, so like data movement they need a compute op or a weight in their group.
CHEAP_ELEMENTWISE = frozenset({
    "Clip", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Max", "Min",
    "Round", "Sign", "Abs", "Neg", "Floor", "Ceil",
})
# Constants smaller than this are parameters (Clip bounds, scalars), not weights.
MIN_WEIGHT_ELEMENTS = 16

_TYPE_STR = {ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}


@dataclass
class CastPlan:
    """Node index -> (target type, slots) for compute nodes and for weight-storage nodes."""

    compute: dict[int, tuple[ir.DataType, Slots]] = field(default_factory=dict)
    storage: dict[int, tuple[ir.DataType, Slots]] = field(default_factory=dict)
    kept: dict[int, str] = field(default_factory=dict)
    no_float: list[int] = field(default_factory=list)


def ai_onnx_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))


def _schema(node: ir.Node, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def _formal(params: Sequence[onnx.defs.OpSchema.FormalParameter], index: int) -> str | None:
    """The type string of the formal parameter at `index` (variadic last parameters repeat)."""
    if index < len(params):
        return params[index].type_str
    if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1].type_str
    return None


def _float_slots(node: ir.Node, schema: onnx.defs.OpSchema) -> tuple[Slots, set[str]] | None:
    """The slots bound to the type constraint of the node's float32 tensors, and the constraints.

    The constraints of float32 outputs are the compute type; a node without float outputs
    (ArgMax, Shape, Equal) uses those of its float32 inputs. None: no float32 tensor.
    """
    constraints = {c.type_param_str for c in schema.type_constraints}

    def bound(values: Sequence[ir.Value | None], params) -> list[tuple[int, str]]:
        out = []
        for i, value in enumerate(values):
            type_str = _formal(params, i)
            if value is not None and type_str in constraints:
                out.append((i, type_str))
        return out

    ins, outs = bound(node.inputs, schema.inputs), bound(node.outputs, schema.outputs)
    group = {t for i, t in outs if node.outputs[i].dtype == ir.DataType.FLOAT}
    if not group:
        group = {t for i, t in ins if node.inputs[i].dtype == ir.DataType.FLOAT}
    if not group:
        return None
    slots = Slots(tuple(i for i, t in ins if t in group), tuple(i for i, t in outs if t in group))
    values = [node.inputs[i] for i in slots.inputs] + [node.outputs[i] for i in slots.outputs]
    if any(v.dtype != ir.DataType.FLOAT for v in values):
        return None  # an already mixed-precision node: leave it as it is
    return slots, group


def _allows(schema: onnx.defs.OpSchema, group: set[str], target: ir.DataType) -> bool:
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return all(_TYPE_STR[target] in allowed[name] for name in group)


def _static_reason(node: ir.Node, keep: frozenset[str]) -> str | None:
    """Why `node` cannot be converted whatever its types; None if it may be."""
    if node.domain not in ("", "ai.onnx"):
        return f"op in domain {node.domain!r} is not converted"
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return "control flow is not converted"
    if node.op_type in keep:
        return "numerically sensitive"
    if "dtype" in node.attributes or (node.op_type == "Constant" and "value" not in node.attributes):
        return "output type set by an attribute"
    return None


def _range_reason(node: ir.Node, slots: Slots, target: ir.DataType) -> str | None:
    """A reason when a constant input (or Constant value) does not fit the target type."""
    arrays = [(v.name, constant_array(v)) for v in (node.inputs[i] for i in slots.inputs)]
    value = node.attributes.get("value")
    if value is not None and value.type == ir.AttributeType.TENSOR:
        arrays.append(("value", value.as_tensor().numpy()))
    for name, array in arrays:
        if array is not None and not fits(array, target):
            return f"constant {name} exceeds the {target.name.lower()} range"
    return None


def _islands(nodes: list[ir.Node], compute: dict[int, tuple[ir.DataType, Slots]]) -> set[int]:
    """Converted nodes in groups that only move data or do cheap elementwise work, and touch
    no converted compute op or weight: alone, they would only add Casts."""
    parent = {i: i for i in compute}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = {id(node): i for i, node in enumerate(nodes)}
    for i, (target, slots) in compute.items():
        for j in slots.outputs:
            for consumer, k in nodes[i].outputs[j].uses():
                c = index.get(id(consumer))
                if c in compute and compute[c][0] == target and k in compute[c][1].inputs:
                    parent[find(c)] = find(i)
    useful: set[int] = set()
    for i, (_, slots) in compute.items():
        node = nodes[i]
        heavy = node.op_type not in DATA_MOVEMENT and node.op_type not in CHEAP_ELEMENTWISE
        weights = [constant_array(node.inputs[k]) for k in slots.inputs]
        if heavy or any(w is not None and w.size >= MIN_WEIGHT_ELEMENTS for w in weights):
            useful.add(find(i))
    return {i for i in compute if find(i) not in useful}


def _decide(
    node: ir.Node,
    target: ir.DataType,
    opset: int,
    keep: frozenset[str],
    probe: KernelProbe | None,
    excluded: Mapping[tuple[str, ir.DataType], str],
) -> tuple[str, Slots | None, str | None]:
    """("compute" | "storage" | "kept" | "no_float", slots, reason) for one assigned node.

    "storage": the node computes in float32 but its weights may be stored in the target.
    """
    reason = _static_reason(node, keep)
    schema = None if reason else _schema(node, opset)
    if reason is not None or schema is None:
        return "kept", None, reason or "no ONNX schema"
    found = _float_slots(node, schema)
    if found is None:
        return "no_float", None, None
    slots, group = found
    dtype = target.name.lower()
    if (reason := _range_reason(node, slots, target)) is not None:
        return "kept", slots, reason
    if not _allows(schema, group, target):
        return "storage", slots, f"ONNX {node.op_type}-{schema.since_version} does not accept {dtype}"
    reason = excluded.get((node.op_type, target)) or (probe.reason(node, target, slots) if probe else None)
    return ("storage", slots, reason) if reason else ("compute", slots, None)


def plan_casts(
    model: ir.Model,
    assigned: dict[int, ir.DataType],
    keep: frozenset[str],
    probe: KernelProbe | None,
    excluded: Mapping[tuple[str, ir.DataType], str],
) -> CastPlan:
    """Decide, for every assigned node, whether it computes in its target type."""
    nodes, opset, plan = list(model.graph), ai_onnx_opset(model), CastPlan()
    cast_schema = onnx.defs.get_schema("Cast", opset, "")
    for i, target in assigned.items():
        if not _allows(cast_schema, {"T2"}, target):
            plan.kept[i] = f"Cast-{cast_schema.since_version} cannot produce {target.name.lower()}"
            continue
        kind, slots, reason = _decide(nodes[i], target, opset, keep, probe, excluded)
        if kind == "compute":
            plan.compute[i] = (target, slots)
        elif kind == "no_float":
            plan.no_float.append(i)
        else:
            plan.kept[i] = reason
            if kind == "storage":
                plan.storage[i] = (target, slots)
    for i in sorted(_islands(nodes, plan.compute)):
        plan.kept[i] = "moves data between float32 nodes (converting would only add Casts)"
        plan.storage[i] = plan.compute.pop(i)
    return plan
