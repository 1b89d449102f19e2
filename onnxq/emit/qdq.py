"""Stage 4, emit: rewrite the graph into QDQ format.

Activations get one QuantizeLinear -> DequantizeLinear pair per tensor, shared by all its
quantized consumers. Weights, constants and biases are stored as integer initializers
followed by DequantizeLinear. Absorbed Relu/Clip nodes are removed where the output
quantization already clamps exactly like them. The placement follows the patterns
onnxruntime fuses into QLinearConv / QLinearMatMul / QGemm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.emit.plan import Kind, QuantPlan, TensorPlan
from onnxq.emit.weights import (
    QuantizedTensor,
    bias_safe_weight_scale,
    quantize_bias,
    quantize_weight,
)
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.qmath import compute_qparams, int_type


@dataclass
class EmitReport:
    """What the emitter did, for the summary."""

    activations: int = 0
    weights: int = 0
    constants: int = 0
    biases: int = 0
    float_biases: list[str] = field(default_factory=list)
    removed_activations: list[str] = field(default_factory=list)
    kept_activations: list[str] = field(default_factory=list)
    qparams: dict[str, tuple[float, int]] = field(default_factory=dict)


@dataclass
class _Params:
    scale: ir.Value
    zero_point: ir.Value
    scale_array: np.ndarray
    zp_array: np.ndarray


class _Emitter:
    def __init__(self, model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]]) -> None:
        self.graph = model.graph
        self.plan = plan
        self.ranges = ranges
        self.edit = GraphEditor(self.graph)
        self.report = EmitReport()
        self.values: dict[str, ir.Value] = {v.name: v for v in self.graph.inputs}
        self.values.update(self.graph.initializers)
        self.nodes: dict[str, ir.Node] = {}
        for node in self.graph:
            self.nodes[node.name] = node
            self.values.update({o.name: o for o in node.outputs if o.name})
        self.params: dict[str, _Params] = {}
        self.bias_of: dict[str, TensorPlan] = {
            t.bias_inputs[1]: t for t in plan.tensors.values() if t.bias_inputs is not None
        }
        self.weight_scales: dict[str, np.ndarray] = {}

    # -- activations -----------------------------------------------------------------
    def activation_params(self, name: str) -> _Params:
        root = self.plan.root_of(name)
        if root not in self.params:
            spec = self.plan.tensors[root].spec
            rmin, rmax = self.ranges[root]
            scale, zp = compute_qparams(rmin, rmax, spec.dtype, spec.symmetric, spec.scale_type)
            self.params[root] = _Params(
                self.edit.initializer(f"{root}_scale", np.asarray(scale, np.float32).reshape(())),
                self.edit.initializer(f"{root}_zero_point", np.asarray(zp).reshape(())),
                np.asarray(scale), np.asarray(zp),
            )
            self.report.qparams[root] = (float(scale), int(zp))
        return self.params[root]

    def absorb_activation(self, act_name: str) -> None:
        """Remove a fused Relu/Clip when the output quantization clamps exactly like it."""
        act = self.nodes[act_name]
        out = act.outputs[0]
        tensor = self.plan.tensors[out.name]
        info = int_type(tensor.spec.dtype)
        p = self.activation_params(out.name)
        lower_is_zero = act.op_type == "Relu" or (
            act.inputs[1] is not None and float(constant_array(act.inputs[1])) == 0.0
        )
        if not (lower_is_zero and int(p.zp_array) == info.qmin):
            self.report.kept_activations.append(act_name)
            return
        source = act.inputs[0]
        name = out.name
        out.replace_all_uses_with(source, replace_graph_outputs=True)
        self.graph.remove(act, safe=True)
        out.name = None
        source.name = name  # the quantized tensor keeps the name the plan (and users) know
        self.values[name] = source
        self.report.removed_activations.append(act_name)

    def quantize_activation(self, tensor: TensorPlan) -> None:
        value = self.values[tensor.name]
        p = self.activation_params(tensor.name)
        q = self.edit.add_node("QuantizeLinear", [value, p.scale, p.zero_point], f"{tensor.name}_q",
                               dtype=p.zero_point.dtype, shape=value.shape)
        dq = self.edit.add_node("DequantizeLinear", [q, p.scale, p.zero_point], f"{tensor.name}_dq",
                                dtype=value.dtype, shape=value.shape)
        if tensor.all_consumers:
            for use in list(value.uses()):
                if use.node is not q.producer():
                    use.node.replace_input_with(use.idx, dq)
            if value.is_graph_output():
                outputs = self.graph.outputs
                outputs[outputs.index(value)] = dq
                original = value.name
                value.name = self.edit.unique(f"{original}_float")
                dq.name = original
        else:
            for node_name, index in tensor.consumers:
                self.nodes[node_name].replace_input_with(index, dq)
        self.report.activations += 1

    # -- offline-quantized tensors ---------------------------------------------------
    def dequantized(self, tensor: TensorPlan, qt: QuantizedTensor) -> None:
        """Store `qt` as an integer initializer + DequantizeLinear feeding the consumers."""
        value = self.values[tensor.name]
        data = self.edit.initializer(f"{tensor.name}_quantized", qt.data)
        scale = self.edit.initializer(f"{tensor.name}_scale", qt.scale.astype(np.float32))
        zp = self.edit.initializer(f"{tensor.name}_zero_point", qt.zero_point)
        attrs = {"axis": qt.axis} if qt.axis is not None else {}
        dq = self.edit.add_node("DequantizeLinear", [data, scale, zp], f"{tensor.name}_dq", attrs,
                                dtype=value.dtype, shape=value.shape)
        for node_name, index in tensor.consumers:
            self.nodes[node_name].replace_input_with(index, dq)
        if not value.uses() and not value.is_graph_output():
            self.graph.initializers.pop(value.name, None)

    def weight_scale_floor(self, tensor: TensorPlan, array: np.ndarray) -> np.ndarray | float:
        """Per-channel lower bound on a weight's scale so that its bias fits int32."""
        bias = self.bias_of.get(tensor.name)
        if bias is None:
            return 0.0
        channels = array.shape[tensor.axis] if tensor.axis is not None else 1
        s_in = float(self.activation_params(bias.bias_inputs[0]).scale_array)
        b = constant_array(self.values[bias.name])
        return bias_safe_weight_scale(b, s_in, channels, bias.spec)

    def quantize_offline(self, tensor: TensorPlan) -> None:
        array = constant_array(self.values[tensor.name])
        if tensor.kind is Kind.WEIGHT:
            floor = self.weight_scale_floor(tensor, array)
            qt = quantize_weight(array, tensor.spec, tensor.axis, floor)
        else:
            qt = quantize_weight(array, tensor.spec, None)
        if tensor.kind is Kind.WEIGHT:
            self.weight_scales[tensor.name] = qt.scale
            self.report.weights += 1
        else:
            self.report.constants += 1
        self.dequantized(tensor, qt)

    def quantize_bias(self, tensor: TensorPlan) -> None:
        act_name, weight_name = tensor.bias_inputs
        if weight_name not in self.weight_scales:
            self.report.float_biases.append(f"{tensor.name} (weight not quantized)")
            return
        qt = quantize_bias(
            constant_array(self.values[tensor.name]),
            self.activation_params(act_name).scale_array,
            self.weight_scales[weight_name],
            tensor.spec,
        )
        if qt is None:
            self.report.float_biases.append(f"{tensor.name} (would overflow {tensor.spec.dtype})")
            return
        self.report.biases += 1
        self.dequantized(tensor, qt)

    def run(self) -> EmitReport:
        for act_name in self.plan.fused_activations:
            self.absorb_activation(act_name)
        ordered = sorted(self.plan.tensors.values(), key=lambda t: t.kind is Kind.BIAS)
        for tensor in ordered:
            if tensor.kind is Kind.ACTIVATION:
                self.quantize_activation(tensor)
            elif tensor.kind is Kind.BIAS:
                self.quantize_bias(tensor)
            else:
                self.quantize_offline(tensor)
        self.graph.sort()
        return self.report


def emit_qdq(model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]]) -> EmitReport:
    """Rewrite `model` in place into QDQ format following `plan` and calibrated `ranges`."""
    return _Emitter(model, plan, ranges).run()
