"""Stage 4, emit: rewrite the graph into QDQ format.

Activations get one QuantizeLinear -> DequantizeLinear pair per tensor, shared by all its
quantized consumers; a consumer that wants another type (mixed precision) gets a second
pair fed from the first. Weights, constants and biases are stored as integer (or float8)
initializers followed by DequantizeLinear. Absorbed Relu/Clip nodes are removed where the
output quantization already clamps exactly like them. The placement follows the patterns
onnxruntime fuses into QLinearConv / QLinearMatMul / QGemm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import int_type, is_float8, is_integer, qdq_opset, quantize
from onnxq.numerics.weights import QuantizedTensor, quantize_bias
from onnxq.plan import Kind, QuantPlan, TensorPlan, qparams_key
from onnxq.plan.params import (
    WeightCache,
    activation_qparams,
    bias_input_spec,
    biases_by_weight,
    emitted_weight,
)
from onnxq.runtime import DOMAIN, NO_AXIS, QDQ_OP

CONTRIB = "com.microsoft"


@dataclass
class EmitReport:
    """What the emitter did, for the summary."""

    activations: int = 0
    requantized: int = 0
    weights: int = 0
    constants: int = 0
    biases: int = 0
    float_biases: list[str] = field(default_factory=list)
    removed_activations: list[str] = field(default_factory=list)
    kept_activations: list[str] = field(default_factory=list)
    contrib_qdq: int = 0
    extended: int = 0  # activations quantized by onnxq's extended op (qdq-ext format)


@dataclass
class _Params:
    scale: ir.Value
    zero_point: ir.Value
    scale_array: np.ndarray
    zp_array: np.ndarray


class _Emitter:
    def __init__(self, model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]],
                 qdq_domain: str, weights: WeightCache | None, extended: bool = False) -> None:
        self.model = model
        self.extended = extended
        self.weights = weights or WeightCache()
        self.graph = model.graph
        self.plan = plan
        self.ranges = ranges
        self.qdq_domain = qdq_domain
        self.edit = GraphEditor(self.graph)
        self.report = EmitReport()
        self.values: dict[str, ir.Value] = {v.name: v for v in self.graph.inputs}
        self.values.update(self.graph.initializers)
        self.nodes: dict[str, ir.Node] = {}
        for node in self.graph:
            self.nodes[node.name] = node
            self.values.update({o.name: o for o in node.outputs if o.name})
        self.params: dict[tuple, _Params] = {}
        self.bias_of = biases_by_weight(plan)
        self.weight_scales: dict[str, np.ndarray] = {}

    # -- nodes -----------------------------------------------------------------------
    def domain(self, dtype: str) -> str:
        """Q/DQ domain for a dtype: contrib ops when asked and the model opset is too old."""
        if self.qdq_domain == CONTRIB and qdq_opset(dtype) > self.model.opset_imports.get("", 13):
            self.model.opset_imports.setdefault(CONTRIB, 1)
            self.report.contrib_qdq += 1
            return CONTRIB
        return ""

    def qdq_node(self, op: str, inputs: list[ir.Value], name: str, spec: ResolvedSpec,
                 like: ir.Value, attrs: dict | None = None) -> ir.Value:
        attrs = dict(attrs or {})
        if op == "QuantizeLinear" and is_float8(spec.dtype):
            attrs["saturate"] = 1
        dtype = inputs[2].dtype if op == "QuantizeLinear" else like.dtype
        return self.edit.add_node(op, inputs, name, attrs, dtype=dtype, shape=like.shape,
                                  domain=self.domain(spec.dtype))

    # -- activations -----------------------------------------------------------------
    def constant_of(self, name: str) -> np.ndarray | None:
        return constant_array(self.values.get(name))

    def activation_params(self, name: str, spec: ResolvedSpec | None = None) -> _Params:
        """Scale and zero-point initializers of activation `name` quantized with `spec`."""
        root = self.plan.root_of(name)
        spec = spec or self.plan.tensors[root].spec
        key = (root, qparams_key(spec))
        if key not in self.params:
            scale, zp = activation_qparams(self.plan, self.ranges, self.constant_of, name, spec)
            suffix = "" if spec is self.plan.tensors[root].spec else f"_{spec.dtype}"
            self.params[key] = _Params(
                self.edit.initializer(f"{root}_scale{suffix}", np.asarray(scale, np.float32).reshape(())),
                self.edit.initializer(f"{root}_zero_point{suffix}", np.asarray(zp).reshape(())),
                np.asarray(scale), np.asarray(zp),
            )
        return self.params[key]

    def absorb_activation(self, act_name: str) -> None:
        """Remove a fused Relu/Clip when the output quantization clamps exactly like it."""
        act = self.nodes[act_name]
        out = act.outputs[0]
        if out.name not in self.plan.tensors:  # its range was unquantizable: stays float
            return
        spec = self.plan.tensors[out.name].spec
        p = self.activation_params(out.name)
        bounds = layout.clip_bounds(act) if act.op_type == "Clip" else None
        lower_is_zero = act.op_type == "Relu" or (bounds is not None and bounds[0] == 0.0)
        clamps_at_zero = is_integer(spec.dtype) and int(p.zp_array) == int_type(spec.dtype, spec.bits).qmin
        if not (lower_is_zero and clamps_at_zero):
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

    def qdq_pair(self, value: ir.Value, name: str, spec: ResolvedSpec, p: _Params) -> ir.Value:
        if self.extended and needs_extended(spec):
            return self.extended_pair(value, name, spec, p)
        q = self.qdq_node("QuantizeLinear", [value, p.scale, p.zero_point], f"{name}_q", spec, value)
        return self.qdq_node("DequantizeLinear", [q, p.scale, p.zero_point], f"{name}_dq", spec, value)

    def extended_pair(self, value: ir.Value, name: str, spec: ResolvedSpec, p: _Params) -> ir.Value:
        """One `OnnxqQuantizeDequantize` (onnxq.runtime) where stock Q/DQ cannot express the
        grid: its bit width, 32-bit type or rounding mode."""
        info = int_type(spec.dtype, spec.bits)
        zero = self.edit.initializer(f"{name}_zero_point_float", np.asarray(p.zp_array, np.float32).reshape(()))
        attrs = {"qmin": int(info.qmin), "qmax": int(info.qmax), "round_mode": str(spec.round_method),
                 "axis": NO_AXIS}
        self.model.opset_imports.setdefault(DOMAIN, 1)
        self.report.extended += 1
        return self.edit.add_node(QDQ_OP, [value, p.scale, zero], f"{name}_qdq", attrs, dtype=value.dtype,
                                  shape=value.shape, domain=DOMAIN)

    def quantize_activation(self, tensor: TensorPlan) -> None:
        value = self.values[tensor.name]
        dq = self.qdq_pair(value, tensor.name, tensor.spec, self.activation_params(tensor.name))
        q_node = dq.producer() if dq.producer().inputs[0] is value else dq.producer().inputs[0].producer()
        if tensor.all_consumers:
            for use in list(value.uses()):
                if use.node is not q_node:
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
        self.requantize(tensor, dq)
        self.report.activations += 1

    def requantize(self, tensor: TensorPlan, dq: ir.Value) -> None:
        """Give consumers that want another type their own Q/DQ pair, fed from `dq`."""
        by_key: dict[tuple, list[tuple[str, int]]] = {}
        specs: dict[tuple, ResolvedSpec] = {}
        for use, spec in tensor.requant.items():
            by_key.setdefault(qparams_key(spec), []).append(use)
            specs[qparams_key(spec)] = spec
        for key, uses in by_key.items():
            spec = specs[key]
            p = self.activation_params(tensor.name, spec)
            dq2 = self.qdq_pair(dq, f"{tensor.name}_{spec.dtype}", spec, p)
            for node_name, index in uses:
                self.nodes[node_name].replace_input_with(index, dq2)
            self.report.requantized += 1

    # -- offline-quantized tensors ---------------------------------------------------
    def dequantized(self, tensor: TensorPlan, qt: QuantizedTensor, params: _Params | None = None) -> None:
        """Store `qt` as an integer initializer + DequantizeLinear feeding the consumers.

        `params` reuses existing scale/zero-point initializers (constants that share them
        with the activations computed from them).
        """
        value = self.values[tensor.source or tensor.name]
        data = self.edit.initializer(f"{tensor.name}_quantized", qt.data)
        if params is not None:
            scale, zp = params.scale, params.zero_point
        else:
            scale = self.edit.initializer(f"{tensor.name}_scale", qt.scale.astype(np.float32))
            zp = self.edit.initializer(f"{tensor.name}_zero_point", qt.zero_point)
        attrs = {"axis": qt.axis} if qt.axis is not None else {}
        if qt.block_size:
            attrs["block_size"] = qt.block_size
        dq = self.qdq_node("DequantizeLinear", [data, scale, zp], f"{tensor.name}_dq", tensor.spec, value, attrs)
        for node_name, index in tensor.consumers:
            self.nodes[node_name].replace_input_with(index, dq)
        if not value.uses() and not value.is_graph_output():
            self.graph.initializers.pop(value.name, None)

    def bias_input_params(self, bias: TensorPlan) -> _Params:
        """Parameters of the activation the biased node actually reads (after requantization)."""
        return self.activation_params(bias.bias_inputs[0], bias_input_spec(self.plan, bias))

    def quantize_offline(self, tensor: TensorPlan) -> None:
        if tensor.kind is Kind.WEIGHT:
            plain = self.weights.unfloored(tensor, self.values[tensor.name])
            qt = emitted_weight(self.plan, self.ranges, self.constant_of, tensor, self.bias_of.get(tensor.name),
                                unfloored=plain)
            if not qt.block_size and is_integer(tensor.spec.dtype):
                self.weight_scales[tensor.name] = qt.scale
            self.report.weights += 1
            self.dequantized(tensor, qt)
            return
        p = self.activation_params(tensor.name)
        q = quantize(self.constant_of(tensor.name), p.scale_array, p.zp_array, tensor.spec.dtype)
        self.report.constants += 1
        self.dequantized(tensor, QuantizedTensor(q, p.scale_array, p.zp_array, None), p)

    def quantize_bias(self, tensor: TensorPlan) -> None:
        weight_name = tensor.bias_inputs[1]
        act_params = self.bias_input_params(tensor)
        if weight_name not in self.weight_scales or not is_integer(self.plan.tensors[tensor.bias_inputs[0]].spec.dtype):
            self.report.float_biases.append(f"{tensor.name} (weight or input not integer per-tensor/channel)")
            return
        qt = quantize_bias(
            constant_array(self.values[tensor.source or tensor.name]),
            act_params.scale_array,
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


def needs_extended(spec: ResolvedSpec) -> bool:
    """Whether stock QuantizeLinear/DequantizeLinear cannot quantize an activation of `spec`."""
    return spec.bits is not None or str(spec.dtype) in ("int32", "uint32") or str(spec.round_method) != "half_even"


def emit_qdq(
    model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]], qdq_domain: str = "ai.onnx",
    weights: WeightCache | None = None, extended: bool = False,
) -> EmitReport:
    """Rewrite `model` in place into QDQ format following `plan` and calibrated `ranges`
    (`weights`: weights an algorithm already quantized; `extended`: the qdq-ext format,
    `OnnxqQuantizeDequantize` where stock Q/DQ cannot express an activation's grid)."""
    return _Emitter(model, plan, ranges, qdq_domain, weights, extended).run()
