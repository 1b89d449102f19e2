"""Float8 Q/DQ graphs that onnxruntime's CPU graph optimiser keeps exact.

Three of onnxruntime's CPU graph transformers assume integer Q/DQ and break float8 ones
(onnxruntime/core/optimizer/qdq_transformer/):

- `WeightBiasQuantization` (weight_bias_quantization.cc, level 1: ORT_ENABLE_BASIC and
  up) rewrites a Conv/ConvTranspose/Gemm that reads a DequantizeLinear and leads to a
  QuantizeLinear (through Relu/Clip at most) so that its float bias becomes
  Cast<int32>(Round(b / (x_scale * w_scale))) -> DequantizeLinear. It never looks at the
  Q/DQ element type: float8 scales are small (amax / 448, amax / 57344), the int32
  overflows and the bias is garbage (float8_e5m2 first), silently.
- `ReluQuantFusion` (relu_quantizelinear.cc, level 2) deletes a Relu whose only consumer
  is a QuantizeLinear unless its zero point is an int8/uint8 that does not clamp at 0: a
  float8 zero point passes both tests, the Relu is dropped and negative values flow on.
- `ClipQuantFusion` (clip_quantizelinear.cc, level 2) calls `GetQConstantLowerUpper`,
  which throws for a zero point that is not int8/uint8: the session fails to load.

`QDQPropagationTransformer` (qdq_propagation.cc, level 1) copies a QuantizeLinear
backwards over MaxPool/Reshape/Transpose/Squeeze/Unsqueeze/Slice, so a Relu/Clip in front
of such an op ends up in front of a QuantizeLinear too.

`make_float8_deployable` rewrites the emitted graph so that none of them applies, without
changing what the model computes:

- a Conv/ConvTranspose/Gemm that reads a DequantizeLinear and has a float8 input carries
  its float bias in an Add after it (Gemm's `beta` folded in): no bias initializer is left
  for WeightBiasQuantization, and its path to the QuantizeLinear is no longer Relu/Clip;
- a Relu/Clip that reaches a float8 QuantizeLinear only (directly or through the ops in
  DATA_MOVEMENT) moves after that Q's DequantizeLinear. Q and DQ are monotone
  non-decreasing and commute with data movement and max, so
  DQ(Q(Clip(x, lo, hi))) == Clip(DQ(Q(x)), DQ(Q(lo)), DQ(Q(hi))) bit for bit: the moved
  Clip gets the quantized bounds, a Relu keeps 0 (DQ(Q(0)) = 0 with a 0 zero point).
"""


from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import FLOAT8_TYPES, dequantize, quantize

FLOAT8_DTYPES = {
    ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ, ir.DataType.FLOAT8E5M2, ir.DataType.FLOAT8E5M2FNUZ,
}
# float8 types whose Q/DQ arithmetic qmath implements (the ones onnxq emits).
_QMATH_FLOAT8 = {int(f8.onnx_type): dtype.value for dtype, f8 in FLOAT8_TYPES.items()}
_ONNX_DOMAINS = ("", "ai.onnx")
BIASED_OPS = ("Conv", "ConvTranspose", "Gemm")
# Ops that only move or select values of their input 0, so an elementwise monotone
# activation commutes with them exactly. onnxruntime's QDQPropagationTransformer copies a
# QuantizeLinear backwards over several of them (MaxPool, Reshape, Transpose, Squeeze,
# Unsqueeze, Slice in qdq_propagation.cc, CanNodePropagate).
DATA_MOVEMENT = {
    "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice",
    "Identity", "Expand", "Tile", "DepthToSpace", "SpaceToDepth",
}


@dataclass
class Float8Report:
    """What `make_float8_deployable` changed."""

    biases_moved: list[str]
    activations_moved: list[str]

    def note(self) -> str | None:
        if not self.biases_moved and not self.activations_moved:
            return None
        return (
            f"float8 Q/DQ laid out for onnxruntime's CPU optimiser: {len(self.biases_moved)} "
            f"bias(es) of Conv/Gemm moved into an Add, {len(self.activations_moved)} Relu/Clip "
            "moved after their DequantizeLinear (bit-exact); the model loads at the default "
            "optimisation level"
        )


def _is_onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in _ONNX_DOMAINS


def quantized_dtype(q: ir.Node) -> ir.DataType | None:
    """The element type a QuantizeLinear produces: its zero point's, else `output_dtype`."""
    zp = q.inputs[2] if len(q.inputs) > 2 else None
    if zp is not None:
        return zp.dtype
    attr = q.attributes.get("output_dtype")
    return ir.DataType(attr.as_int()) if attr is not None and attr.as_int() else ir.DataType.UINT8


def is_float8_dq(node: ir.Node | None) -> bool:
    return _is_onnx(node, "DequantizeLinear") and node.inputs[0] is not None \
        and node.inputs[0].dtype in FLOAT8_DTYPES


def is_float8_q(node: ir.Node | None) -> bool:
    return _is_onnx(node, "QuantizeLinear") and quantized_dtype(node) in FLOAT8_DTYPES


class _Rewriter:
    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.edit = GraphEditor(graph)
        self.report = Float8Report([], [])

    # -- biases ------------------------------------------------------------------------
    def bias_to_add(self, node: ir.Node) -> None:
        """Move the float bias of a float8 Conv/ConvTranspose/Gemm into an Add after it."""
        if len(node.inputs) < 3 or node.inputs[2] is None or len(node.outputs) != 1:
            return
        data = node.inputs[0].producer() if node.inputs[0] is not None else None
        if data is None or data.op_type != "DequantizeLinear":
            return  # WeightBiasQuantization only rewrites ops that read a DequantizeLinear
        if not any(is_float8_dq(v.producer()) for v in node.inputs[:2] if v is not None):
            return
        bias = node.inputs[2]
        array = constant_array(bias)
        if array is None or array.dtype != np.float32:
            return  # a computed or already quantized bias: nothing for onnxruntime to rewrite
        if node.op_type == "Gemm":
            beta = node.attributes.get("beta")
            if beta is not None:
                array = (np.float32(beta.as_float()) * array).astype(np.float32)
                del node.attributes["beta"]
        else:
            rank = self._weight_rank(node)
            if rank is None or array.ndim != 1:
                return
            array = array.reshape(array.shape + (1,) * (rank - 2))
        out = node.outputs[0]
        uses = list(out.uses())
        name = out.name
        out.name = self.edit.unique(f"{name}_without_bias")
        add_bias = self.edit.initializer(f"{bias.name}_add", array)
        biased = ir.Value(name=name, type=out.type, shape=out.shape)
        add = ir.node("Add", [out, add_bias], outputs=[biased], name=self.edit.unique(f"{node.name}_bias_add"))
        self.graph.insert_after(node, add)
        for use in uses:
            use.node.replace_input_with(use.idx, biased)
        if out.is_graph_output():
            outputs = self.graph.outputs
            outputs[outputs.index(out)] = biased
        node.resize_inputs(2)
        if not bias.uses() and not bias.is_graph_output():
            self.graph.initializers.pop(bias.name, None)
        self.report.biases_moved.append(node.name)

    @staticmethod
    def _weight_rank(node: ir.Node) -> int | None:
        weight = node.inputs[1]
        if weight.shape is not None:
            return len(weight.shape)
        producer = weight.producer()
        if producer is not None and producer.inputs[0] is not None and producer.inputs[0].shape is not None:
            return len(producer.inputs[0].shape)
        return None

    # -- activations ---------------------------------------------------------------------
    def move_activation(self, q: ir.Node) -> bool:
        """Move a Relu/Clip that reaches float8 QuantizeLinear `q` only (directly or through
        data-movement ops, where onnxruntime's QDQPropagationTransformer would copy `q`
        to) after q's DequantizeLinear."""
        act, first = self._activation_before(q)
        if act is None:
            return False
        q_out = q.outputs[0]
        dq = q_out.uses()[0].node if len(q_out.uses()) == 1 else None
        if dq is None or q_out.is_graph_output() or not _is_onnx(dq, "DequantizeLinear") \
                or not self._same_params(q, dq):
            return False
        bounds = self._moved_bounds(act, q)
        if bounds is None:
            return False
        dq_out, act_out = dq.outputs[0], act.outputs[0]
        first.replace_input_with(0, act.inputs[0])
        for use in list(dq_out.uses()):
            use.node.replace_input_with(use.idx, act_out)
        if dq_out.is_graph_output():  # the graph output keeps its name
            outputs = self.graph.outputs
            outputs[outputs.index(dq_out)] = act_out
            act_name, out_name = act_out.name, dq_out.name
            dq_out.name = self.edit.unique(f"{out_name}_moving")
            act_out.name = out_name
            dq_out.name = act_name
        act.replace_input_with(0, dq_out)
        act_out.shape, act_out.type = dq_out.shape, dq_out.type  # it may have moved past a MaxPool
        for index, value in bounds.items():
            old = act.inputs[index]
            act.replace_input_with(index, value)
            if not old.uses() and not old.is_graph_output():
                self.graph.initializers.pop(old.name, None)
        self.graph.remove(act)
        self.graph.insert_after(dq, act)
        self.report.activations_moved.append(act.name)
        return True

    @staticmethod
    def _activation_before(q: ir.Node) -> tuple[ir.Node | None, ir.Node]:
        """The Relu/Clip whose output reaches `q` through single-consumer data-movement
        ops only, and the node that reads that output; (None, q) when there is none."""
        reader = q
        while True:
            value = reader.inputs[0]
            if value is None or len(value.uses()) != 1 or value.is_graph_output():
                return None, q
            producer = value.producer()
            if _is_onnx(producer, "Relu") or _is_onnx(producer, "Clip"):
                return producer, reader
            if producer is None or producer.domain not in _ONNX_DOMAINS or producer.op_type not in DATA_MOVEMENT \
                    or any(o.uses() or o.is_graph_output() for o in producer.outputs[1:]):
                return None, q
            reader = producer

    @staticmethod
    def _same_params(q: ir.Node, dq: ir.Node) -> bool:
        """Whether `dq` undoes `q` (same scale, zero point and axis)."""
        if q.attributes.get_int("axis", 1) != dq.attributes.get_int("axis", 1):
            return False
        for i in (1, 2):
            a = q.inputs[i] if len(q.inputs) > i else None
            b = dq.inputs[i] if len(dq.inputs) > i else None
            if a is b:
                continue
            x, y = constant_array(a), constant_array(b)
            if x is None or y is None or x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        return True

    def _moved_bounds(self, act: ir.Node, q: ir.Node) -> dict[int, ir.Value] | None:
        """New constant bounds (by input index) for `act` once it runs after q's DQ, or
        None when the move would not be exact."""
        zp = constant_array(q.inputs[2])
        if zp is None or zp.size != 1 or float(zp.astype(np.float32).reshape(())) != 0.0:
            return None
        if act.op_type == "Relu":
            return {}
        scale = constant_array(q.inputs[1])
        dtype = _QMATH_FLOAT8.get(int(quantized_dtype(q)))
        if scale is None or scale.size != 1 or float(scale) <= 0.0 or dtype is None:
            return None
        new: dict[int, ir.Value] = {}
        for index, label in ((1, "min"), (2, "max")):
            value = act.inputs[index] if len(act.inputs) > index else None
            if value is None:
                continue
            bound = constant_array(value)
            if bound is None or bound.size != 1:
                return None  # onnxruntime's ClipQuantFusion leaves non-constant bounds alone
            moved = dequantize(quantize(bound, scale, zp, dtype), scale, zp).astype(bound.dtype)
            if not np.array_equal(moved, bound):
                new[index] = self.edit.initializer(f"{act.name}_{label}_quantized", moved.reshape(bound.shape))
        return new

    def run(self) -> Float8Report:
        for node in list(self.graph):
            if _is_onnx(node, node.op_type) and node.op_type in BIASED_OPS:
                self.bias_to_add(node)
        changed = True
        while changed:  # a moved activation may now feed another float8 Q (requantization)
            changed = False
            for node in list(self.graph):
                if is_float8_q(node) and self.move_activation(node):
                    changed = True
        self.graph.sort()
        return self.report


def make_float8_deployable(model: ir.Model) -> Float8Report:
    """Rewrite the float8 Q/DQ parts of `model` in place (see the module docstring)."""
    return _Rewriter(model.graph).run()
