"""Run the float and the quantized model side by side, one segment at a time.

Both graphs go into one combined graph (the float copy's names prefixed, the graph
inputs shared). `Replay.inputs(targets)` runs only the nodes that the targets need and
that have not run yet, from the tensors kept from earlier segments (the frontier), and
yields the targets batch by batch. After a segment the frontier keeps exactly the
tensors that nodes still to run consume, per calibration batch: in memory while it fits
`budget` bytes, else in .npy files in a temporary folder. Every node thus runs once per
sample, and a weight changed after its layer's inputs were taken (`set_initializer`) is
what every later segment computes with.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper

from onnxq.calibrate.session import (
    add_arrays,
    check_providers,
    injected,
    read_files_in,
    run_on_data,
    session_options,
    stand_in,
)
from onnxq.errors import OnnxqError
from onnxq.graph.external_data import drop_pages

FLOAT_PREFIX = "onnxq_float::"
# A layer replayed with float weights between a DequantizeLinear and a QuantizeLinear is
# what onnxruntime's WeightBiasQuantization rewrites (level 1, so the basic level too): it
# quantized the weight to int8 per tensor, so the replay computed with other weights than
# the ones set (MobileNet-v1 W4A8: layer inputs off by 11 codes on average). Off here.
REPLAY_DISABLED = ["WeightBiasQuantization"]


class ReplayError(OnnxqError):
    """The model has something the replay cannot carry between segments."""


def _subgraph_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(_node_inputs(node))
        defined.update(node.output)
    return used - defined


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    names = {n for n in node.input if n}
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            names |= _subgraph_refs(g)
    return names


def _rename_graph(graph: onnx.GraphProto, rename: Mapping[str, str]) -> None:
    """Rename, in place, every reference to a name of `rename` (subgraphs included)."""
    for node in graph.node:
        node.input[:] = [rename.get(n, n) for n in node.input]
        node.output[:] = [rename.get(n, n) for n in node.output]
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                _rename_graph(g, rename)
    for t in graph.initializer:
        t.name = rename.get(t.name, t.name)
    for v in [*graph.value_info, *graph.output]:
        v.name = rename.get(v.name, v.name)


def prefixed(graph: onnx.GraphProto, prefix: str) -> onnx.GraphProto:
    """A copy of `graph` with every name but its inputs' prefixed."""
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    inputs = {v.name for v in graph.input}
    names = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output if o}
    rename = {n: prefix + n for n in names - inputs}
    _rename_graph(copy, rename)
    for node in copy.node:
        node.name = prefix + node.name
    return copy


class BatchStore:
    """Per-batch tensors, in memory until they pass `budget` bytes, then on disk."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.memory: dict[int, dict[str, np.ndarray]] = {}
        self.folder: Path | None = None
        self.on_disk: dict[int, list[str]] = {}

    def __len__(self) -> int:
        return len(self.memory) + len(self.on_disk)

    def _bytes(self) -> int:
        return sum(a.nbytes for batch in self.memory.values() for a in batch.values())

    def put(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        self.memory.pop(index, None)
        if self.folder is None and self._bytes() + sum(a.nbytes for a in arrays.values()) <= self.budget:
            self.memory[index] = arrays
            return
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="onnxq-layerwise-"))
            for i, batch in list(self.memory.items()):
                self._write(i, batch)
            self.memory.clear()
        self._write(index, arrays)

    def _write(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        names = list(arrays)
        for j, name in enumerate(names):
            np.save(self.folder / f"{index}_{j}.npy", arrays[name])
        self.on_disk[index] = names

    def get(self, index: int) -> dict[str, np.ndarray]:
        if index in self.memory:
            return self.memory[index]
        return {name: np.load(self.folder / f"{index}_{j}.npy") for j, name in enumerate(self.on_disk[index])}

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.memory.clear()


class Replay:
    """The combined float + quantized graph and the per-batch frontier (module doc)."""

    def __init__(self, float_model: onnx.ModelProto | None, quant_model: onnx.ModelProto,
                 batches: Iterable[Mapping[str, np.ndarray]], providers: list[str], budget: int,
                 weights: Mapping[str, ir.Value] | None = None, folder: str | None = None) -> None:
        """`float_model` None: replay `quant_model` alone (its weights changed as layers
        are processed: GPTQ's true-sequential inputs). `weights`: initializers not in the
        protos, serialized only while a segment that reads them is built (a big model's
        weights are then never copied whole). `folder`: where the protos' external data
        references are relative to (`calibrate.session.external_folder`; they had been
        resolved against the working directory, and AdaRound failed from another one)."""
        self.folder = folder
        fgraph = prefixed(float_model.graph, FLOAT_PREFIX) if float_model is not None else onnx.GraphProto()
        self.float_inputs = {v.name for v in float_model.graph.input} if float_model is not None else set()
        qgraph = quant_model.graph
        both = [quant_model] if float_model is None else [float_model, quant_model]
        self.opsets = {o.domain: o.version for m in both for o in m.opset_import}
        self.ir_version = max(m.ir_version for m in both)
        self.providers = check_providers(providers)
        self.nodes = list(qgraph.node) + list(fgraph.node)
        self.initializers: dict[str, onnx.TensorProto | ir.Value] = dict(weights or {})
        self.initializers.update({t.name: t for t in [*qgraph.initializer, *fgraph.initializer]})
        self.node_inputs = [_node_inputs(n) for n in self.nodes]
        self.producer = {o: i for i, n in enumerate(self.nodes) for o in n.output if o}
        self.consumers: dict[str, list[int]] = {}
        for i, names in enumerate(self.node_inputs):
            for name in names:
                self.consumers.setdefault(name, []).append(i)
        self.computed: set[int] = set()
        self.store = BatchStore(budget)
        self.frontier: set[str] = set()
        self.samples = 0
        for i, feed in enumerate(batches):
            arrays = {k: np.asarray(v) for k, v in feed.items()}
            self.store.put(i, arrays)
            self.frontier.update(arrays)
            self.samples += len(next(iter(arrays.values()))) if arrays else 0

    def float_name(self, name: str) -> str:
        """The float copy's name of tensor `name` of the float model."""
        return name if name in self.float_inputs else FLOAT_PREFIX + name

    def set_initializer(self, name: str, array: np.ndarray) -> None:
        """Give initializer `name` (new or existing) the value `array`."""
        self.initializers[name] = numpy_helper.from_array(np.ascontiguousarray(array), name)

    def set_input(self, node_name: str, index: int, initializer: str) -> None:
        """Make input `index` of the quantized graph's node `node_name` read `initializer`."""
        i = next(i for i, n in enumerate(self.nodes) if n.name == node_name)
        node = self.nodes[i]
        while len(node.input) <= index:
            node.input.append("")
        old = node.input[index]
        node.input[index] = initializer
        self.node_inputs[i] = _node_inputs(node)
        if old and i in self.consumers.get(old, []):
            self.consumers[old].remove(i)
        self.consumers.setdefault(initializer, []).append(i)

    def _needed(self, targets: list[str]) -> list[int]:
        needed: set[int] = set()
        stack = list(targets)
        while stack:
            name = stack.pop()
            if name in self.frontier or name in self.initializers or name not in self.producer:
                continue
            i = self.producer[name]
            if i in self.computed or i in needed:
                continue
            needed.add(i)
            stack.extend(self.node_inputs[i])
        return sorted(needed)

    def _segment(self, needed: list[int], outputs: list[str], inputs: list[str],
                 example: Mapping[str, np.ndarray]) -> ort.InferenceSession:
        """A session over the `needed` nodes. The model's own big weights (`weights` of
        the constructor) reach it as arrays, not serialized (`calibrate.session`); one
        still in its external data file, read for this, leaves memory again."""
        used = {n for i in needed for n in self.node_inputs[i]}
        names = [n for n in sorted(used) if n in self.initializers and n not in inputs]
        arrays = {n: t.const_value for n in names if isinstance(t := self.initializers[n], ir.Value)
                  and injected(t.const_value)}
        graph = helper.make_graph(
            [self.nodes[i] for i in needed], "onnxq_layerwise_segment",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(example[n].dtype), None)
             for n in inputs],
            [helper.make_empty_tensor_value_info(n) for n in outputs],
            [self._tensor(n) for n in names],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in self.opsets.items()],
                                  ir_version=self.ir_version)
        options = session_options()
        # Between runs the caller works in numpy on every core (GPTQ's and AWQ's Hessians
        # and rounding); onnxruntime's threads spinning for their next task took the cores
        # from it: SmolLM2 GPTQ's Hessian products 18.0 s with spinning, 12.8 s without.
        # AdaRound's replay (W4A8 on MobileNet-v1 and ResNet-20) took the same time either way.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        read_files_in(options, self.folder)
        values = add_arrays(options, arrays)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=self.providers,
                                       disabled_optimizers=REPLAY_DISABLED)
        session._onnxq_weights = values
        for tensor in arrays.values():
            drop_pages(tensor)  # onnxruntime holds its own copy
        return session

    def _tensor(self, name: str) -> onnx.TensorProto:
        """Initializer `name` for a segment: a model weight as its `stand_in` (a stub for
        one taken as an array, the data of a small one left in its external file)."""
        tensor = self.initializers[name]
        if isinstance(tensor, ir.Value):
            proto = ir.serde.serialize_tensor(stand_in(tensor.const_value) or tensor.const_value)
            proto.name = name
            return proto
        return tensor

    def _release(self, done: set[int]) -> None:
        """Forget initializers that only nodes already run read (nodes run once)."""
        for name in [n for n in self.initializers if n in self.consumers]:
            if all(c in done for c in self.consumers[name]):
                del self.initializers[name]

    def inputs(self, targets: list[str]) -> Iterator[dict[str, np.ndarray]]:
        """Run the segment that computes `targets`; yield {target: value} per batch."""
        needed = self._needed(targets)
        produced = {o for i in needed for o in self.nodes[i].output if o}
        done = self.computed | set(needed)
        keep = {n for n in self.frontier | produced
                if any(c not in done for c in self.consumers.get(n, []))} | set(targets)
        inputs = sorted({n for i in needed for n in self.node_inputs[i]} & self.frontier - produced)
        outputs = sorted((keep & produced) | (set(targets) & produced))
        session = None
        for b in range(len(self.store)):
            kept = self.store.get(b)
            got: dict[str, np.ndarray] = {}
            if needed:
                if session is None:
                    session = self._segment(needed, outputs, inputs, kept)
                # onnxruntime's refusal of the data: one line naming the batch (`run_on_data`)
                values = run_on_data(session, outputs, {n: kept[n] for n in inputs})
                for name, value in zip(outputs, values):
                    if not isinstance(value, np.ndarray):
                        raise ReplayError(f"tensor {name!r} is not a tensor ({type(value).__name__})")
                    got[name] = value
            merged = {n: v for n, v in kept.items() if n in keep}
            merged.update({n: v for n, v in got.items() if n in keep})
            self.store.put(b, merged)
            yield {t: merged[t] for t in targets}
        self.computed = done
        self.frontier = keep
        self._release(done)

    def close(self) -> None:
        self.store.close()
