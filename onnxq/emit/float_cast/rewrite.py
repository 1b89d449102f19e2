"""Apply a cast plan to a graph: retype converted nodes, store weights in the target type,
one shared Cast per (tensor, type) at every boundary, fold lossless Cast chains."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.emit.float_cast.eligibility import CastPlan
from onnxq.emit.float_cast.types import FLOATS, cast_array, fits, typed_attributes
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array

_SUFFIX = {ir.DataType.FLOAT: "f32", ir.DataType.FLOAT16: "f16", ir.DataType.BFLOAT16: "bf16"}
# Casts from the first type to the second lose nothing.
_WIDENING = {
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}
# Weights of float32-computing nodes are stored in the target type (with a Cast back) from
# this many elements on; smaller constants would save fewer bytes than the Cast costs.
STORAGE_MIN_ELEMENTS = 16


class Rewriter:
    """Applies a plan to one graph in place."""

    def __init__(self, model: ir.Model, plan: CastPlan, tensors: dict[tuple[str, ir.DataType], ir.Tensor]) -> None:
        self.graph = model.graph
        self.nodes = list(self.graph)
        self.index = {id(node): i for i, node in enumerate(self.nodes)}
        self.plan = plan
        self.tensors = tensors  # converted initializer tensors, shared between rewrites
        self.edit = GraphEditor(self.graph)
        self.original: dict[int, ir.DataType | None] = {}  # id(value) -> dtype before
        self.inserted: list[ir.Node] = []
        self.converted_weights: dict[str, tuple[ir.DataType, int]] = {}
        self.storage_nodes: set[int] = set()  # storage-plan nodes that got a converted weight
        self.last_after: dict[int, ir.Node] = {}

    def run(self) -> None:
        for i, (target, slots) in self.plan.compute.items():
            node = self.nodes[i]
            for j in slots.outputs:
                self._retype(node.outputs[j], target)
            for attr in typed_attributes(node, target) if slots.outputs else []:
                node.attributes[attr.name] = attr
        self._convert_initializers()
        values = list(self.graph.inputs) + list(self.graph.initializers.values())
        values += [v for node in self.nodes for v in node.outputs]
        for value in values:
            self._bridge(value)
        _fold_cast_pairs(self.graph, self.inserted)

    def _retype(self, value: ir.Value, dtype: ir.DataType) -> None:
        self.original.setdefault(id(value), value.dtype)
        value.type = ir.TensorType(dtype)  # a new object: clones share their type objects

    def _node_index(self, node: ir.Node) -> int:
        """Position of `node` in the graph before the rewrite; -1 for other nodes."""
        return self.index.get(id(node), -1) if node.graph is self.graph else -1

    def _wanted(self, node: ir.Node, index: int, original: ir.DataType | None) -> ir.DataType | None:
        """The type input `index` of `node` needs."""
        entry = self.plan.compute.get(self._node_index(node))
        return entry[0] if entry is not None and index in entry[1].inputs else original

    def _storage_target(self, value: ir.Value, size: int) -> ir.DataType | None:
        """The one type every use of this float32 weight can take it in, else None."""
        targets, cast_back = set(), False
        for node, k in value.uses():
            i = self._node_index(node)
            entry = self.plan.compute.get(i) or self.plan.storage.get(i)
            if entry is None or k not in entry[1].inputs:
                return None
            targets.add(entry[0])
            cast_back |= i not in self.plan.compute
        if len(targets) != 1 or (cast_back and size < STORAGE_MIN_ELEMENTS):
            return None
        return targets.pop()

    def _convert_initializers(self) -> None:
        for name, value in list(self.graph.initializers.items()):
            if value.dtype != ir.DataType.FLOAT or value.is_graph_input() or value.is_graph_output():
                continue
            array = constant_array(value)
            target = self._storage_target(value, array.size) if array is not None else None
            if target is None or not fits(array, target):
                continue
            key = (name, target)
            if key not in self.tensors:
                self.tensors[key] = ir.Tensor(cast_array(array, target), name=name)
            value.const_value = self.tensors[key]
            self.storage_nodes.update(i for i in map(self._node_index, value.consumers()) if i in self.plan.storage)
            self._retype(value, target)
            self.converted_weights[name] = (target, array.nbytes - self.tensors[key].nbytes)

    def _bridge(self, value: ir.Value) -> None:
        """Give every use of `value` the type it needs, one shared Cast per type."""
        stored, original = value.dtype, self.original.get(id(value), value.dtype)
        if stored not in FLOATS and original not in FLOATS:
            return
        groups: dict[ir.DataType, list[tuple[ir.Node, int]]] = {}
        for node, k in value.uses():
            wanted = self._wanted(node, k, original)
            if wanted is not None and wanted != stored:
                groups.setdefault(wanted, []).append((node, k))
        is_output = value.is_graph_output() and stored != original
        if is_output:
            groups.setdefault(original, [])
        for wanted, uses in groups.items():
            rename = is_output and wanted == original
            cast_out = self._cast(value, wanted, rename)
            for node, k in uses:
                node.replace_input_with(k, cast_out)

    def _cast(self, value: ir.Value, dtype: ir.DataType, as_graph_output: bool) -> ir.Value:
        """Insert Cast(value -> dtype); as a graph output it takes over the value's name."""
        if as_graph_output:
            name = value.name
            value.name = self.edit.unique(f"{name}_{_SUFFIX.get(value.dtype, 'cast')}")
        else:
            name = self.edit.unique(f"{value.name}_{_SUFFIX.get(dtype, 'cast')}")
        out = ir.Value(name=name, shape=value.shape.copy() if value.shape is not None else None)
        out.type = ir.TensorType(dtype)
        cast = ir.node("Cast", [value], {"to": int(dtype)}, outputs=[out], name=self.edit.unique(f"{name}_Cast"))
        producer = value.producer()
        if producer is not None and producer.graph is self.graph:
            self.graph.insert_after(self.last_after.get(id(producer), producer), cast)
            self.last_after[id(producer)] = cast
        else:
            self.graph.insert_before(self.nodes[0], cast)
        if as_graph_output:
            for i, output in enumerate(self.graph.outputs):
                if output is value:
                    self.graph.outputs[i] = out
        self.inserted.append(cast)
        return out


def _fold_cast_pairs(graph: ir.Graph, inserted: list[ir.Node]) -> None:
    """Fold Cast(a->b) -> Cast(b->c) chains that involve an inserted Cast and lose nothing.

    The insertion never chains two of its own Casts, but it can meet a Cast of the model
    (x_f16 -> Cast(f32) -> inserted Cast(f16)). When the first cast widens (a -> b exact),
    the second reads the source directly and disappears when a == c; the first goes when
    nothing else reads it.
    """
    ours = {id(node) for node in inserted}
    for node in list(graph):
        if node.op_type != "Cast" or node.graph is not graph:
            continue
        middle = node.inputs[0]
        first = middle.producer()
        if first is None or first.op_type != "Cast" or first.graph is not graph:
            continue
        a, b, c = first.inputs[0].dtype, middle.dtype, node.outputs[0].dtype
        lossless = a == b or (a, b) in _WIDENING
        if not (lossless and {a, b, c} <= FLOATS and (id(first) in ours or id(node) in ours)):
            continue
        source, out = first.inputs[0], node.outputs[0]
        if a == c and not out.is_graph_output():
            out.replace_all_uses_with(source)
            _remove(graph, node, inserted)
        else:
            node.replace_input_with(0, source)
        if not middle.uses() and not middle.is_graph_output():
            _remove(graph, first, inserted)


def _remove(graph: ir.Graph, node: ir.Node, inserted: list[ir.Node]) -> None:
    graph.remove(node, safe=True)
    if node in inserted:
        inserted.remove(node)
