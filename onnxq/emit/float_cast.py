"""Convert nodes to compute in float16 or bfloat16 (the `float16` / `bfloat16` dtypes).

How a node assigned a float target is handled, in order:

1. Static checks. Ops outside the default domain, with subgraphs, whose output type is set
   by an attribute (`dtype`), in `keep_float32_ops` (numerically sensitive), whose ONNX
   schema does not accept the target type, or with a constant input outside its range stay
   in float32. The tensors a node converts are those bound to the type constraint of its
   float32 outputs (`T` of Conv, `T1` of Resize); auxiliary inputs with their own constraint
   (Resize roi/scales, BatchNormalization statistics) keep their type.
2. Kernel probe. Each (op, type signature) is built into a one-node model and loaded in
   onnxruntime with `providers` (cached per call). A missing kernel keeps the op in float32.
   On CPU, onnxruntime loads float16 nodes that have no float16 kernel by inserting Casts
   around them and computing in float32; the probe sees those Casts in the optimised probe
   graph and also keeps such ops in float32 (unless `accept_runtime_upcast`), so that
   `converted` only names nodes that really compute in the target type.
3. Islands. Connected groups of converted nodes that only move data (Reshape, Transpose,
   Concat, ...) and touch no converted compute node or weight are left in float32:
   converting them would only add Casts.
4. Rewrite and check. The plan is applied to a clone and loaded in onnxruntime; if loading
   fails with "Could not find an implementation for <Op>(<ver>) node with name '<n>'", that
   op type goes back to float32 and the plan is rebuilt (at most one round per op type).
   The accepted plan is then applied to the model in place.

The rewrite stores float32 initializers used only by converted nodes in the target type.
Weights (>= STORAGE_MIN_ELEMENTS) of nodes assigned the target but kept in float32 for want
of a kernel or schema support are stored in the target type too, with a Cast back to
float32 ("weights stored as <dtype>, compute in float32"): the file still halves and
onnxruntime folds those Casts when it loads the model. A weight also read by a float32
node stays float32 once and is cast for the converted readers (smaller than a duplicate).
One shared Cast per (tensor, type) sits at every boundary, graph inputs and outputs keep
their types, and lossless Cast chains are folded.

onnxruntime 1.31 CPU on x86 has float16 kernels only for data movement (Reshape,
Transpose, Concat, Slice, Gather, ...), Clip, Max, Min, Round, Sign and
LayerNormalization, and bfloat16 kernels only for data movement, Sign and
LayerNormalization: there the result is mostly storage-only. `providers=()` skips the
runtime entirely and converts every eligible node (for models meant for other runtimes).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.config.spec import Config, DType
from onnxq.emit.lowering import LoweringReport, register_lowering
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.graph.save import EXTERNAL_DATA_LIMIT, weight_bytes

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

TARGETS: dict[DType, ir.DataType] = {
    DType.FLOAT16: ir.DataType.FLOAT16,
    DType.BFLOAT16: ir.DataType.BFLOAT16,
}
_NUMPY = {ir.DataType.FLOAT16: np.dtype(np.float16), ir.DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
_SUFFIX = {ir.DataType.FLOAT: "f32", ir.DataType.FLOAT16: "f16", ir.DataType.BFLOAT16: "bf16"}
_TYPE_STR = {ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}
# Casts from the first type to the second lose nothing.
_WIDENING = {
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}
_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
_PROBE_CONSTANT_LIMIT = 1024  # constant inputs up to this many elements go into probe models
# Weights of float32-computing nodes are stored in the target type (with a Cast back) from
# this many elements on; smaller constants would save fewer bytes than the Cast costs.
STORAGE_MIN_ELEMENTS = 16
_CANNOT_LOAD = "onnxruntime cannot load"


@dataclass
class FloatCastReport:
    """What `convert_float_nodes` did.

    `converted` nodes compute in their target type; `kept_float32` maps every other
    assigned node to the reason; `storage_only` names those of them whose weights are
    nevertheless stored in the target type (compute in float32 after a Cast).
    """

    converted: list[str] = field(default_factory=list)
    kept_float32: dict[str, str] = field(default_factory=dict)
    casts_inserted: int = 0
    storage_only: dict[str, str] = field(default_factory=dict)  # node -> dtype of its weights
    no_float: list[str] = field(default_factory=list)  # assigned nodes without float32 tensors
    initializers: dict[str, str] = field(default_factory=dict)  # weight -> stored dtype
    bytes_saved: int = 0
    compute_dtypes: dict[str, str] = field(default_factory=dict)  # converted node -> dtype
    notes: list[str] = field(default_factory=list)

    def summary_line(self) -> str:
        by_type: dict[str, int] = {}
        for dtype in self.compute_dtypes.values():
            by_type[dtype] = by_type.get(dtype, 0) + 1
        computed = ", ".join(f"{n} in {t}" for t, n in sorted(by_type.items())) or "none"
        return (
            f"float cast: nodes computing {computed}; {len(self.kept_float32)} kept in float32 "
            f"({len(self.storage_only)} with weights stored in the target type); "
            f"{len(self.initializers)} weights converted ({self.bytes_saved / 1024:.1f} KiB saved); "
            f"{self.casts_inserted} Casts inserted"
        )


@dataclass(frozen=True)
class _Slots:
    """Input and output positions of a node that carry its compute type."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass
class _Plan:
    """Node index -> (target type, slots) for compute nodes and for weight-storage nodes."""

    compute: dict[int, tuple[ir.DataType, _Slots]] = field(default_factory=dict)
    storage: dict[int, tuple[ir.DataType, _Slots]] = field(default_factory=dict)
    kept: dict[int, str] = field(default_factory=dict)
    no_float: list[int] = field(default_factory=list)


# -- static analysis ---------------------------------------------------------------------


def _opset(model: ir.Model) -> int:
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


def _float_slots(node: ir.Node, schema: onnx.defs.OpSchema) -> tuple[_Slots, set[str]] | None:
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
    slots = _Slots(tuple(i for i, t in ins if t in group), tuple(i for i, t in outs if t in group))
    values = [node.inputs[i] for i in slots.inputs] + [node.outputs[i] for i in slots.outputs]
    if any(v.dtype != ir.DataType.FLOAT for v in values):
        return None  # an already mixed-precision node: leave it as it is
    return slots, group


def _allows(schema: onnx.defs.OpSchema, group: set[str], target: ir.DataType) -> bool:
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    return all(_TYPE_STR[target] in allowed[name] for name in group)


def _fits(array: np.ndarray, target: ir.DataType) -> bool:
    """True when every finite value of `array` is inside the target type's range."""
    finite = np.abs(array[np.isfinite(array)]) if array.size else array
    return not finite.size or float(finite.max()) <= float(ml_dtypes.finfo(_NUMPY[target]).max)


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


def _range_reason(node: ir.Node, slots: _Slots, target: ir.DataType) -> str | None:
    """A reason when a constant input (or Constant value) does not fit the target type."""
    arrays = [(v.name, constant_array(v)) for v in (node.inputs[i] for i in slots.inputs)]
    value = node.attributes.get("value")
    if value is not None and value.type == ir.AttributeType.TENSOR:
        arrays.append(("value", value.as_tensor().numpy()))
    for name, array in arrays:
        if array is not None and not _fits(array, target):
            return f"constant {name} exceeds the {target.name.lower()} range"
    return None


# -- kernel probe ------------------------------------------------------------------------


def _value_info(name: str, dtype: ir.DataType, shape: ir.Shape | None) -> onnx.ValueInfoProto:
    dims = None
    if shape is not None:
        dims = [d if isinstance(d, int) else (str(d) if d.value else None) for d in shape]
    return onnx.helper.make_tensor_value_info(name, int(dtype), dims)


class _KernelProbe:
    """Finds, with one-node models, whether the runtime has a real kernel for a typed node."""

    def __init__(self, model: ir.Model, providers: list[str], workdir: Path, accept_upcast: bool) -> None:
        self.opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
        self.ir_version = model.ir_version
        self.providers = providers
        self.where = ", ".join(providers)
        self.workdir = workdir
        self.accept_upcast = accept_upcast
        self.cache: dict[tuple, str | None] = {}

    def reason(self, node: ir.Node, target: ir.DataType, slots: _Slots) -> str | None:
        """Why the node cannot compute in `target` in the runtime; None if it can."""
        ins = tuple(target if i in slots.inputs else (v.dtype if v else None) for i, v in enumerate(node.inputs))
        outs = tuple(target if i in slots.outputs else v.dtype for i, v in enumerate(node.outputs))
        key = (node.op_type, ins, outs)
        if key not in self.cache:
            self.cache[key] = self._probe(node, ins, outs, target)
        return self.cache[key]

    def _model(self, node: ir.Node, ins: tuple, outs: tuple) -> onnx.ModelProto:
        inputs, initializers, seen = [], [], set()
        for value, dtype in zip(node.inputs, ins):
            if value is None or value.name in seen:
                continue
            seen.add(value.name)
            array = constant_array(value)
            if array is not None and array.size <= _PROBE_CONSTANT_LIMIT and dtype != value.dtype:
                array = _cast_array(array, dtype) if dtype in _NUMPY else None
            if array is not None and array.size <= _PROBE_CONSTANT_LIMIT:
                initializers.append(ir.serde.serialize_tensor(ir.tensor(array, name=value.name)))
            else:
                inputs.append(_value_info(value.name, dtype, value.shape))
        outputs = [_value_info(v.name, t, None) for v, t in zip(node.outputs, outs) if v.name]
        proto = ir.serde.serialize_node(node)
        target = next((t for t, v in zip(outs, node.outputs) if t != v.dtype), None)
        for attr in _typed_attributes(node, target) if target is not None else []:
            kept = [a for a in proto.attribute if a.name != attr.name]
            del proto.attribute[:]
            proto.attribute.extend([*kept, ir.serde.serialize_attribute(attr)])
        graph = onnx.helper.make_graph([proto], "probe", inputs, outputs, initializers)
        return onnx.helper.make_model(graph, opset_imports=self.opsets, ir_version=self.ir_version)

    def _load(self, proto: onnx.ModelProto) -> tuple[str | None, list[str]]:
        """Load in onnxruntime: (error or None, op types of the graph it would run)."""
        path = self.workdir / f"probe{len(self.cache)}.onnx"
        options = _session_options()
        options.optimized_model_filepath = str(path)
        try:
            ort.InferenceSession(proto.SerializeToString(), options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises several exception types
            return str(exc), []
        ops = [n.op_type for n in onnx.load(str(path)).graph.node if not n.op_type.startswith("Memcpy")]
        return None, ops

    def _probe(self, node: ir.Node, ins: tuple, outs: tuple, target: ir.DataType) -> str | None:
        dtype = target.name.lower()
        error, ops = self._load(self._model(node, ins, outs))
        if error is not None:
            if _MISSING_KERNEL.search(error):
                return f"no {dtype} kernel in {self.where}"
            original = tuple(v.dtype if v else None for v in node.inputs)
            control, _ = self._load(self._model(node, original, tuple(v.dtype for v in node.outputs)))
            if control is not None:
                return None  # the probe itself is not representative; the model check decides
            return f"onnxruntime rejects {node.op_type} in {dtype}: {_first_line(error)}"
        if ops != [node.op_type] and not self.accept_upcast:
            return f"no {dtype} kernel in {self.where} (onnxruntime would compute it in float32)"
        return None


def _session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0][:200] if lines else "unknown error"


def _session_error(model: ir.Model, providers: list[str], workdir: Path) -> str | None:
    """Load `model` in onnxruntime; the error message, or None when it loads."""
    try:
        if weight_bytes(model) > EXTERNAL_DATA_LIMIT:
            path = workdir / "check.onnx"
            ir.save(model, path, external_data="check.onnx.data")
            ort.InferenceSession(str(path), _session_options(), providers=providers)
        else:
            ort.InferenceSession(ir.to_proto(model).SerializeToString(), _session_options(), providers=providers)
    except Exception as exc:  # onnxruntime raises several exception types
        return str(exc)
    return None


# -- planning ----------------------------------------------------------------------------


def _islands(nodes: list[ir.Node], compute: dict[int, tuple[ir.DataType, _Slots]]) -> set[int]:
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
    probe: _KernelProbe | None,
    excluded: Mapping[tuple[str, ir.DataType], str],
) -> tuple[str, _Slots | None, str | None]:
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


def _plan(
    model: ir.Model,
    assigned: dict[int, ir.DataType],
    keep: frozenset[str],
    probe: _KernelProbe | None,
    excluded: Mapping[tuple[str, ir.DataType], str],
) -> _Plan:
    """Decide, for every assigned node, whether it computes in its target type."""
    nodes, opset, plan = list(model.graph), _opset(model), _Plan()
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


# -- rewrite -----------------------------------------------------------------------------


def _cast_array(array: np.ndarray, target: ir.DataType) -> np.ndarray:
    return np.asarray(array, dtype=np.float32).astype(_NUMPY[target])


def _typed_attributes(node: ir.Node, target: ir.DataType) -> list[ir.Attr]:
    """New values of the attributes that fix the output type (Cast `to`, Constant `value`)."""
    if node.op_type == "Cast":
        return [ir.AttrInt64("to", int(target))]
    if node.op_type in ("ConstantOfShape", "Constant"):
        attr = node.attributes.get("value")
        array = attr.as_tensor().numpy() if attr is not None else np.zeros(1, np.float32)
        return [ir.AttrTensor("value", ir.tensor(_cast_array(array, target)))]
    return []


class _Rewriter:
    """Applies a plan to one graph in place."""

    def __init__(self, model: ir.Model, plan: _Plan, tensors: dict[tuple[str, ir.DataType], ir.Tensor]) -> None:
        self.graph = model.graph
        self.nodes = list(self.graph)
        self.index = {id(node): i for i, node in enumerate(self.nodes)}
        self.plan = plan
        self.tensors = tensors  # converted initializer tensors, shared between rewrites
        self.edit = GraphEditor(self.graph)
        self.original: dict[int, ir.DataType | None] = {}  # id(value) -> dtype before
        self.inserted: list[ir.Node] = []
        self.converted_weights: dict[str, tuple[ir.DataType, int]] = {}
        self.storage_nodes: set[int] = set()  # storage-plan nodes that got a converted weight
        self.last_after: dict[int, ir.Node] = {}

    def run(self) -> None:
        for i, (target, slots) in self.plan.compute.items():
            node = self.nodes[i]
            for j in slots.outputs:
                self._retype(node.outputs[j], target)
            for attr in _typed_attributes(node, target) if slots.outputs else []:
                node.attributes[attr.name] = attr
        self._convert_initializers()
        values = list(self.graph.inputs) + list(self.graph.initializers.values())
        values += [v for node in self.nodes for v in node.outputs]
        for value in values:
            self._bridge(value)
        _fold_cast_pairs(self.graph, self.inserted)

    def _retype(self, value: ir.Value, dtype: ir.DataType) -> None:
        self.original.setdefault(id(value), value.dtype)
        value.type = ir.TensorType(dtype)  # a new object: clones share their type objects

    def _node_index(self, node: ir.Node) -> int:
        """Position of `node` in the graph before the rewrite; -1 for other nodes."""
        return self.index.get(id(node), -1) if node.graph is self.graph else -1

    def _wanted(self, node: ir.Node, index: int, original: ir.DataType | None) -> ir.DataType | None:
        """The type input `index` of `node` needs."""
        entry = self.plan.compute.get(self._node_index(node))
        return entry[0] if entry is not None and index in entry[1].inputs else original

    def _storage_target(self, value: ir.Value, size: int) -> ir.DataType | None:
        """The one type every use of this float32 weight can take it in, else None."""
        targets, cast_back = set(), False
        for node, k in value.uses():
            i = self._node_index(node)
            entry = self.plan.compute.get(i) or self.plan.storage.get(i)
            if entry is None or k not in entry[1].inputs:
                return None
            targets.add(entry[0])
            cast_back |= i not in self.plan.compute
        if len(targets) != 1 or (cast_back and size < STORAGE_MIN_ELEMENTS):
            return None
        return targets.pop()

    def _convert_initializers(self) -> None:
        for name, value in list(self.graph.initializers.items()):
            if value.dtype != ir.DataType.FLOAT or value.is_graph_input() or value.is_graph_output():
                continue
            array = constant_array(value)
            target = self._storage_target(value, array.size) if array is not None else None
            if target is None or not _fits(array, target):
                continue
            key = (name, target)
            if key not in self.tensors:
                self.tensors[key] = ir.tensor(_cast_array(array, target), name=name)
            value.const_value = self.tensors[key]
            self.storage_nodes.update(i for i in map(self._node_index, value.consumers()) if i in self.plan.storage)
            self._retype(value, target)
            self.converted_weights[name] = (target, array.nbytes - self.tensors[key].nbytes)

    def _bridge(self, value: ir.Value) -> None:
        """Give every use of `value` the type it needs, one shared Cast per type."""
        stored, original = value.dtype, self.original.get(id(value), value.dtype)
        if stored not in _FLOATS and original not in _FLOATS:
            return
        groups: dict[ir.DataType, list[tuple[ir.Node, int]]] = {}
        for node, k in value.uses():
            wanted = self._wanted(node, k, original)
            if wanted is not None and wanted != stored:
                groups.setdefault(wanted, []).append((node, k))
        is_output = value.is_graph_output() and stored != original
        if is_output:
            groups.setdefault(original, [])
        for wanted, uses in groups.items():
            rename = is_output and wanted == original
            cast_out = self._cast(value, wanted, rename)
            for node, k in uses:
                node.replace_input_with(k, cast_out)

    def _cast(self, value: ir.Value, dtype: ir.DataType, as_graph_output: bool) -> ir.Value:
        """Insert Cast(value -> dtype); as a graph output it takes over the value's name."""
        if as_graph_output:
            name = value.name
            value.name = self.edit.unique(f"{name}_{_SUFFIX.get(value.dtype, 'cast')}")
        else:
            name = self.edit.unique(f"{value.name}_{_SUFFIX.get(dtype, 'cast')}")
        out = ir.Value(name=name, shape=value.shape.copy() if value.shape is not None else None)
        out.type = ir.TensorType(dtype)
        cast = ir.node("Cast", [value], {"to": int(dtype)}, outputs=[out], name=self.edit.unique(f"{name}_Cast"))
        producer = value.producer()
        if producer is not None and producer.graph is self.graph:
            self.graph.insert_after(self.last_after.get(id(producer), producer), cast)
            self.last_after[id(producer)] = cast
        else:
            self.graph.insert_before(self.nodes[0], cast)
        if as_graph_output:
            for i, output in enumerate(self.graph.outputs):
                if output is value:
                    self.graph.outputs[i] = out
        self.inserted.append(cast)
        return out


def _fold_cast_pairs(graph: ir.Graph, inserted: list[ir.Node]) -> None:
    """Fold Cast(a->b) -> Cast(b->c) chains that involve an inserted Cast and lose nothing.

    The insertion never chains two of its own Casts, but it can meet a Cast of the model
    (x_f16 -> Cast(f32) -> inserted Cast(f16)). When the first cast widens (a -> b exact),
    the second reads the source directly and disappears when a == c; the first goes when
    nothing else reads it.
    """
    ours = {id(node) for node in inserted}
    for node in list(graph):
        if node.op_type != "Cast" or node.graph is not graph:
            continue
        middle = node.inputs[0]
        first = middle.producer()
        if first is None or first.op_type != "Cast" or first.graph is not graph:
            continue
        a, b, c = first.inputs[0].dtype, middle.dtype, node.outputs[0].dtype
        lossless = a == b or (a, b) in _WIDENING
        if not (lossless and {a, b, c} <= _FLOATS and (id(first) in ours or id(node) in ours)):
            continue
        source, out = first.inputs[0], node.outputs[0]
        if a == c and not out.is_graph_output():
            out.replace_all_uses_with(source)
            _remove(graph, node, inserted)
        else:
            node.replace_input_with(0, source)
        if not middle.uses() and not middle.is_graph_output():
            _remove(graph, first, inserted)


def _remove(graph: ir.Graph, node: ir.Node, inserted: list[ir.Node]) -> None:
    graph.remove(node, safe=True)
    if node in inserted:
        inserted.remove(node)


# -- entry point -------------------------------------------------------------------------


def _node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _assigned(model: ir.Model, nodes: Mapping[str, DType | str], report: FloatCastReport) -> dict[int, ir.DataType]:
    """Node index -> target type, in graph order; unknown names become a note."""
    wanted: dict[str, ir.DataType] = {}
    for name, dtype in nodes.items():
        if DType(dtype) not in TARGETS:
            raise ValueError(f"node {name!r}: {dtype} is not a float target (float16 or bfloat16)")
        wanted[name] = TARGETS[DType(dtype)]
    assigned, seen = {}, set()
    for i, node in enumerate(model.graph):
        if node.name in wanted:
            assigned[i] = wanted[node.name]
            seen.add(node.name)
    missing = [name for name in wanted if name not in seen]
    if missing:
        report.notes.append(f"float cast: {len(missing)} assigned nodes not in the graph: {', '.join(missing[:5])}")
    return assigned


def _culprit(error: str, nodes: list[ir.Node], plan: _Plan) -> tuple[str, ir.DataType] | None:
    """The (op type, target) of the converted node onnxruntime has no kernel for."""
    match = _MISSING_KERNEL.search(error)
    if match is None:
        return None
    op_type, name = match.group(1), match.group(3)
    for i, (target, _) in plan.compute.items():
        if nodes[i].name == name and nodes[i].op_type == op_type:
            return op_type, target
    targets = [t for i, (t, _) in plan.compute.items() if nodes[i].op_type == op_type]
    return (op_type, targets[0]) if targets else None


def _available(providers: Sequence[str], report: FloatCastReport) -> list[str]:
    available = set(ort.get_available_providers())
    usable = [p for p in providers if p in available]
    skipped = [p for p in providers if p not in available]
    if skipped:
        report.notes.append(f"float cast: {', '.join(skipped)} not available; kernels checked without them")
    if providers and not usable:
        usable = ["CPUExecutionProvider"]
    return usable


def _settle(
    model: ir.Model,
    assigned: dict[int, ir.DataType],
    keep: frozenset[str],
    providers: list[str],
    accept_upcast: bool,
    tensors: dict[tuple[str, ir.DataType], ir.Tensor],
    report: FloatCastReport,
) -> _Plan:
    """Plan, rewrite a clone and load it; move op types without kernels back until it loads."""
    excluded: dict[tuple[str, ir.DataType], str] = {}
    with tempfile.TemporaryDirectory(prefix="onnxq_float_cast_") as tmp:
        workdir = Path(tmp)
        probe = _KernelProbe(model, providers, workdir, accept_upcast) if providers else None
        nodes = list(model.graph)
        rounds = len({(nodes[i].op_type, target) for i, target in assigned.items()}) + 1
        for _ in range(rounds):  # each round excludes a new (op, type) or returns
            plan = _plan(model, assigned, keep, probe, excluded)
            if not providers:
                return plan
            trial = model.clone()
            trial_nodes = list(trial.graph)
            _Rewriter(trial, plan, tensors).run()
            error = _session_error(trial, providers, workdir)
            if error is None:
                return plan
            culprit = _culprit(error, trial_nodes, plan)
            if culprit is not None and culprit not in excluded:
                excluded[culprit] = f"no {culprit[1].name.lower()} kernel in {', '.join(providers)}"
                continue
            if _session_error(model, providers, workdir) is not None:
                report.notes.append(f"float cast: {_CANNOT_LOAD} the model before conversion; runtime check skipped")
                return plan
            raise RuntimeError(f"float cast: {_CANNOT_LOAD} the converted model: {_first_line(error)}")
    raise RuntimeError(f"float cast: no loadable model after {rounds} rounds of removing missing kernels")


def convert_float_nodes(
    model: ir.Model,
    nodes: Mapping[str, DType],
    keep_float32_ops: Iterable[str] = DEFAULT_KEEP_FLOAT32,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    accept_runtime_upcast: bool = False,
) -> FloatCastReport:
    """Make the named nodes compute in float16 / bfloat16 where `providers` can; in place.

    `nodes` maps node names to DType.FLOAT16 or DType.BFLOAT16. Graph inputs and outputs
    keep their types. Nodes that stay in float32 are reported with the reason; weights of
    assigned nodes without a kernel are still stored in the target type. With empty
    `providers` nothing is checked in onnxruntime: every eligible node is converted.
    `accept_runtime_upcast` keeps float16 nodes that onnxruntime can only run by inserting
    Casts around them (CPU), for models meant for another runtime.
    """
    report = FloatCastReport()
    assigned = _assigned(model, nodes, report)
    if not assigned:
        return report
    keep = frozenset(keep_float32_ops)
    tensors: dict[tuple[str, ir.DataType], ir.Tensor] = {}
    plan = _settle(model, assigned, keep, _available(providers, report), accept_runtime_upcast, tensors, report)
    node_list = list(model.graph)
    rewriter = _Rewriter(model, plan, tensors)
    rewriter.run()
    _fill_report(report, node_list, plan, rewriter)
    return report


def _fill_report(report: FloatCastReport, nodes: list[ir.Node], plan: _Plan, rewriter: _Rewriter) -> None:
    for i, (target, _) in plan.compute.items():
        label = _node_label(nodes[i], i)
        report.converted.append(label)
        report.compute_dtypes[label] = target.name.lower()
    for name, (target, saved) in rewriter.converted_weights.items():
        report.initializers[name] = target.name.lower()
        report.bytes_saved += saved
    for i in sorted(plan.kept):
        label, reason = _node_label(nodes[i], i), plan.kept[i]
        if i in rewriter.storage_nodes:
            dtype = plan.storage[i][0].name.lower()
            report.storage_only[label] = dtype
            reason += f"; weights stored as {dtype}, compute in float32"
        report.kept_float32[label] = reason
    report.no_float = [_node_label(nodes[i], i) for i in plan.no_float]
    report.casts_inserted = len(rewriter.inserted)


@register_lowering("float_target", order=40)
def _lower(model: ir.Model, nodes: Mapping[str, DType], config: Config) -> LoweringReport:
    keep = (*DEFAULT_KEEP_FLOAT32, *config.float_op_types)
    report = convert_float_nodes(model, nodes, keep, config.calibration.providers)
    return LoweringReport(dict(report.kept_float32), list(report.converted), [report.summary_line(), *report.notes])
