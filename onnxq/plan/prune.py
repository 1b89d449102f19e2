"""The walks after every node is planned: link ops (Add, Mul, Concat, pooling, data
movement) whose quantization only adds error return to float.

An integer link between kernels pays off only when quantized ops sit on both sides; a
float head (all inputs float) or a float tail (only float readers) rounds values that
no integer kernel reads. Each walk runs over the whole graph, in the order `prune` gives.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxq.plan.draft import Draft
from onnxq.plan.plan import Kind, TensorPlan
from onnxq.plan.rules import OP_RULES, OpRule, OutputMode

FLOAT_HEAD = "its inputs are float: run in float, its output is quantized once for its readers"


def prune(draft: Draft, graph: ir.Graph) -> None:
    """Keep float heads float (topological order), drop float tails (reverse order, so
    chains collapse together), then name the heads nothing quantized reads."""
    for node in graph:
        keep_float_head(draft, node)
    for node in reversed(list(graph)):
        prune_float_tail(draft, node)
        prune_shared_tail(draft, node)
    for node in graph:
        name_float_head(draft, node)


def _link_op(draft: Draft, node: ir.Node) -> OpRule | None:
    """The rule of a quantized op that computes its own output range, else None."""
    rule = OP_RULES.get(node.op_type)
    if node.name not in draft.quantized_nodes or rule is None or rule.output is not OutputMode.OWN:
        return None
    return rule


def _fused_activation_of(draft: Draft, node: ir.Node) -> str | None:
    return next((a for a, producer in draft.fused_activations.items() if producer == node.name), None)


def _output_name(draft: Draft, node: ir.Node, fused_act: str | None) -> str:
    """The quantized output of `node`: its own, or that of the activation it absorbed."""
    if fused_act is None:
        return node.outputs[0].name
    return draft.nodes[fused_act].outputs[0].name


def _unread(draft: Draft, node: ir.Node) -> TensorPlan | None:
    """The node's quantized output when no quantized op reads it (only float ops, graph outputs)."""
    out = draft.tensors.get(_output_name(draft, node, _fused_activation_of(draft, node))) \
        if node.outputs else None
    if out is None or any(c != node.name for c, _ in out.consumers) or out.alias_of is not None:
        return None
    if any(t.alias_of == out.name for t in draft.tensors.values()):
        return None
    return out


def _unplan(draft: Draft, node: ir.Node, act: str | None, reason: str) -> None:
    """Return a quantized link op (and the activation it absorbed) to float."""
    for i, value in enumerate(node.inputs):
        tensor = draft.tensors.get(value.name) if value is not None else None
        if tensor is None:
            continue
        use = (node.name, i)
        tensor = draft.update(value.name, consumers=tuple(c for c in tensor.consumers if c != use),
                              requant={u: sp for u, sp in tensor.requant.items() if u != use})
        if not tensor.consumers and not tensor.all_consumers:
            del draft.tensors[value.name]
    draft.quantized_nodes.pop(node.name, None)
    draft.float_node(node, reason)
    if act is not None:
        del draft.fused_activations[act]
        draft.quantized_nodes.pop(act, None)


def keep_float_head(draft: Draft, node: ir.Node) -> None:
    """Keep an elementwise op float when every input it reads comes from float.

    Quantizing it would round each float input and then its output again; run in float,
    only its output is rounded, once, for the quantized ops that read it (an input
    normalisation Mul+Add before the first Conv, a SiLU Mul between float ops). Walked
    in topological order, so chains of such ops stay float together.
    """
    rule = _link_op(draft, node)
    if rule is None or rule.weight_input is not None:
        return
    for value in node.inputs:
        tensor = draft.tensors.get(value.name) if value is not None else None
        if tensor is not None and tensor.kind is Kind.ACTIVATION and \
                (tensor.all_consumers or tensor.alias_of is not None):
            return  # reads the output of a quantized op: an integer link between kernels
    act = _fused_activation_of(draft, node)
    out = draft.tensors.get(_output_name(draft, node, act)) if node.outputs else None
    _unplan(draft, node, act, FLOAT_HEAD)
    if out is not None and out.name in draft.tensors:
        out = draft.update(out.name, all_consumers=False)
        if not out.consumers:
            del draft.tensors[out.name]


def prune_float_tail(draft: Draft, node: ir.Node) -> None:
    """Drop the output quantization that nothing quantized reads.

    Add, Mul, Concat and pooling have integer kernels only as links between quantized
    ops; when every reader of the output is float (a LayerNormalization after a residual
    Add, a graph output), quantizing it adds error and no speed, so the op stays float.
    Conv keeps its integer kernel and output; Gemm and MatMul keep their integer kernels
    and write float (`OpRule.float_output`), so logits and other graph outputs are not
    rounded. Walked in reverse topological order, so chains of such ops collapse together.
    """
    rule = _link_op(draft, node)
    if rule is None or (rule.weight_input is not None and not rule.float_output):
        return
    out = _unread(draft, node)
    if out is None:
        return
    del draft.tensors[out.name]
    act = _fused_activation_of(draft, node)
    if rule.weight_input is None:
        _unplan(draft, node, act, "its output feeds only float ops: quantizing it adds error, no integer kernel")
    elif act is not None:  # the integer kernel writes float; the activation runs after it in float
        del draft.fused_activations[act]
        draft.quantized_nodes.pop(act, None)
        draft.float_node(draft.nodes[act], f"runs in float after the integer {node.op_type} before it, which "
                                           "writes float: its output feeds only float ops")


def prune_shared_tail(draft: Draft, node: ir.Node) -> None:
    """Keep a data-movement op (Flatten, Reshape, ...) float when no quantized op reads
    what it passes on: it would only carry Q/DQ to float readers (an excluded Gemm
    after a pool and a Flatten). Walked in reverse topological order with
    `prune_float_tail`, so chains collapse, and the op before it loses its reader."""
    if node.name not in draft.quantized_nodes or not node.inputs or node.inputs[0] is None:
        return
    data = node.inputs[0].name
    source = draft.tensors.get(data)
    outs = [draft.tensors.get(o.name) for o in node.outputs if o is not None]
    # A data-movement op reading an output is one of its consumers (`plan_shared`).
    if source is None or source.kind is not Kind.ACTIVATION or not outs or \
            any(t is None or t.alias_of != data or t.consumers for t in outs):
        return
    for t in outs:
        del draft.tensors[t.name]
    _unplan(draft, node, None, "its output feeds only float ops: data movement stays float")


def name_float_head(draft: Draft, node: ir.Node) -> None:
    """A float head whose output no quantized op reads in the end says so."""
    if draft.float_nodes.get(node.name, (None, None))[1] != FLOAT_HEAD or not node.outputs:
        return
    if all(o is None or o.name not in draft.tensors for o in node.outputs):
        draft.float_node(node, "its inputs and its readers are float")
