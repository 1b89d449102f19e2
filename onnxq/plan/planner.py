"""Decide, before calibration, how every tensor of the model will be quantized.

The plan names the activation tensors to calibrate (and the spec each is calibrated
for), the weights, biases and constants to quantize offline, the activations absorbed
into the op before them, and the nodes left in float with the reason why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, ResolvedSpec, resolve_node_config
from onnxq.config.spec import Config, DType, QScheme
from onnxq.emit.gather_block_quantized import can_use_gather_block_quantized
from onnxq.emit.matmul_nbits import can_use_matmul_nbits
from onnxq.graph import layout
from onnxq.graph.fold import constant_array
from onnxq.numerics.qmath import FLOAT_TARGETS, qdq_opset
from onnxq.plan.rules import DYNAMIC_OPS, FUSABLE_ACTIVATIONS, OP_RULES, OpRule, OutputMode
from onnxq.target import TargetProfile

FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


class Kind(Enum):
    ACTIVATION = "activation"  # calibrated, Q/DQ inserted at run time
    WEIGHT = "weight"  # quantized offline, stored as integers + DequantizeLinear
    BIAS = "bias"  # int32, scale = input scale x weight scale
    CONSTANT = "constant"  # constant input of an activation op: offline, per-tensor


@dataclass
class TensorPlan:
    """How one tensor is quantized."""

    name: str
    kind: Kind
    spec: ResolvedSpec
    axis: int | None = None  # per-channel axis (weights), or the block axis when per-group
    block_size: int | None = None  # per-group weights: entries of `axis` sharing a scale
    alias_of: str | None = None  # shares the parameters of this activation
    bias_inputs: tuple[str, str] | None = None  # (activation, weight) whose scales make the bias scale
    consumers: list[tuple[str, int]] = field(default_factory=list)  # (node name, input index) fed DQ
    all_consumers: bool = False  # producer is quantized: every consumer and graph output gets DQ
    source: str | None = None  # the graph value, when `name` is a per-node key (shared biases)
    # Consumers that want this activation in another type (mixed precision): requantized.
    requant: dict[tuple[str, int], ResolvedSpec] = field(default_factory=dict)


def qparams_key(spec: ResolvedSpec) -> tuple:
    """The spec fields that change scale and zero point (two specs with the same key share them)."""
    return (spec.dtype, spec.symmetric, spec.scale_type)


@dataclass
class QuantPlan:
    tensors: dict[str, TensorPlan] = field(default_factory=dict)
    quantized_nodes: dict[str, str] = field(default_factory=dict)  # name -> op type
    float_nodes: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (op, reason)
    fused_activations: dict[str, str] = field(default_factory=dict)  # activation node -> producer
    # Nodes handled by other emitters than QDQ, with the spec that sends them there.
    dynamic_nodes: dict[str, ResolvedSpec] = field(default_factory=dict)  # weight spec
    nbits_nodes: dict[str, ResolvedSpec] = field(default_factory=dict)  # weight spec
    gather_nodes: dict[str, ResolvedSpec] = field(default_factory=dict)  # int4 table lookups
    float_target_nodes: dict[str, DType] = field(default_factory=dict)  # float16 / bfloat16
    float_tensors: dict[str, str] = field(default_factory=dict)  # dropped after calibration

    def required_opset(self) -> int:
        """The lowest ai.onnx opset whose Q/DQ accept every planned type and granularity."""
        opsets = [qdq_opset(t.spec.dtype) for t in self.tensors.values()]
        opsets += [qdq_opset(spec.dtype) for t in self.tensors.values() for spec in t.requant.values()]
        opsets += [21 for t in self.tensors.values() if t.block_size]
        return max(opsets, default=13)

    def narrows_weights(self) -> bool:
        """Whether some weight has fewer bits than its type (`bits`) or pair-safe scales."""
        return any(t.spec.bits is not None or t.spec.pairs is not None
                   for t in self.tensors.values() if t.kind is Kind.WEIGHT)

    def calibrated_tensors(self) -> dict[str, ResolvedSpec]:
        """Activation tensors that need an observer, in a stable order."""
        return {
            t.name: t.spec
            for t in self.tensors.values()
            if t.kind is Kind.ACTIVATION and t.alias_of is None
        }

    def keep_float(self, names: set[str], reason: str) -> list[str]:
        """Drop `names`, their aliases and the biases scaled by them from quantization."""
        doomed = sorted(n for n in self.tensors if self.root_of(n) in names)
        doomed_set = set(doomed)
        for tensor in list(self.tensors.values()):
            if tensor.bias_inputs is not None and tensor.bias_inputs[0] in doomed_set:
                doomed.append(tensor.name)
        for name in doomed:
            self.tensors.pop(name, None)
            self.float_tensors[name] = reason
        return doomed

    def root_of(self, name: str) -> str:
        """The calibrated tensor whose parameters `name` uses."""
        while self.tensors[name].alias_of is not None:
            name = self.tensors[name].alias_of
        return name


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in FLOAT_TYPES


def _fusable_activation(value: ir.Value, config: Config) -> ir.Node | None:
    """The Relu/Clip that alone consumes `value` and can be absorbed into its producer."""
    if not config.fuse_activations or value.is_graph_output():
        return None
    consumers = value.consumers()
    if len(consumers) != 1:
        return None
    act = consumers[0]
    if act.op_type not in FUSABLE_ACTIVATIONS or act.domain not in ("", "ai.onnx"):
        return None
    if act.op_type == "Clip" and any(
        v is not None and constant_array(v) is None for v in act.inputs[1:]
    ):
        return None
    if resolve_node_config(config, act.name or "", act.op_type) is None:
        return None
    return act


def _kernel_class(node: ir.Node, weight: np.ndarray) -> str:
    """The int8 kernel family onnxruntime runs for a weighted op: `depthwise` for a Conv
    with one input and one output channel per group, `gemm` for everything else."""
    return "depthwise" if layout.is_depthwise(node, weight.shape) else "gemm"


def _target_weight_spec(
    target: TargetProfile | None, spec: ResolvedSpec, kernel: str, activation: ResolvedSpec | None,
    k_axes: tuple[int, ...] | None = None,
) -> ResolvedSpec:
    """`spec` as the target can run it: int8 weights that the kernel cannot saturate
    (pair-safe scales where the K order is known and weights are symmetric, else 7 bits;
    `reduce_range` and an explicit `bits` in the config win), and symmetric weights where
    per-channel zero points are miscomputed (depthwise Conv)."""
    if target is None:
        return spec
    if not spec.symmetric and target.symmetric_weights_needed(kernel, spec.qscheme == QScheme.PER_CHANNEL.value):
        spec = dataclasses.replace(spec, symmetric=True)
    if spec.bits is not None or spec.dtype is not DType.INT8:
        return spec
    act = activation.dtype.value if activation is not None else None
    if act not in ("uint8", "int8"):
        act = None
    if activation is not None and activation.is_dynamic:
        act, kernel = "uint8", "dynamic"
    bits = target.weight_bits(kernel, act)
    if bits is None:
        return spec
    if target.reduce_range is None and k_axes is not None and spec.symmetric \
            and spec.qscheme != QScheme.PER_GROUP.value:
        return dataclasses.replace(spec, pairs=k_axes)
    return dataclasses.replace(spec, bits=bits)


class _Planner:
    def __init__(
        self, model: ir.Model, config: Config, keep_float: Mapping[str, str],
        target: TargetProfile | None,
    ) -> None:
        self.graph = model.graph
        self.config = config
        self.keep_float = keep_float
        self.target = target
        self.nodes = {node.name: node for node in model.graph}
        self.plan = QuantPlan()

    def add_use(self, value: ir.Value, kind: Kind, spec: ResolvedSpec, node: ir.Node, index: int,
                axis: int | None = None) -> TensorPlan:
        tensor = self.plan.tensors.get(value.name)
        if tensor is None:
            tensor = TensorPlan(value.name, kind, spec, axis=axis)
            self.plan.tensors[value.name] = tensor
        tensor.consumers.append((node.name, index))
        if kind is Kind.ACTIVATION and qparams_key(spec) != qparams_key(tensor.spec):
            tensor.requant[(node.name, index)] = spec
        return tensor

    def add_output(self, value: ir.Value, spec: ResolvedSpec, alias_of: str | None = None) -> None:
        tensor = self.plan.tensors.get(value.name)
        if tensor is None:
            tensor = TensorPlan(value.name, Kind.ACTIVATION, spec)
            self.plan.tensors[value.name] = tensor
        tensor.spec = spec
        tensor.alias_of = alias_of
        tensor.all_consumers = True

    def run(self) -> QuantPlan:
        for node in self.graph:
            if node.name in self.plan.fused_activations:
                continue
            self.plan_node(node)
        for node in self.graph:
            self.keep_float_head(node)
        for node in reversed(list(self.graph)):
            self.prune_float_tail(node)
        return self.plan

    def _link_op(self, node: ir.Node) -> OpRule | None:
        """The rule of a quantized op that computes its own output range, else None."""
        rule = OP_RULES.get(node.op_type)
        if node.name not in self.plan.quantized_nodes or rule is None or rule.output is not OutputMode.OWN:
            return None
        return rule

    def _fused_activation_of(self, node: ir.Node) -> str | None:
        return next((a for a, producer in self.plan.fused_activations.items() if producer == node.name), None)

    def _unread(self, node: ir.Node) -> TensorPlan | None:
        """The node's quantized output when no quantized op reads it (only float ops, graph outputs)."""
        out = self.plan.tensors.get(self._output_name(node, self._fused_activation_of(node))) \
            if node.outputs else None
        if out is None or any(c != node.name for c, _ in out.consumers) or out.alias_of is not None:
            return None
        if any(t.alias_of == out.name for t in self.plan.tensors.values()):
            return None
        return out

    def keep_float_head(self, node: ir.Node) -> None:
        """Keep an elementwise op float when every input it reads comes from float.

        Quantizing it would round each float input and then its output again; run in float,
        only its output is rounded, once, for the quantized ops that read it (an input
        normalisation Mul+Add before the first Conv, a SiLU Mul between float ops). Walked
        in topological order, so chains of such ops stay float together.
        """
        rule = self._link_op(node)
        if rule is None or rule.weight_input is not None:
            return
        for value in node.inputs:
            tensor = self.plan.tensors.get(value.name) if value is not None else None
            if tensor is not None and tensor.kind is Kind.ACTIVATION and \
                    (tensor.all_consumers or tensor.alias_of is not None):
                return  # reads the output of a quantized op: an integer link between kernels
        act = self._fused_activation_of(node)
        out = self.plan.tensors.get(self._output_name(node, act)) if node.outputs else None
        self._unplan(node, act, "its inputs are float: run in float, its output is quantized once for its readers")
        if out is not None:
            out.all_consumers = False
            if not out.consumers:
                del self.plan.tensors[out.name]

    def prune_float_tail(self, node: ir.Node) -> None:
        """Drop the output quantization that nothing quantized reads.

        Add, Mul, Concat and pooling have integer kernels only as links between quantized
        ops; when every reader of the output is float (a LayerNormalization after a residual
        Add, a graph output), quantizing it adds error and no speed, so the op stays float.
        Conv keeps its integer kernel and output; Gemm and MatMul keep their integer kernels
        and write float (`OpRule.float_output`), so logits and other graph outputs are not
        rounded. Walked in reverse topological order, so chains of such ops collapse together.
        """
        rule = self._link_op(node)
        if rule is None or (rule.weight_input is not None and not rule.float_output):
            return
        out = self._unread(node)
        if out is None:
            return
        del self.plan.tensors[out.name]
        act = self._fused_activation_of(node)
        if rule.weight_input is None:
            self._unplan(node, act, "its output feeds only float ops: quantizing it adds error, no integer kernel")
        elif act is not None:  # the integer kernel writes float; the activation runs after it in float
            del self.plan.fused_activations[act]
            self.plan.quantized_nodes.pop(act, None)

    def _unplan(self, node: ir.Node, act: str | None, reason: str) -> None:
        """Return a quantized link op (and the activation it absorbed) to float."""
        for i, value in enumerate(node.inputs):
            tensor = self.plan.tensors.get(value.name) if value is not None else None
            if tensor is None:
                continue
            tensor.consumers = [c for c in tensor.consumers if c != (node.name, i)]
            tensor.requant.pop((node.name, i), None)
            if not tensor.consumers and not tensor.all_consumers:
                del self.plan.tensors[value.name]
        self.plan.quantized_nodes.pop(node.name, None)
        self.float_node(node, reason)
        if act is not None:
            del self.plan.fused_activations[act]
            self.plan.quantized_nodes.pop(act, None)

    def _output_name(self, node: ir.Node, fused_act: str | None) -> str:
        """The quantized output of `node`: its own, or that of the activation it absorbed."""
        if fused_act is None:
            return node.outputs[0].name
        return self.nodes[fused_act].outputs[0].name

    def float_node(self, node: ir.Node, reason: str) -> None:
        self.plan.float_nodes[node.name] = (node.op_type, reason)

    def plan_node(self, node: ir.Node) -> None:
        if node.name in self.keep_float:
            self.float_node(node, self.keep_float[node.name])
            return
        cfg = resolve_node_config(self.config, node.name, node.op_type)
        if cfg is None:
            self.float_node(node, "excluded or kept in float by config")
            return
        if self.route_elsewhere(node, cfg):
            return
        rule = OP_RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            self.float_node(node, f"no quantized kernel rule for {node.domain or 'ai.onnx'}::{node.op_type}")
            return
        if rule.applies is not None and not rule.applies(node):
            self.float_node(node, f"this {node.op_type} cannot reuse its input's parameters")
            return
        if rule.output is OutputMode.SHARED:
            self.plan_shared(node, rule, cfg)
        else:
            self.plan_compute(node, rule, cfg)

    def route_elsewhere(self, node: ir.Node, cfg: ResolvedConfig) -> bool:
        """Send a node to the float-target, dynamic or MatMulNBits emitter when its config asks."""
        main = cfg.input_tensors or cfg.weight
        if main is not None and main.dtype in FLOAT_TARGETS:
            self.plan.float_target_nodes[node.name] = main.dtype
            return True
        weights_only = cfg.input_tensors is None or cfg.input_tensors.is_dynamic
        if (
            node.op_type == "Gather"
            and weights_only
            and cfg.weight is not None
            and can_use_gather_block_quantized(node, cfg.weight) is None
        ):
            self.plan.gather_nodes[node.name] = cfg.weight
            self.plan.quantized_nodes[node.name] = node.op_type
            return True
        if node.op_type == "Gather" and weights_only and node.domain in ("", "ai.onnx"):
            # Weight-only and dynamic configs still store embedding tables quantized.
            if self.plan_weight(node, OP_RULES["Gather"], cfg) is None:
                self.float_node(node, "Gather on non-constant data: nothing to quantize")
            else:
                self.plan.quantized_nodes[node.name] = node.op_type
            return True
        if cfg.input_tensors is not None and cfg.input_tensors.is_dynamic:
            weight = node.inputs[1] if len(node.inputs) > 1 else None
            if node.op_type not in DYNAMIC_OPS:
                self.float_node(node, "dynamic quantization covers MatMul, Gemm, Conv and LSTM only")
            elif cfg.weight is None or constant_array(weight) is None:
                self.float_node(node, "dynamic quantization needs a constant weight")
            else:
                self.plan.dynamic_nodes[node.name] = _target_weight_spec(
                    self.target, cfg.weight, "dynamic", cfg.input_tensors)
                self.plan.quantized_nodes[node.name] = node.op_type
            return True
        if (
            self.config.matmul_nbits
            and cfg.input_tensors is None
            and cfg.weight is not None
            and can_use_matmul_nbits(node, cfg.weight) is None
        ):
            self.plan.nbits_nodes[node.name] = cfg.weight
            self.plan.quantized_nodes[node.name] = node.op_type
            return True
        return False

    def plan_shared(self, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> None:
        data = node.inputs[0] if node.inputs else None
        if (
            rule.quantize_constant_data
            and cfg.input_tensors is not None
            and _is_float(data)
            and constant_array(data) is not None
        ):
            # An embedding table: stored quantized, looked up in int8, read out through DQ.
            self.add_use(data, Kind.CONSTANT, cfg.input_tensors, node, 0)
            source = self.plan.tensors[data.name]
        elif data is None or data.name not in self.plan.tensors or constant_array(data) is not None:
            self.float_node(node, "input is not quantized (data movement op stays float)")
            return
        else:
            source = self.plan.tensors[data.name]
            source.consumers.append((node.name, 0))
        if source.kind not in (Kind.ACTIVATION, Kind.CONSTANT):
            self.float_node(node, "input is quantized as a weight of another op")
            return
        for out in node.outputs:
            if _is_float(out):
                self.add_output(out, source.spec, alias_of=data.name)
        self.plan.quantized_nodes[node.name] = node.op_type

    def plan_compute(self, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> None:
        weight_index = self.plan_weight(node, rule, cfg)
        act_spec = cfg.input_tensors
        quantized_inputs = []
        if act_spec is not None:
            indices = rule.activation_inputs or tuple(range(len(node.inputs)))
            for i in indices:
                value = node.inputs[i] if i < len(node.inputs) else None
                if i == weight_index or not _is_float(value):
                    continue
                kind = Kind.CONSTANT if constant_array(value) is not None else Kind.ACTIVATION
                self.add_use(value, kind, act_spec, node, i)
                quantized_inputs.append(i)
        if weight_index is None and not quantized_inputs:
            self.float_node(node, "no tensor of this node is configured for quantization")
            return
        self.plan.quantized_nodes[node.name] = node.op_type
        if act_spec is not None and weight_index is not None and rule.bias_input is not None:
            self.plan_bias(node, rule, cfg, weight_index)
        out_spec = cfg.output_tensors
        if out_spec is None or not quantized_inputs:
            return
        for out in node.outputs:
            if not _is_float(out):
                continue
            act = _fusable_activation(out, self.config)
            if act is not None:
                self.plan.fused_activations[act.name] = node.name
                self.plan.quantized_nodes[act.name] = act.op_type
                out = act.outputs[0]
            self.add_output(out, out_spec)

    def plan_weight(self, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> int | None:
        i = rule.weight_input
        if i is None or i >= len(node.inputs) or cfg.weight is None:
            return None
        value = node.inputs[i]
        array = constant_array(value)
        if array is None or not _is_float(value):
            return None
        axis, block = None, None
        if cfg.weight.qscheme == QScheme.PER_GROUP.value:
            axis, block = rule.weight_in_axis(node, array.ndim), cfg.weight.group_size
        elif cfg.weight.qscheme == QScheme.PER_CHANNEL.value:
            axis = cfg.weight.ch_axis if cfg.weight.ch_axis is not None else rule.weight_axis(node, array.ndim)
        if axis is not None:
            axis %= max(array.ndim, 1)
        spec = _target_weight_spec(self.target, cfg.weight, _kernel_class(node, array), cfg.input_tensors,
                                   layout.k_axes(node, array.ndim))
        tensor = self.add_use(value, Kind.WEIGHT, spec, node, i, axis=axis)
        tensor.block_size = block
        return i

    def plan_bias(self, node: ir.Node, rule: OpRule, cfg: ResolvedConfig, weight_index: int) -> None:
        i = rule.bias_input
        if cfg.bias is None or i >= len(node.inputs) or node.inputs[i] is None:
            return
        bias, act, weight = node.inputs[i], node.inputs[0], node.inputs[weight_index]
        array = constant_array(bias)
        if array is None or array.ndim != 1 or act.name not in self.plan.tensors:
            return
        # A bias shared by several nodes gets one plan per node: its scale depends on each
        # node's input and weight scales.
        key = bias.name if len(bias.uses()) == 1 else f"{bias.name}@{node.name}"
        tensor = TensorPlan(key, Kind.BIAS, cfg.bias, axis=0 if array.size > 1 else None, source=bias.name)
        tensor.consumers.append((node.name, i))
        tensor.bias_inputs = (act.name, weight.name)
        self.plan.tensors[key] = tensor


def plan_quantization(
    model: ir.Model, config: Config, keep_float: Mapping[str, str] | None = None,
    target: TargetProfile | None = None,
) -> QuantPlan:
    """Walk the graph in topological order and decide what each tensor becomes.

    `keep_float` names nodes (with the reason) that earlier passes require to stay float.
    `target` narrows int8 weights where its kernels saturate (None: leave them 8-bit).
    """
    return _Planner(model, config, keep_float or {}, target).run()
