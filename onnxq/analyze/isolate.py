"""One model that shows the error each layer adds on its own.

The float model, plus, for each layer of the quantized model, a copy of that layer with
its Q/DQ (weights dequantized, activations quantized and read back) fed from the float
model's tensors. Its output, next to the float output of the same name, is the error of
quantizing that layer alone; one pass over the data measures every layer at once.
The copies run in a default session, so their QDQ groups fuse into the same integer
kernels a deployment runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnxq.analyze.qgraph import Layer, bias_add, dequantizer, is_extended, is_glue
from onnxq.graph.edit import values_by_name

PREFIX = "onnxq_isolated/"


@dataclass(frozen=True)
class IsolatedLayer:
    """Layer `layer` copied: `output` (in the merged model) against float `reference`."""

    layer: Layer
    output: str
    reference: str


class _Copier:
    """Copies a quantized layer and the Q/DQ glue before it into the float graph."""

    def __init__(self, float_model: ir.Model) -> None:
        self.graph = float_model.graph
        self.float_values = values_by_name(self.graph)
        self.copied: dict[int, ir.Value] = {}
        self.count: dict[str, int] = {}

    def unique(self, name: str) -> str:
        """`PREFIX + name`, numbered when a copy of the same name exists (a layer output's
        Q/DQ is copied once for the layer and once as glue for the layers reading it)."""
        base = PREFIX + name
        self.count[base] = self.count.get(base, 0) + 1
        return base if self.count[base] == 1 else f"{base}~{self.count[base]}"

    def value(self, v: ir.Value) -> ir.Value | None:
        """The merged-model value standing for the quantized model's `v` in isolation."""
        key = id(v)
        if key in self.copied:
            return self.copied[key]
        producer = v.producer()
        if v.const_value is not None and producer is None:
            out = ir.Value(name=self.unique(v.name), type=v.type, shape=v.shape, const_value=v.const_value)
            self.graph.register_initializer(out)
        elif is_glue(producer):
            out = self.node(producer, v, shared=True)
        else:
            out = self.float_values.get(v.name)
        if out is not None:
            self.copied[key] = out
        return out

    def resolvable(self, v: ir.Value) -> bool:
        """Whether `value(v)` finds a counterpart, without copying anything."""
        producer = v.producer()
        if id(v) in self.copied or (v.const_value is not None and producer is None):
            return True
        if is_glue(producer):
            return all(i is None or self.resolvable(i) for i in producer.inputs)
        return v.name in self.float_values

    def node(self, node: ir.Node, wanted: ir.Value | None = None, inputs: list | None = None,
             shared: bool = False) -> ir.Value | None:
        """Copy `node` with its inputs mapped (or `inputs`); return the copy of `wanted`
        (default: its first output). `shared`: the copy stands for `node` wherever it is
        read (glue fed from float tensors); a layer's own copy and its output Q/DQ are not
        shared: the next layer reads the float tensor instead."""
        if inputs is None:
            if not all(v is None or self.resolvable(v) for v in node.inputs):
                return None  # before copying any of its constants: an unread copy is an initializer
                # onnxruntime drops, and then fails to find when it is handed over as an array
            inputs = [None if v is None else self.value(v) for v in node.inputs]
            if any(v is None for v, orig in zip(inputs, node.inputs) if orig is not None):
                return None
        outputs = [ir.Value(name=self.unique(o.name or f"{node.name}_{i}"), type=o.type, shape=o.shape)
                   for i, o in enumerate(node.outputs)]
        copy = ir.Node(node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
                       outputs=outputs, name=self.unique(node.name), version=node.version)
        self.graph.append(copy)
        if node.domain not in ("", "ai.onnx"):  # an extended Q/DQ op: its domain imported too
            self.graph.opset_imports.setdefault(node.domain, node.version or 1)
        if shared:
            self.copied.update({id(o): c for o, c in zip(node.outputs, outputs)})
        return outputs[node.outputs.index(wanted or node.outputs[0])]

    def requantized(self, out: ir.Value, quant_out: ir.Value) -> ir.Value | None:
        """`out` (a copied layer output) through the Q/DQ the quantized model applies to it
        (with a float8 centring's Sub before and Add after, when it has them)."""
        first = next((u.node for u in quant_out.uses() if u.node.op_type == "QuantizeLinear"
                      or (u.node.op_type == "Sub" and is_glue(u.node)) or is_extended(u.node, 0)), None)
        if first is None:
            return out
        if is_extended(first):  # Q and DQ in one node
            params = [self.value(v) if v is not None else None for v in first.inputs[1:]]
            return None if any(p is None for p in params) else self.node(first, inputs=[out, *params])
        centre = first if first.op_type == "Sub" else None
        if centre is not None:
            out = self.node(centre, inputs=[out, self.value(centre.inputs[1])])
            first = next(u.node for u in centre.outputs[0].uses() if u.node.op_type == "QuantizeLinear")
        q, dq = first, dequantizer(first)
        params = [self.value(v) if v is not None else None for v in q.inputs[1:]]
        if dq is None or any(p is None for p, v in zip(params, q.inputs[1:]) if v is not None):
            return None
        q_copy = self.node(q, inputs=[out, *params])
        dq_params = [self.value(v) if v is not None else None for v in dq.inputs[1:]]
        result = self.node(dq, inputs=[q_copy, *dq_params])
        restore = next((u.node for u in dq.outputs[0].uses() if u.node.op_type == "Add" and is_glue(u.node)), None)
        if restore is not None:
            result = self.node(restore, inputs=[result, self.value(restore.inputs[1])])
        return result


def add_isolated_layers(
    float_model: ir.Model, quant_model: ir.Model, found: list[Layer]
) -> tuple[list[IsolatedLayer], list[str]]:
    """Add to `float_model` (in place) an isolated copy of each layer of `found`; return
    the copies and the names of the layers that could not be isolated (their inputs or
    output have no float counterpart)."""
    copier = _Copier(float_model)
    nodes = {node.name: node for node in quant_model.graph}
    isolated, skipped = [], []
    for layer in found:
        node = nodes[layer.name]
        reference = next((n for n in (layer.output, layer.quantized_output)
                          if n is not None and n in copier.float_values), None)
        out = copier.node(node) if reference is not None else None
        add = bias_add(node)
        if out is not None and add is not None:  # the layer's bias, moved into an Add
            out = copier.node(add, inputs=[out if v is node.outputs[0] else copier.value(v) for v in add.inputs])
        if out is not None:
            out = copier.requantized(out, (add or node).outputs[0])
        if out is None:
            skipped.append(layer.name)
            continue
        isolated.append(IsolatedLayer(layer, out.name, reference))
    return isolated, skipped


def with_only(float_model: ir.Model, quant_model: ir.Model, layer: Layer) -> ir.Model | None:
    """A copy of `float_model` in which `layer` alone is quantized: its isolated copy
    (`add_isolated_layers`) feeds every reader of its float output, graph outputs included,
    so the rest of the network runs in float on its error (`impact.py`); None where the
    layer cannot be isolated."""
    model = float_model.clone()
    isolated, _ = add_isolated_layers(model, quant_model, [layer])
    if not isolated:
        return None
    values = values_by_name(model.graph)
    values[isolated[0].reference].replace_all_uses_with(values[isolated[0].output], replace_graph_outputs=True)
    model.graph.sort()  # the copy was appended after the nodes that now read it
    return model
