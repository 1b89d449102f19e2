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
CPU runs float16 nodes anyway (it inserts those Casts itself).
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
    """What `upcast_half` changed: each converted main-graph initializer's type in the input
    model, the graph inputs and outputs that keep their type through a Cast, and the Casts
    that became float32 to float32 and were removed."""

    weights: dict[str, ir.DataType] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    casts_removed: int = 0
    boundary_casts: list[str] = field(default_factory=list)  # the Casts added at the inputs and outputs

    def keep_float(self) -> dict[str, str]:
        """The added Casts as nodes that stay float, with the plan's reason."""
        return {name: "converts a half-typed model input or output (the model is quantized in float32 between them)"
                for name in self.boundary_casts}

    def note(self, restored: int) -> str:
        kinds = "/".join(sorted({str(t.name).lower() for t in self.weights.values()}) or ["float16"])
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


def is_half(model: ir.Model) -> bool:
    """Whether any value of the model (subgraphs included) is float16 or bfloat16."""
    return any(v.dtype in HALF for g in _graphs(model.graph) for v in _values(g))


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
    for name, value in graph.initializers.items():
        if value.dtype in HALF and value.const_value is not None:
            if main:
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


def _keep_inputs(graph: ir.Graph, report: Upcast) -> None:
    """Each half graph input read through a Cast to float32 by everything that read it."""
    for value in graph.inputs:
        if value.dtype not in HALF or not value.uses():
            continue
        cast = _cast(value, ir.DataType.FLOAT, f"{value.name}_to_float32")
        cast.outputs[0].name = f"{value.name}_float32"
        ir.convenience.replace_all_uses_with(value, cast.outputs[0])
        cast.replace_input_with(0, value)  # replace_all_uses_with moved the Cast's own read too
        graph.insert_before(graph.node(0), cast) if len(graph) else graph.append(cast)
        report.inputs.append(value.name)
        report.boundary_casts.append(cast.name)


def _keep_outputs(graph: ir.Graph, half_outputs: dict[int, ir.DataType], report: Upcast) -> None:
    """Each graph output that was half written by a Cast back from the float32 value."""
    for index, to in half_outputs.items():
        value = graph.outputs[index]
        if value.producer() is None:  # an input or initializer passed through: left as it is
            continue
        name = value.name
        value.name = f"{name}_float32"
        cast = _cast(value, to, f"{name}_to_{to.name.lower()}")
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
    if not is_half(model):
        return None
    report = Upcast()
    graph = model.graph
    brain = [v.name for v in [*graph.inputs, *graph.outputs] if v.dtype == ir.DataType.BFLOAT16]
    if brain:
        raise UnsupportedModelError(
            f"the model's input or output {brain[0]!r} is bfloat16, which onnxruntime's Python API can neither feed "
            "nor return, so onnxq cannot calibrate or check it; export the model with float32 or float16 inputs and "
            "outputs (bfloat16 inside it is quantized as float32)")
    half_outputs = {i: v.dtype for i, v in enumerate(graph.outputs) if v.dtype in HALF}
    for sub in _graphs(graph):
        _upcast_graph(sub, report, main=sub is graph)
    _keep_outputs(graph, half_outputs, report)
    _keep_inputs(graph, report)
    report.casts_removed = sum(_drop_identity_casts(g) for g in _graphs(graph))
    return report


def restore_half_weights(model: ir.Model, weights: dict[str, ir.DataType]) -> int:
    """Store each of `weights` (the initializers `upcast_half` converted) that is still a
    float32 initializer of `model`, with the values it had, in its half type again, read
    through a Cast to float32; returns how many."""
    graph = model.graph
    restored = 0
    for name, dtype in weights.items():
        value = graph.initializers.get(name)
        if value is None or value.dtype != ir.DataType.FLOAT or value.const_value is None \
                or value.const_value.size < RESTORE_MIN_ELEMENTS or not value.uses():
            continue
        array = value.const_value.numpy()
        if not np.array_equal(array.astype(dtype.numpy()).astype(np.float32), array):
            continue  # a pass rewrote it (CLE's scales, SmoothQuant's in a norm): float32 keeps what it did
        half = ir.Value(name=f"{name}_{dtype.name.lower()}", type=ir.TensorType(dtype), shape=value.shape,
                        const_value=ir.Tensor(array.astype(dtype.numpy()), dtype=dtype))
        graph.register_initializer(half)
        cast = _cast(half, ir.DataType.FLOAT, f"{name}_to_float32")
        ir.convenience.replace_all_uses_with(value, cast.outputs[0])
        del graph.initializers[name]
        cast.outputs[0].name = name
        graph.insert_before(graph.node(0), cast) if len(graph) else graph.append(cast)
        restored += 1
    return restored
