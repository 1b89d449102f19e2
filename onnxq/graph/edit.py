"""Small graph-editing helpers shared by the optimise and emit stages."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxq.graph.external_data import release


def make_initializer(name: str, array: np.ndarray) -> ir.Value:
    """An initializer value holding `array` (0-d arrays stay 0-d)."""
    value = ir.Value(name=name, const_value=ir.Tensor(np.array(array, order="C"), name=name))
    value.shape = ir.Shape(np.shape(array))
    value.dtype = value.const_value.dtype
    return value


def values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """The graph's inputs and every node output, by name (the tensors a session can expose)."""
    values = {v.name: v for v in graph.inputs}
    values.update({o.name: o for node in graph for o in node.outputs if o.name})
    return values


class GraphEditor:
    """Creates uniquely named initializers and nodes in one graph."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.taken: set[str] = {v.name for v in graph.inputs} | set(graph.initializers)
        for node in graph:
            self.taken.add(node.name)
            self.taken.update(o.name for o in node.outputs if o.name)

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def initializer(self, base: str, array: np.ndarray) -> ir.Value:
        value = make_initializer(self.unique(base), array)
        self.graph.register_initializer(value)
        return value

    def add_node(
        self,
        op_type: str,
        inputs: list[ir.Value],
        output_name: str,
        attributes: dict | None = None,
        dtype: ir.DataType | None = None,
        shape: ir.Shape | None = None,
        domain: str = "",
    ) -> ir.Value:
        """Append a node with one output named `output_name` (made unique); return the output."""
        out = ir.Value(name=self.unique(output_name))
        out.dtype, out.shape = dtype, shape
        node = ir.node(
            op_type, inputs, attributes or {}, domain=domain, outputs=[out],
            name=self.unique(f"{out.name}_{op_type}"),
        )
        self.graph.append(node)
        return out


def set_constant(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, base: str) -> None:
    """Make input `index` of `node` the constant `array`.

    An initializer used only by this node is rewritten in place (its name is kept);
    otherwise a new, uniquely named initializer is created and the old one left to others.
    """
    current = node.inputs[index] if index < len(node.inputs) else None
    if current is not None and current.const_value is not None and len(current.uses()) == 1:
        current.const_value = ir.Tensor(np.array(array, order="C"), name=current.name)
        current.shape = ir.Shape(np.shape(array))
        return
    editor = GraphEditor(graph)
    value = editor.initializer(base, array)
    if index >= len(node.inputs):
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)
    if current is not None and current.const_value is not None and not current.uses():
        graph.initializers.pop(current.name, None)


def drop_unused_initializers(graph: ir.Graph) -> int:
    """Remove initializers no node reads (the bounds of an absorbed Clip, say), which
    onnxruntime would otherwise warn about on every load; how many went."""
    unused = [name for name, value in graph.initializers.items()
              if not value.uses() and not value.is_graph_output() and not value.is_graph_input()]
    for name in unused:
        graph.initializers.pop(name)
    return len(unused)


def drop_unread(graph: ir.Graph, table: ir.Value) -> None:
    """Remove a weight nothing reads any more: its initializer (its memory released:
    `external_data.release`), or the Transpose that made it and the initializer that one
    read."""
    if table.uses() or table.is_graph_output():
        return
    transpose = table.producer()
    if transpose is None:
        graph.initializers.pop(table.name, None)
        release(table.const_value)
        return
    source = transpose.inputs[0]
    graph.remove(transpose, safe=True)
    drop_unread(graph, source)
