"""Decide, before calibration, how every tensor of the model will be quantized.

The plan names the activation tensors to calibrate (and the spec each is calibrated
for), the weights, biases and constants to quantize offline, the activations absorbed
into the op before them, and the nodes left in float with the reason why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, ResolvedSpec, resolve_node_config
from onnxq.config.spec import Config, DType, QScheme
from onnxq.graph import layout
from onnxq.graph.fold import constant_array
from onnxq.plan import strategies
from onnxq.plan.plan import Kind, Lowered, QuantPlan, TensorPlan, qparams_key
from onnxq.plan.rules import FUSABLE_ACTIVATIONS, OP_RULES, OpRule, OutputMode
from onnxq.target import TargetProfile

FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


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
    (per-tensor weights of uint8 activations as uint8, U8U8 kernels; pair-safe scales where
    the K order is known and weights are symmetric, else 7 bits; `reduce_range` and an
    explicit `bits` in the config win), and symmetric weights where per-channel zero
    points are miscomputed (depthwise Conv)."""
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
    if target.reduce_range is None and spec.qscheme == QScheme.PER_TENSOR.value and act == "uint8" \
            and kernel == "gemm" and "u8u8_gemm" not in target.wrong:
        # One scale for the tensor must hold every channel's kernel pairs, far coarser than
        # pair-safe per-channel scales; uint8 weights run U8U8 kernels, exact on every CPU
        # (MobileNet per-tensor CLE + bias correction: 83.38 pair-safe, 85.25 uint8).
        return dataclasses.replace(spec, dtype=DType.UINT8)
    if target.reduce_range is None and k_axes is not None and spec.symmetric \
            and spec.qscheme != QScheme.PER_GROUP.value:
        return dataclasses.replace(spec, pairs=k_axes)
    return dataclasses.replace(spec, bits=bits)


FLOAT_HEAD = "its inputs are float: run in float, its output is quantized once for its readers"


@dataclasses.dataclass
class _Draft:
    """The plan while the planner builds it (frozen into a `QuantPlan` at the end)."""

    tensors: dict[str, TensorPlan] = dataclasses.field(default_factory=dict)
    quantized_nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    float_nodes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    fused_activations: dict[str, str] = dataclasses.field(default_factory=dict)
    lowered: dict[str, Lowered] = dataclasses.field(default_factory=dict)


class Planner:
    """Walks the graph once, offering each node to the registered strategies."""

    def __init__(
        self, model: ir.Model, config: Config, keep_float: Mapping[str, str],
        target: TargetProfile | None,
    ) -> None:
        self.graph = model.graph
        self.config = config
        self.keep_float = keep_float
        self.target = target
        self.nodes = {node.name: node for node in model.graph}
        self.plan = _Draft()

    def update(self, name: str, **changes: object) -> TensorPlan:
        """Replace the planned tensor `name` by a copy with `changes`."""
        tensor = self.plan.tensors[name] = dataclasses.replace(self.plan.tensors[name], **changes)
        return tensor

    def add_use(self, value: ir.Value, kind: Kind, spec: ResolvedSpec, node: ir.Node, index: int,
                axis: int | None = None) -> TensorPlan:
        tensor = self.plan.tensors.setdefault(value.name, TensorPlan(value.name, kind, spec, axis=axis))
        use = (node.name, index)
        requant = tensor.requant
        if kind is Kind.ACTIVATION and qparams_key(spec) != qparams_key(tensor.spec):
            requant = {**requant, use: spec}
        return self.update(value.name, consumers=(*tensor.consumers, use), requant=requant)

    def add_output(self, value: ir.Value, spec: ResolvedSpec, alias_of: str | None = None) -> None:
        self.plan.tensors.setdefault(value.name, TensorPlan(value.name, Kind.ACTIVATION, spec))
        self.update(value.name, spec=spec, alias_of=alias_of, all_consumers=True)

    def quantized(self, node: ir.Node) -> None:
        self.plan.quantized_nodes[node.name] = node.op_type

    def target_weight_spec(self, spec: ResolvedSpec, kernel: str, activation: ResolvedSpec | None,
                           k_axes: tuple[int, ...] | None = None) -> ResolvedSpec:
        return _target_weight_spec(self.target, spec, kernel, activation, k_axes)

    def run(self) -> QuantPlan:
        for node in self.graph:
            if node.name in self.plan.fused_activations:
                continue
            self.plan_node(node)
        for node in self.graph:
            self.keep_float_head(node)
        for node in reversed(list(self.graph)):
            self.prune_float_tail(node)
            self.prune_shared_tail(node)
        for node in self.graph:
            self.name_float_head(node)
        return QuantPlan(**{f.name: getattr(self.plan, f.name) for f in dataclasses.fields(self.plan)})

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
        self._unplan(node, act, FLOAT_HEAD)
        if out is not None and out.name in self.plan.tensors:
            out = self.update(out.name, all_consumers=False)
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

    def prune_shared_tail(self, node: ir.Node) -> None:
        """Keep a data-movement op (Flatten, Reshape, ...) float when no quantized op reads
        what it passes on: it would only carry Q/DQ to float readers (an excluded Gemm
        after a pool and a Flatten). Walked in reverse topological order with
        `prune_float_tail`, so chains collapse, and the op before it loses its reader."""
        if node.name not in self.plan.quantized_nodes or not node.inputs or node.inputs[0] is None:
            return
        data = node.inputs[0].name
        source = self.plan.tensors.get(data)
        outs = [self.plan.tensors.get(o.name) for o in node.outputs if o is not None]
        # A data-movement op reading an output is one of its consumers (`plan_shared`).
        if source is None or source.kind is not Kind.ACTIVATION or not outs or \
                any(t is None or t.alias_of != data or t.consumers for t in outs):
            return
        for t in outs:
            del self.plan.tensors[t.name]
        self._unplan(node, None, "its output feeds only float ops: data movement stays float")

    def name_float_head(self, node: ir.Node) -> None:
        """A float head whose output no quantized op reads in the end says so."""
        if self.plan.float_nodes.get(node.name, (None, None))[1] != FLOAT_HEAD or not node.outputs:
            return
        if all(o is None or o.name not in self.plan.tensors for o in node.outputs):
            self.float_node(node, "its inputs and its readers are float")

    def _unplan(self, node: ir.Node, act: str | None, reason: str) -> None:
        """Return a quantized link op (and the activation it absorbed) to float."""
        for i, value in enumerate(node.inputs):
            tensor = self.plan.tensors.get(value.name) if value is not None else None
            if tensor is None:
                continue
            use = (node.name, i)
            tensor = self.update(value.name, consumers=tuple(c for c in tensor.consumers if c != use),
                                 requant={u: sp for u, sp in tensor.requant.items() if u != use})
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
        """Offer `node` to each registered strategy until one decides (`plan/strategies`)."""
        if node.name in self.keep_float:
            self.float_node(node, self.keep_float[node.name])
            return
        cfg = resolve_node_config(self.config, node.name, node.op_type)
        if cfg is None:
            self.float_node(node, "excluded or kept in float by config")
            return
        for strategy in strategies.ordered():
            decision = strategy.claim(node, cfg, self)
            if decision is None:
                continue
            if isinstance(decision, strategies.Refuse):
                self.float_node(node, decision.reason)
            elif isinstance(decision, strategies.Lower):
                self.plan.lowered[node.name] = Lowered(strategy.name, decision.spec)
                if strategy.counted:
                    self.quantized(node)
            return

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
            source = self.update(data.name, consumers=(*source.consumers, (node.name, 0)))
        if source.kind not in (Kind.ACTIVATION, Kind.CONSTANT):
            self.float_node(node, "input is quantized as a weight of another op")
            return
        for out in node.outputs:
            if _is_float(out):
                self.add_output(out, source.spec, alias_of=data.name)
        self.plan.quantized_nodes[node.name] = node.op_type

    def _why_unconfigured(self, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> str:
        """Why a compute node has no tensor to quantize: a weight-only config whose weight
        is not where the op's kernels take it, or the config level that keeps it float."""
        i = rule.weight_input
        if cfg.weight is not None and i is not None:
            other = [k for k, v in enumerate(node.inputs) if k not in (i, rule.bias_input) and v is not None
                     and constant_array(v) is not None]
            if other:
                return (f"weight-only quantization takes the constant weight as input {i} of {node.op_type}; "
                        f"this node's constant is input {other[0]}")
            return f"weight-only quantization needs a constant weight as input {i}; this one is computed at run time"
        if node.name in self.config.layer_quant_config:
            return f"kept float by its node override (layer_quant_config: {node.name})"
        if node.op_type in self.config.layer_type_quant_config:
            return f"kept float by the config's {node.op_type} override (layer_type_quant_config)"
        return "no tensor of this node is configured for quantization"

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
            self.float_node(node, self._why_unconfigured(node, rule, cfg))
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
        self.add_use(value, Kind.WEIGHT, spec, node, i, axis=axis)
        self.update(value.name, block_size=block)
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
        self.plan.tensors[key] = TensorPlan(key, Kind.BIAS, cfg.bias, axis=0 if array.size > 1 else None,
                                            source=bias.name, consumers=((node.name, i),),
                                            bias_inputs=(act.name, weight.name))


def plan_quantization(
    model: ir.Model, config: Config, keep_float: Mapping[str, str] | None = None,
    target: TargetProfile | None = None,
) -> QuantPlan:
    """Walk the graph in topological order and decide what each tensor becomes.

    `keep_float` names nodes (with the reason) that earlier passes require to stay float.
    `target` narrows int8 weights where its kernels saturate (None: leave them 8-bit).
    """
    return Planner(model, config, keep_float or {}, target).run()
