"""Static quantization: calibrated Q/DQ around every op the rules table (`plan/rules.py`)
knows; the catch-all, asked last (lowered by `emit/qdq`).

A compute op (`plan_compute`) gets its weight (narrowed for the target's kernel), its
float inputs as activations or constants, its bias (scaled by the input and weight
scales) and its output, into which a lone Relu/Clip reader is fused. A data-movement op
(`plan_shared`) passes its input's parameters on to its outputs.
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, resolve_node_config
from onnxq.config.spec import TENSOR_CLASSES, Config, DType, QScheme
from onnxq.errors import ConfigError
from onnxq.graph import layout
from onnxq.graph.fold import constant_array
from onnxq.notes import Note, Topic
from onnxq.plan.draft import Draft
from onnxq.plan.plan import Kind, QuantPlan, TensorPlan
from onnxq.plan.rules import DYNAMIC_OPS, FUSABLE_ACTIVATIONS, OP_RULES, OpRule, OutputMode
from onnxq.plan.strategies.registry import Decision, Planned, Refuse, register_strategy
from onnxq.target.narrowing import kernel_class

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


def _unfused(node: ir.Node, draft: Draft) -> str:
    """Why a Relu/Clip was not absorbed into the op before it (`_fusable_activation`)."""
    value = node.inputs[0] if node.inputs else None
    producer = value.producer() if value is not None else None
    before = f"the {producer.op_type} before it" if producer is not None else "its input"
    tail = f"and a {node.op_type} is quantized only with the op it follows"
    if producer is None or producer.name not in draft.quantized_nodes:
        return f"{before} stays float, {tail}"
    if value.name not in draft.tensors and producer.name in draft.lowered:
        how = draft.lowered[producer.name].strategy.replace("_", " ")
        return f"{before} is lowered as {how}, whose output stays float, {tail}"
    if value.name not in draft.tensors:
        cfg = resolve_node_config(draft.config, producer.name or "", producer.op_type)
        why = "no output spec in the config" if cfg is None or cfg.output_tensors is None else \
            "its input is not quantized"
        return f"{before} writes a float output ({why}), {tail}"
    if not draft.config.fuse_activations:
        why = "fuse_activations is off"
    elif value.is_graph_output():
        why = f"the {producer.op_type}'s output is also a graph output"
    elif len(value.consumers()) > 1:
        why = f"the {producer.op_type}'s output has other readers"
    elif node.op_type == "Clip":
        why = "its bounds are computed at run time"
    else:
        why = "its config differs"
    return f"{why}: it runs in float on the dequantized output of {before}"


def _subgraph_ops(node: ir.Node) -> dict[str, int]:
    """Op counts of the nodes in `node`'s subgraphs (If, Loop, Scan bodies), nested ones too."""
    counts: dict[str, int] = {}
    for attribute in node.attributes.values():
        graphs = [attribute.value] if attribute.type == ir.AttributeType.GRAPH else (
            list(attribute.value) if attribute.type == ir.AttributeType.GRAPHS else [])
        for graph in graphs:
            for inner in graph:
                counts[inner.op_type] = counts.get(inner.op_type, 0) + 1
                for op, n in _subgraph_ops(inner).items():
                    counts[op] = counts.get(op, 0) + n
    return counts


@register_strategy("static", order=100)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    rule = OP_RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if rule is None and node.op_type in FUSABLE_ACTIVATIONS and node.domain in ("", "ai.onnx"):
        # quantized only as part of the op before it (one int8 kernel), which is float here
        return Refuse(_unfused(node, draft))
    if rule is None and (inner := _subgraph_ops(node)):
        counts = ", ".join(f"{op} x{n}" for op, n in sorted(inner.items()))
        return Refuse(f"control flow: the {sum(inner.values())} nodes of its subgraphs ({counts}) run in float "
                      "(onnxq quantizes the main graph)")
    if rule is None and node.op_type in DYNAMIC_OPS and node.domain in ("", "ai.onnx"):
        # an LSTM: onnxruntime's integer kernel quantizes its activations at run time
        return Refuse(f"no static integer kernel for {node.op_type}; dynamic quantization has one "
                      f"(--preset W8_DYNAMIC, or layer_type_quant_config {node.op_type}: input_tensors: is_dynamic: true)")
    if rule is None:
        return Refuse(f"no quantized kernel rule for {node.domain or 'ai.onnx'}::{node.op_type}")
    if rule.applies is not None and not rule.applies(node):
        return Refuse(f"this {node.op_type} cannot reuse its input's parameters")
    if rule.output is OutputMode.SHARED:
        plan_shared(draft, node, rule, cfg)
    else:
        plan_compute(draft, node, rule, cfg)
    return Planned()


def plan_shared(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> None:
    """A data-movement op: its outputs share its input's parameters."""
    data = node.inputs[0] if node.inputs else None
    if (
        rule.quantize_constant_data
        and cfg.input_tensors is not None
        and _is_float(data)
        and constant_array(data) is not None
    ):
        # An embedding table: stored quantized, looked up in int8, read out through DQ.
        draft.add_use(data, Kind.CONSTANT, cfg.input_tensors, node, 0)
        source = draft.tensors[data.name]
    elif data is None or data.name not in draft.tensors or constant_array(data) is not None:
        draft.float_node(node, "input is not quantized (data movement op stays float)")
        return
    else:
        source = draft.tensors[data.name]
        source = draft.update(data.name, consumers=(*source.consumers, (node.name, 0)))
    if source.kind not in (Kind.ACTIVATION, Kind.CONSTANT):
        draft.float_node(node, "input is quantized as a weight of another op")
        return
    for out in node.outputs:
        if _is_float(out):
            draft.add_output(out, source.spec, alias_of=data.name)
    draft.quantized(node)


def _why_unconfigured(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> str:
    """Why a compute node has no tensor to quantize: a weight-only config whose weight
    is not where the op's kernels take it, or the config level that keeps it float."""
    i = rule.weight_input
    if cfg.weight is not None and i is not None:
        other = [k for k, v in enumerate(node.inputs) if k not in (i, rule.bias_input) and v is not None
                 and constant_array(v) is not None]
        if other:
            return (f"weight-only quantization takes the constant weight as input {i} of {node.op_type}; "
                    f"this node's constant is input {other[0]}")
        weight = node.inputs[i] if i < len(node.inputs) else None
        if weight is not None and constant_array(weight) is not None and not _is_float(weight):
            kind = weight.dtype.name.lower() if weight.dtype is not None else "of an unknown type"
            return (f"its weight is {kind}; onnxq quantizes float32, float16 and bfloat16 weights (export the "
                    "model in float32)")
        return f"weight-only quantization needs a constant weight as input {i}; this one is computed at run time"
    return _kept_float_by(draft, node, "no tensor of this node is configured for quantization")


def _kept_float_by(draft: Draft, node: ir.Node, otherwise: str, classes: tuple[str, ...] = TENSOR_CLASSES) -> str:
    """The config level that keeps `node`'s tensors of `classes` float (the first level, node,
    op type then global, that gives one of them a type: float32), else `otherwise`."""
    levels = ((f"its node override (layer_quant_config: {node.name})", draft.config.layer_quant_config.get(node.name)),
              (f"the config's {node.op_type} override (layer_type_quant_config)",
               draft.config.layer_type_quant_config.get(node.op_type)),
              ("the global config (global_quant_config)", draft.config.global_quant_config))
    for tensor_class in classes:
        for where, level in levels:
            spec = getattr(level, tensor_class) if level is not None else None
            if spec is None or (spec.dtype is None and spec.exponent_bits is None and spec.mantissa_bits is None):
                continue  # this level leaves the tensor class's type to the levels below
            if spec.dtype is not None and DType(spec.dtype) is DType.FLOAT32:
                return f"kept float by {where}"
            break
    return otherwise


def plan_compute(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> None:
    """An op that computes its own output: weight, activation inputs, bias, output."""
    weight_index = plan_weight(draft, node, rule, cfg)
    act_spec = cfg.input_tensors
    quantized_inputs = []
    if act_spec is not None:
        indices = rule.activation_inputs or tuple(range(len(node.inputs)))
        for i in indices:
            value = node.inputs[i] if i < len(node.inputs) else None
            if i == weight_index or not _is_float(value):
                continue
            constant = constant_array(value) is not None
            if constant and rule.weight_input is not None and cfg.weight is None:
                continue  # a constant operand of a weighted op the config keeps float (weight float32)
            kind = Kind.CONSTANT if constant else Kind.ACTIVATION
            draft.add_use(value, kind, act_spec, node, i)
            quantized_inputs.append(i)
    if weight_index is None and not quantized_inputs:
        draft.float_node(node, _why_unconfigured(draft, node, rule, cfg))
        return
    draft.quantized(node)
    i = rule.weight_input
    if cfg.weight is None and i is not None and i < len(node.inputs) and _is_float(node.inputs[i]) \
            and constant_array(node.inputs[i]) is not None:  # quantized inputs, float weight: float arithmetic
        draft.float_weights[node.name] = _kept_float_by(draft, node, "the config gives its weight no spec",
                                                        ("weight",))
    if act_spec is not None and weight_index is not None and rule.bias_input is not None:
        plan_bias(draft, node, rule, cfg, weight_index)
    out_spec = cfg.output_tensors
    if out_spec is None or not quantized_inputs:
        return
    for out in node.outputs:
        if not _is_float(out):
            continue
        act = _fusable_activation(out, draft.config)
        if act is not None:
            draft.fused_activations[act.name] = node.name
            draft.quantized(act)
            out = act.outputs[0]
        draft.add_output(out, out_spec)


def plan_weight(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig) -> int | None:
    """Plan the node's constant float weight (the spec its kernel runs on the target);
    its input index, or None when it has none to quantize."""
    i = rule.weight_input
    if i is None or i >= len(node.inputs) or cfg.weight is None:
        return None
    value = node.inputs[i]
    array = constant_array(value)
    if array is None or not _is_float(value):
        return None
    axis, block = _granularity(draft, node, rule, cfg, array)
    if axis is not None:
        axis %= max(array.ndim, 1)
    spec = draft.target_weight_spec(cfg.weight, kernel_class(node, array), cfg.input_tensors,
                                    layout.k_axes(node, array.ndim))
    draft.add_use(value, Kind.WEIGHT, spec, node, i, axis=axis)
    draft.update(value.name, block_size=block)
    return i


# Input channels (per group) a convolution's weight needs for blocks along them: a block is
# at most that many weights with a float scale of its own, per output channel and tap (a
# depthwise layer's 1 or an RGB first layer's 3 would make the layer larger than float). A
# MatMul's blocks run along K, one scale per block of its whole column.
MIN_BLOCK_CHANNELS = 8


def _granularity(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig,
                 array: object) -> tuple[int | None, int | None]:
    """(axis, block size) of the weight's scales as the config asks for them, or coarser
    where onnxruntime cannot run them (the plan's `coarser_weights` says why): a MatMul
    weight of another rank than 2 per tensor (a vector, or a batch of matrices: its integer
    MatMul refused the per-column zero points of a [2, 4, 6] weight at run time, while the
    session loaded), the blocks of a Conv with fewer than MIN_BLOCK_CHANNELS input channels
    per group (a depthwise, a grayscale or an RGB first layer) per channel."""
    spec = cfg.weight
    scheme, ndim = spec.qscheme, array.ndim
    if scheme == QScheme.PER_TENSOR.value:
        return None, None
    if node.op_type == "MatMul" and ndim != 2:
        draft.coarser_weights[node.name] = ("per tensor: its weight is no matrix (a vector or a batch of them), and "
                                            "per-column or block scales are for a rank-2 MatMul weight")
        return None, None
    if scheme == QScheme.PER_GROUP.value:
        axis = rule.weight_in_axis(node, ndim)
        if node.op_type not in layout.CONVS or array.shape[axis] >= MIN_BLOCK_CHANNELS:
            return axis, spec.group_size
        draft.coarser_weights[node.name] = (f"per channel: its weight has fewer than {MIN_BLOCK_CHANNELS} input "
                                            "channels (per group), so each block would hold a few weights and a "
                                            "float scale")
        return rule.weight_axis(node, ndim), None
    return _output_axis(node, rule, spec.ch_axis, ndim), None


def _output_axis(node: ir.Node, rule: OpRule, ch_axis: int | None, ndim: int) -> int:
    """The axis a per-channel weight is scaled along: its output channels (`graph/layout`).
    A `ch_axis` naming another is refused: onnxruntime's integer kernels take one scale
    per output channel and, fused, read any other axis's scales wrongly (a Conv scaled
    per input channel kept 38 dB unfused and fell to 0.2 dB in a default session)."""
    out = rule.weight_axis(node, ndim) % max(ndim, 1)
    if ch_axis is None:
        return out
    if not -ndim <= ch_axis < ndim:
        raise ConfigError(f"weight ch_axis {ch_axis} of {node.op_type} {node.name!r}: its weight has {ndim} axes; "
                          f"remove ch_axis (each op's output-channel axis is taken, here {out})")
    if ch_axis % ndim != out:
        raise ConfigError(f"weight ch_axis {ch_axis} of {node.op_type} {node.name!r} is not its output-channel axis "
                          f"{out}: onnxruntime's integer kernels take one weight scale per output channel; remove "
                          "ch_axis (each op's output-channel axis is taken)")
    return out


def plan_bias(draft: Draft, node: ir.Node, rule: OpRule, cfg: ResolvedConfig, weight_index: int) -> None:
    """Plan the node's constant bias, scaled by its input's and weight's scales."""
    i = rule.bias_input
    if cfg.bias is None or i >= len(node.inputs) or node.inputs[i] is None:
        return
    bias, act, weight = node.inputs[i], node.inputs[0], node.inputs[weight_index]
    array = constant_array(bias)
    if array is None or array.ndim != 1 or act.name not in draft.tensors:
        return
    # A bias shared by several nodes gets one plan per node: its scale depends on each
    # node's input and weight scales.
    key = bias.name if len(bias.uses()) == 1 else f"{bias.name}@{node.name}"
    draft.tensors[key] = TensorPlan(key, Kind.BIAS, cfg.bias, axis=0 if array.size > 1 else None,
                                    source=bias.name, consumers=((node.name, i),),
                                    bias_inputs=(act.name, weight.name))


def coarser_note(plan: QuantPlan) -> Note | None:
    """The summary's word on weights quantized coarser than asked (`_granularity`)."""
    if not plan.coarser_weights:
        return None
    reasons = "; ".join(f"{count} {why}" for why, count in Counter(plan.coarser_weights.values()).most_common())
    names = tuple(plan.coarser_weights)
    return Note(Topic.EMISSION, f"{len(names)} weight{'s' * (len(names) > 1)} quantized coarser than the config "
                f"asks ({reasons}): {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}", names)
