"""Normalising a model for quantization: old opsets upgraded, initializers that are graph
inputs (IR < 4) dropped, two-input Sum as Add, types and shapes inferred (sequence and
optional values keep their types), and old per-channel PRelu slopes made to broadcast."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import onnx
import onnx.version_converter
import onnx_ir as ir

from onnxq.errors import ModelError
from onnxq.graph.checks import has_map, subgraphs
from onnxq.graph.edit import GraphEditor, set_constant
from onnxq.graph.schema_types import fill_dtypes

# Per-channel QuantizeLinear/DequantizeLinear (the `axis` attribute) needs opset 13.
MIN_OPSET = 13
IR_FOR_OPSET = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}
# Up to opset 6, PRelu's 1-D slope was per channel; from opset 7 it broadcasts from the right.
PRELU_BROADCAST_OPSET = 7
# Shape inference gets initializers above this many bytes as typed inputs without data.
INFERENCE_INLINE_BYTES = 1024


def default_opset(proto: onnx.ModelProto) -> int:
    """Version of the default ('' / ai.onnx) opset the model imports."""
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise ModelError("model imports no default ONNX opset; re-export it with a standard opset")


def upgrade_opset(proto: onnx.ModelProto, opset: int, target: int) -> onnx.ModelProto:
    """Convert to `target` when older; refuse opsets newer than the installed onnx knows."""
    latest = onnx.defs.onnx_opset_version()
    if opset > latest:
        raise ModelError(
            f"model uses opset {opset} but the installed onnx supports up to {latest}; "
            "upgrade the onnx package or export with a lower opset"
        )
    if opset >= target:
        return proto
    if opset < 7:
        proto = _aligned_broadcasts(proto)
    _refuse_removed_ops(proto, opset, target)
    try:
        upgraded = onnx.version_converter.convert_version(proto, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors of many kinds
        raise ModelError(
            f"cannot upgrade opset {opset} to {target} ({str(exc).splitlines()[0]}); "
            f"re-export the model with opset >= {target}"
        ) from None
    # The IR version that goes with the opset; initializers need not be inputs from IR 4 on.
    upgraded.ir_version = max(upgraded.ir_version, IR_FOR_OPSET.get(target, 10))
    return upgraded


# Experimental ops of early opsets that later onnx removed (no schema, so no upgrade), and
# the standard ops that compute them.
REMOVED_OPS = {
    "ImageScaler": "Mul by its scale, then Add of its per-channel bias",
    "Scale": "Mul by its scale",
    "Crop": "Slice",
    "Affine": "Mul by alpha, then Add of beta",
    "ScaledTanh": "Mul by beta, Tanh, Mul by alpha",
    "ParametricSoftplus": "Mul by beta, Softplus, Mul by alpha",
    "GivenTensorFill": "a Constant",
    "DynamicSlice": "Slice (opset 10 and later takes its starts and ends as inputs)",
}


def _refuse_removed_ops(proto: onnx.ModelProto, opset: int, target: int) -> None:
    """One line naming the ops onnx removed, and what computes each (onnx's version
    converter stops on them with its C++ assertion; legacy trial: ImageScaler, in the
    model zoo's tiny-yolov2)."""
    removed = sorted({n.op_type for n in proto.graph.node if n.domain in ("", "ai.onnx")
                      and not onnx.defs.has(n.op_type) and n.op_type in REMOVED_OPS})
    if removed:
        how = "; ".join(f"{op}: {REMOVED_OPS[op]}" for op in removed)
        raise ModelError(f"cannot upgrade opset {opset} to {target}: {', '.join(removed)} "
                         f"{'was an experimental op' if len(removed) == 1 else 'were experimental ops'} that onnx "
                         f"removed; replace {'it' if len(removed) == 1 else 'each'} with standard ops ({how}) and "
                         "quantize that model")


# Ops that broadcast by their `broadcast` and `axis` attributes before opset 7.
_LEGACY_BROADCAST = ("Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less")


def _aligned_broadcasts(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of an opset < 7 model whose constant operands broadcast at an `axis` (a
    per-channel scale [C] on [N, C, H, W], broadcast=1 axis=1, as Caffe2-era exporters
    wrote) are reshaped to align at the end ([C, 1, 1]), as numpy broadcasting reads them:
    onnx's version converter unsqueezes [C] to [C, 1, 1, 1] instead, and the upgraded
    model silently output [C, C, H, W] (legacy trial). An operand aligned at the end
    already is left to the converter; one that needs the reshape but cannot take it (a
    runtime value, one read by other nodes too, or one of unknown rank) is refused."""
    fixes: dict[str, tuple[int, ...]] = {}
    ranks: dict[str, int] | None = None  # inferred once, where some node needs them
    weights = {t.name: t for t in proto.graph.initializer}
    readers = Counter(name for node in proto.graph.node for name in node.input)
    for node in proto.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type not in _LEGACY_BROADCAST or not attrs.get("broadcast") or "axis" not in attrs:
            continue
        if ranks is None:
            inferred = onnx.shape_inference.infer_shapes(proto)
            ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*inferred.graph.value_info,
                                                                          *inferred.graph.input]
                     if v.type.tensor_type.HasField("shape")}
        a, b = node.input[0], node.input[1]
        rank_a = ranks.get(a)
        shape_b = tuple(weights[b].dims) if b in weights else None
        rank_b = len(shape_b) if shape_b is not None else ranks.get(b)
        if rank_a is not None and rank_b is not None and attrs["axis"] == rank_a - rank_b:
            continue  # aligned at the end already: the converter reads it right
        if shape_b is not None and rank_a is not None and 0 <= attrs["axis"] <= rank_a - len(shape_b) \
                and readers.get(b) == 1:
            fixes[b] = shape_b + (1,) * (rank_a - attrs["axis"] - len(shape_b))
            continue
        raise ModelError(f"{node.op_type} node {node.name or node.output[0]!r} broadcasts its second input at axis "
                         f"{attrs['axis']} (opset {default_opset(proto)}'s broadcast attribute), which onnx's version "
                         "converter upgrades wrongly where the operand is not a constant of known rank read by this node "
                         "alone; re-export the model with opset >= 7")
    if not fixes:
        return proto
    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    for tensor in fixed.graph.initializer:
        if tensor.name in fixes:
            tensor.dims[:] = fixes[tensor.name]
    for value in fixed.graph.input:  # IR 3 lists each initializer as an input too
        if value.name in fixes and value.type.tensor_type.HasField("shape"):
            del value.type.tensor_type.shape.dim[:]
            for size in fixes[value.name]:
                value.type.tensor_type.shape.dim.add().dim_value = size
    return fixed


def remove_initializer_inputs(graph: ir.Graph) -> list[str]:
    """Drop graph inputs that are initializers (IR<4 listed every weight so; later, an
    overridable default): weights are constants. The names dropped."""
    initializer_inputs = [v for v in graph.inputs if v.name in graph.initializers]
    for value in initializer_inputs:
        graph.inputs.remove(value)
    return [v.name for v in initializer_inputs]


def binary_sum_to_add(graph: ir.Graph) -> None:
    """Rewrite two-input Sum (old exporters' residual add) as Add, which has int8 kernels."""
    for node in list(graph):
        if node.op_type == "Sum" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            add = ir.node("Add", list(node.inputs), name=node.name)
            ir.convenience.replace_nodes_and_values(
                graph, node, [node], [add], list(node.outputs), list(add.outputs)
            )


@contextlib.contextmanager
def _large_weights_as_inputs(graph: ir.Graph) -> Iterator[None]:
    """Temporarily make initializers above INFERENCE_INLINE_BYTES typed inputs without data.

    Serializing the graph then copies no large weight, so models above 2 GB can be
    inferred; small initializers keep their data for Reshape targets and the like.
    """
    large = [v for v in graph.initializers.values()
             if v.const_value is None or v.const_value.nbytes > INFERENCE_INLINE_BYTES]
    inputs = list(graph.inputs)
    for value in large:
        graph.initializers.pop(value.name)
        graph.inputs.append(value)
    try:
        yield
    finally:
        graph.inputs.clear()
        graph.inputs.extend(inputs)
        for value in large:
            graph.initializers.add(value)


def _inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Type of every named value that onnx shape inference annotated, subgraphs included."""
    types: dict[str, onnx.TypeProto] = {}
    for graph in subgraphs(proto.graph):
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.name and value.type.WhichOneof("value") is not None:
                types.setdefault(value.name, value.type)
    return types


def _merge_type(value: ir.Value, type_proto: onnx.TypeProto) -> None:
    """Set an inferred type and shape on `value`, whole: a sequence stays a sequence.

    onnx-ir's ShapeInferencePass copies only dtype and shape, which turns an untyped
    sequence or optional value into a tensor. Map types are left out (onnx-ir has none).
    """
    if has_map(type_proto):
        return
    try:
        inferred = ir.serde.deserialize_type_proto_for_type(type_proto)
        shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
    except (ValueError, NotImplementedError):  # a sequence or optional of unknown element
        return
    if inferred is None:
        return
    if value.type != inferred:
        value.type = inferred
    if shape is not None and value.shape != shape:
        value.shape = shape


def infer_shapes(model: ir.Model) -> None:
    """Infer types and shapes with onnx (not strict, with data propagation), in place, then
    the element types it leaves unset past ops it does not know from their schemas
    (`schema_types.fill_dtypes`).

    Values the inference cannot type keep what they had; a model the inference rejects
    is left as it was by it, as with onnx-ir's ShapeInferencePass.
    """
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                value.shape = value.shape or value.const_value.shape
                value.dtype = value.dtype or value.const_value.dtype
    with _large_weights_as_inputs(model.graph):
        proto = ir.serde.serialize_model(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=False, data_prop=True)
    except Exception:  # inference is best effort: onnx raises many kinds of errors
        inferred = None
    if inferred is not None:
        types = _inferred_types(inferred)
        for graph in model.graphs():
            for value in [*graph.inputs, *(o for node in graph for o in node.outputs)]:
                if value.name in types:
                    _merge_type(value, types[value.name])
    fill_dtypes(model.graph, dict(model.opset_imports))  # past ops onnx does not know (contrib ops)


def _channel_slope_shape(node: ir.Node, original_opset: int) -> list[int] | None:
    """[C, 1, ...] for a 1-D PRelu slope meant per channel of X [N, C, ...], else None.

    A slope [C] is per channel below opset 7; from opset 7 it broadcasts against X's last
    axis, so it needs the trailing ones unless that axis happens to be C too.
    """
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    x, slope = node.inputs[0].shape, node.inputs[1].shape
    if x is None or slope is None or len(x) < 3 or len(slope) != 1:
        return None
    channels = x[1]
    if not isinstance(channels, int) or slope[0] != channels or channels == 1:
        return None
    if original_opset >= PRELU_BROADCAST_OPSET and x[-1] == channels:
        return None  # unidirectionally broadcastable, and right-aligned is the model's meaning
    return [channels] + [1] * (len(x) - 2)


def _reshape_slope(node: ir.Node, shape: list[int]) -> None:
    """Give `node`'s slope (input 1) `shape`: the constant rewritten, or a Reshape inserted."""
    slope = node.inputs[1]
    graph = node.graph
    if slope.const_value is not None and not slope.is_graph_input():
        set_constant(graph, node, 1, slope.const_value.numpy().reshape(shape), f"{slope.name}_per_channel")
        return
    editor = GraphEditor(graph)
    target = editor.initializer(f"{slope.name}_channel_shape", np.array(shape, dtype=np.int64))
    out = ir.Value(name=editor.unique(f"{slope.name}_per_channel"), type=slope.type, shape=ir.Shape(shape))
    reshape = ir.node("Reshape", [slope, target], outputs=[out], name=editor.unique(f"{out.name}_Reshape"))
    graph.insert_before(node, reshape)
    node.replace_input_with(1, out)


def fix_prelu_slopes(model: ir.Model, original_opset: int) -> int:
    """Make per-channel PRelu slopes of old models broadcast as opset 7+ requires; count them."""
    fixed = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "PRelu" or node.domain not in ("", "ai.onnx"):
            continue
        shape = _channel_slope_shape(node, original_opset)
        if shape is not None:
            _reshape_slope(node, shape)
            fixed += 1
    return fixed
