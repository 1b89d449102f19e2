"""Float16 and bfloat16 models, quantized as the float32 models they stand for.

Why: calibration, the algorithms and the Q/DQ emitted all work in float32. onnxruntime's
fused int8 CPU kernels (QLinearConv, MatMulInteger...) read float32 DequantizeLinear
outputs; float16 Q/DQ needs float16 scales at opset 19 and then runs float16 Convs, which
the CPU does not have (a float16 model's every DequantizeLinear was refused at the load
check, and the whole model stayed float). Every float16 and bfloat16 value is a float32
value exactly, so at load a half model becomes float32 inside:

- initializers and tensor attributes (ConstantOfShape's value) in float32, the same values;
- `Cast(to=half)` and `dtype` attributes (RandomNormal, EyeLike, ...) name float32, and a
  Cast left from float32 to float32 is removed;
- graph inputs and outputs keep their types through one Cast each, so the quantized model
  is fed and read as the float one was. bfloat16 inputs and outputs are refused: onnxruntime's
  Python API neither takes nor returns bfloat16 arrays, so no calibration or check could
  run (bfloat16 inside a float32 model is fine).

After emission, the weights that stayed float are written back in their type with a Cast
to float32 (`restore_half_weights`), which onnxruntime folds when it loads the model: the
file does not grow where layers stay float, and they compute in float32, as onnxruntime's
CPU runs float16 nodes anyway (it inserts those Casts itself). Which recipes want this is
`pipeline.prepare.wants_float32`'s call. Names added avoid the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.errors import UnsupportedModelError

HALF = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# Attributes that name an element type, on default-domain ops (Cast's `to`; `dtype` of
# RandomNormal, RandomUniform, EyeLike, the *Like random ops, Multinomial, Bernoulli).
TYPE_ATTRIBUTES = ("to", "dtype")
# A weight left float is stored in its half type again from this many elements on; a
# smaller constant saves fewer bytes than its Cast costs (as `emit.float_cast` stores).
RESTORE_MIN_ELEMENTS = 16


@dataclass
class Upcast:
    """What `upcast_half` changed: each converted initializer's type in the input model
    (subgraphs' included), the graph inputs and outputs that keep their type through a Cast, and the Casts
    that became float32 to float32 and were removed."""

    weights: dict[str, ir.DataType] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    casts_removed: int = 0
    boundary_casts: list[str] = field(default_factory=list)  # the Casts added at the inputs and outputs
    kinds: list[str] = field(default_factory=list)  # the half types the model held: float16, bfloat16

    def keep_float(self) -> dict[str, str]:
        """The added Casts as nodes that stay float, with the plan's reason."""
        return {name: "converts a half-typed model input or output (the model is quantized in float32 between them)"
                for name in self.boundary_casts}

    def note(self, restored: int) -> str:
        kinds = "/".join(self.kinds)
        boundary = len(self.inputs) + len(self.outputs)
        kept = f", its half-typed inputs and outputs ({boundary}) kept through a Cast each" if boundary else ""
        return (f"{kinds} model: quantized as float32 (the same values){kept}; {restored} weights left float stored "
                f"as {kinds} again, computed in float32")


def _graphs(graph: ir.Graph) -> list[ir.Graph]:
    found = [graph]
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                found.extend(_graphs(attr.value))
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    found.extend(_graphs(sub))
    return found


def _values(graph: ir.Graph) -> list[ir.Value]:
    return [*graph.inputs, *graph.initializers.values(), *(v for node in graph for v in node.outputs)]


def _half_types(model: ir.Model) -> list[str]:
    """The half types of the model's values and tensor attributes, subgraphs included."""
    found = {v.dtype for g in _graphs(model.graph) for v in _values(g)}
    found |= {a.value.dtype for g in _graphs(model.graph) for n in g for a in n.attributes.values()
              if a.type == ir.AttributeType.TENSOR}
    return sorted(t.name.lower() for t in found & HALF)


def is_half(model: ir.Model) -> bool:
    """Whether any value of the model (subgraphs included) is float16 or bfloat16."""
    return bool(_half_types(model))


def _names(model: ir.Model) -> set[str]:
    """Every value and node name of the model, subgraphs included (new names avoid them)."""
    taken = set()
    for g in _graphs(model.graph):
        taken |= {v.name for v in _values(g) if v.name} | {n.name for n in g if n.name}
    return taken


def _fresh(taken: set[str], base: str) -> str:
    """`base`, or `base_1`, `base_2`, ... where it is taken; the name is taken from then on."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _half_node(node: ir.Node) -> bool:
    """Whether a node computes in a half type: a half output, tensor attribute or Cast."""
    return any(v.dtype in HALF for v in node.outputs) or any(
        (a.type == ir.AttributeType.TENSOR and a.value.dtype in HALF)
        or (name in TYPE_ATTRIBUTES and a.type == ir.AttributeType.INT and a.value in {int(t) for t in HALF})
        for name, a in node.attributes.items())


def _float32(tensor: ir.TensorProtocol) -> ir.Tensor:
    return ir.Tensor(np.asarray(tensor.numpy(), dtype=np.float32), name=tensor.name)


def _upcast_attributes(node: ir.Node) -> None:
    for name, attr in list(node.attributes.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype in HALF:
            node.attributes[name] = ir.AttrTensor(name, _float32(attr.value))
        elif (name in TYPE_ATTRIBUTES and node.domain in ("", "ai.onnx") and attr.type == ir.AttributeType.INT
              and ir.DataType(attr.value) in HALF):
            node.attributes[name] = ir.AttrInt64(name, int(ir.DataType.FLOAT))


def _upcast_graph(graph: ir.Graph, report: Upcast, main: bool) -> None:
    outputs = set(graph.outputs) if main else set()  # a half initializer the model returns stays as it is
    for name, value in graph.initializers.items():
        if value.dtype in HALF and value.const_value is not None and value not in outputs:
            report.weights[name] = value.dtype
            value.const_value = _float32(value.const_value)
            value.dtype = ir.DataType.FLOAT
    for node in graph:
        _upcast_attributes(node)
        for value in node.outputs:
            if value.dtype in HALF:
                value.dtype = ir.DataType.FLOAT
    if not main:  # a subgraph's inputs and outputs are its node's business: float32 throughout
        for value in [*graph.inputs, *graph.outputs]:
            if value.dtype in HALF:
                value.dtype = ir.DataType.FLOAT


def _cast(value: ir.Value, to: ir.DataType, name: str) -> ir.Node:
    node = ir.node("Cast", [value], attributes={"to": ir.AttrInt64("to", int(to))}, name=name)
    node.outputs[0].dtype = to
    node.outputs[0].shape = value.shape
    return node


def _prepend(graph: ir.Graph, node: ir.Node) -> None:
    """`node` first in `graph` (a Cast of an input or a constant, read by what follows)."""
    if len(graph):
        graph.insert_before(graph.node(0), node)
    else:
        graph.append(node)


def _keep_inputs(graph: ir.Graph, report: Upcast, taken: set[str]) -> None:
    """Each half graph input read through a Cast to float32 by the nodes that read it, and
    each half initializer the graph returns read as a float32 copy (a constant still: its
    readers' weights stay quantizable); the graph output it also is stays itself."""
    outputs = set(graph.outputs)
    for value in [*graph.inputs, *(v for v in list(graph.initializers.values()) if v in outputs)]:
        uses = list(value.uses())
        if value.dtype not in HALF or not uses:
            continue
        if value.const_value is not None:
            source = ir.Value(name=_fresh(taken, f"{value.name}_float32"), type=ir.TensorType(ir.DataType.FLOAT),
                              shape=value.shape, const_value=_float32(value.const_value))
            graph.register_initializer(source)
            report.weights[source.name] = value.dtype
        else:
            cast = _cast(value, ir.DataType.FLOAT, _fresh(taken, f"{value.name}_to_float32"))
            cast.outputs[0].name = _fresh(taken, f"{value.name}_float32")
            _prepend(graph, cast)
            report.inputs.append(value.name)
            report.boundary_casts.append(cast.name)
            source = cast.outputs[0]
        for node, index in uses:
            node.replace_input_with(index, source)


def _keep_outputs(graph: ir.Graph, half_outputs: dict[int, ir.DataType], report: Upcast, taken: set[str]) -> None:
    """Each graph output that was half written by a Cast back from the float32 value (a
    graph input or initializer returned as it is keeps its type already)."""
    for index, to in half_outputs.items():
        value = graph.outputs[index]
        if value.producer() is None:
            continue
        name = value.name
        value.name = _fresh(taken, f"{name}_float32")
        cast = _cast(value, to, _fresh(taken, f"{name}_to_{to.name.lower()}"))
        cast.outputs[0].name = name
        graph.append(cast)
        graph.outputs[index] = cast.outputs[0]
        report.outputs.append(name)
        report.boundary_casts.append(cast.name)


def _drop_identity_casts(graph: ir.Graph) -> int:
    """Remove the Casts that now cast float32 to float32 (the model's own casts to half),
    unless they write a graph output; returns how many."""
    outputs = set(graph.outputs)
    removed = 0
    for node in list(graph):
        to = node.attributes.get("to")
        if (node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None
                and node.inputs[0].dtype == ir.DataType.FLOAT and to is not None
                and to.value == int(ir.DataType.FLOAT) and node.outputs[0] not in outputs):
            ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
            graph.remove(node, safe=True)
            removed += 1
    return removed


def upcast_half(model: ir.Model) -> Upcast | None:
    """Make a float16/bfloat16 model float32 inside, in place (module doc); None where the
    model holds no half value."""
    kinds = _half_types(model)
    if not kinds:
        return None
    if any(_half_node(n) for f in model.functions.values() for n in f):
        return None  # model-local functions keep their half bodies: the model stays as it was given
    report = Upcast()
    graph = model.graph
    brain = [v.name for v in [*graph.inputs, *graph.outputs] if v.dtype == ir.DataType.BFLOAT16]
    if brain:
        raise UnsupportedModelError(
            f"the model's input or output {brain[0]!r} is bfloat16, which onnxruntime's Python API can neither feed "
            "nor return, so onnxq cannot calibrate or check it; export the model with float32 or float16 inputs and "
            "outputs (bfloat16 inside it is quantized as float32)")
    report.kinds = kinds
    taken = _names(model)
    half_outputs = {i: v.dtype for i, v in enumerate(graph.outputs) if v.dtype in HALF}
    for sub in _graphs(graph):
        _upcast_graph(sub, report, main=sub is graph)
    _keep_outputs(graph, half_outputs, report, taken)
    _keep_inputs(graph, report, taken)
    report.casts_removed = sum(_drop_identity_casts(g) for g in _graphs(graph))
    return report


def restore_half_weights(model: ir.Model, weights: dict[str, ir.DataType]) -> int:
    """Store each of `weights` (the initializers `upcast_half` converted, of the main graph
    or a subgraph) that is still a float32 initializer of `model`, with the values it had,
    in its half type again, read through a Cast to float32 in its graph; returns how many."""
    restored = 0
    taken = _names(model) if weights else set()
    found = [(g, v) for g in _graphs(model.graph) if weights for v in list(g.initializers.values()) if v.name in weights]
    for graph, value in found:
        name, dtype = value.name, weights[value.name]
        if value.dtype != ir.DataType.FLOAT or value.const_value is None \
                or value.const_value.size < RESTORE_MIN_ELEMENTS or not value.uses():
            continue
        array = value.const_value.numpy()
        if not np.array_equal(array.astype(dtype.numpy()).astype(np.float32), array):
            continue  # a pass rewrote it (CLE's scales, SmoothQuant's in a norm): float32 keeps what it did
        half = ir.Value(name=_fresh(taken, f"{name}_{dtype.name.lower()}"), type=ir.TensorType(dtype),
                        shape=value.shape, const_value=ir.Tensor(array.astype(dtype.numpy()), dtype=dtype))
        graph.register_initializer(half)
        cast = _cast(half, ir.DataType.FLOAT, _fresh(taken, f"{name}_to_float32"))
        ir.convenience.replace_all_uses_with(value, cast.outputs[0])
        del graph.initializers[name]
        cast.outputs[0].name = name
        _prepend(graph, cast)
        restored += 1
    return restored
