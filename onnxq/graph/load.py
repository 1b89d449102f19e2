"""Stage 1, load: read a model, check it, and normalise it for quantization.

Reading never loads external data into memory: onnx-ir keeps external tensors
memory-mapped, so models above 2 GB load like any other. Normalising upgrades old opsets,
folds constant weight producers into initializers and infers shapes. Sequence and
optional values keep their types; training graphs and map-typed graph inputs or outputs
(which onnx-ir cannot represent) are refused with a one-line error.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
from google.protobuf.message import DecodeError, Message

from onnxq.errors import ModelError, UnsupportedModelError
from onnxq.graph.edit import GraphEditor, set_constant
from onnxq.graph.fold import fold_constants
from onnxq.graph.wire import WireError, read_split

# Per-channel QuantizeLinear/DequantizeLinear (the `axis` attribute) needs opset 13.
MIN_OPSET = 13
IR_FOR_OPSET = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}
TRAINING_DOMAIN = "ai.onnx.preview.training"
# Up to opset 6, PRelu's 1-D slope was per channel; from opset 7 it broadcasts from the right.
PRELU_BROADCAST_OPSET = 7
# Shape inference gets initializers above this many bytes as typed inputs without data.
INFERENCE_INLINE_BYTES = 1024


@dataclass
class LoadReport:
    """What loading changed, for the summary."""

    source: str
    original_opset: int
    opset: int
    folded_nodes: int = 0
    initializer_inputs_removed: int = 0
    notes: list[str] = field(default_factory=list)


def _read_proto(source: str | os.PathLike | onnx.ModelProto, split: bool = False,
                ) -> tuple[onnx.ModelProto, str, str, dict[str, np.ndarray]]:
    """The model proto (external data not loaded), its base directory, a display name and,
    with `split` for a file past `SPILL_LIMIT`, its raw weights as memory maps of the file
    (left out of the proto, `graph.wire`)."""
    if isinstance(source, onnx.ModelProto):
        return source, "", "<ModelProto>", {}
    path = Path(source)
    if not path.exists():
        raise ModelError(f"model file not found: {path}; check the path")
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not an .onnx file; pass the model file itself")
    if split and path.is_file() and path.stat().st_size > SPILL_LIMIT:
        try:
            proto, weights = read_split(path)
            return proto, str(path.parent), str(path), weights
        except (WireError, OSError):
            pass  # read as usual; a broken file gets the usual error below
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}); "
            "check that the file is a complete .onnx export, not truncated or another format"
        ) from None
    return proto, str(path.parent), str(path), {}


def _copy_fields(source: Message, target: Message, skip: str) -> None:
    """Copy every set field of message `source` into `target` but `skip`."""
    for descriptor, value in source.ListFields():
        name = descriptor.name
        if name == skip:
            continue
        if hasattr(value, "extend"):  # repeated
            getattr(target, name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(target, name).CopyFrom(value)
        else:
            setattr(target, name, value)


def _without_weight_data(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `proto` whose main-graph initializers are empty stubs of the same name and
    type: what onnx.checker needs to check the graph, at a fraction of the copy (the
    checker copies the whole model it is given; for an LLM that doubled peak memory)."""
    stub = onnx.ModelProto()
    _copy_fields(proto, stub, skip="graph")
    _copy_fields(proto.graph, stub.graph, skip="initializer")
    for tensor in proto.graph.initializer:
        stub.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=[0], raw_data=b"")
    return stub


def _check_weight_sizes(proto: onnx.ModelProto, mapped: set[str] = frozenset()) -> None:
    """Each raw initializer holds exactly the bytes its shape and type need (what the
    checker would have said about the data the stub left out; `mapped` weights were
    sized when they were mapped)."""
    for tensor in proto.graph.initializer:
        if (not tensor.HasField("raw_data") or tensor.data_location == onnx.TensorProto.EXTERNAL
                or tensor.name in mapped):
            continue
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, ValueError, TypeError):
            continue
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(tensor.data_type)
        need = (count * bits + 7) // 8 if bits else count * itemsize
        if len(tensor.raw_data) != need and tensor.data_type != onnx.TensorProto.STRING:
            raise ModelError(f"model fails onnx.checker: initializer {tensor.name!r} holds {len(tensor.raw_data)} "
                             f"bytes for shape {list(tensor.dims)} (needs {need}); fix or re-export the model")


def _check(proto: onnx.ModelProto, path: str | None, mapped: set[str] = frozenset()) -> None:
    """Run onnx.checker: by path when the model has external data (the checker then
    checks the files), else on a copy without weight data plus a size check of each
    weight (a full copy for the checker doubled peak memory on big models)."""
    if not proto.HasField("graph") or not proto.opset_import:
        name = path or "the model"
        raise ModelError(f"{name} is not an ONNX model (no graph or opset); pass a .onnx model file")
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    try:
        if path is not None and external:
            onnx.checker.check_model(path)
        else:
            _check_weight_sizes(proto, mapped)
            onnx.checker.check_model(_without_weight_data(proto))
    except (onnx.checker.ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model fails onnx.checker: {first}; fix or re-export the model") from None


def _subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every graph nested in its nodes' attributes (If, Loop, Scan bodies)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _subgraphs(sub)


def _refuse_training(proto: onnx.ModelProto, name: str) -> None:
    """Training graphs (gradient, optimizer nodes) have no inference meaning to quantize."""
    nodes = [n for g in _subgraphs(proto.graph) for n in g.node]
    nodes += [n for f in proto.functions for n in f.node]
    for node in nodes:
        if node.domain == TRAINING_DOMAIN:
            raise UnsupportedModelError(
                f"{name} is a training graph: node {node.name or node.op_type!r} ({node.op_type}) is in the "
                f"training-only domain {TRAINING_DOMAIN}; export the inference graph (model in eval mode, "
                "without gradient or optimizer nodes) and quantize that"
            )


# The op domains of onnxruntime's own kernels, for builds whose registry cannot be listed
# safely (the CPU build's registry has the first five; GPU builds add the NHWC domain).
ORT_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc",
                         "com.ms.internal.nhwc"})
# Providers built into onnxruntime's own library; the others are shared libraries.
BUILT_IN_PROVIDERS = frozenset({"CPUExecutionProvider", "AzureExecutionProvider"})


@functools.cache
def _kernel_domains() -> frozenset[str]:
    """The op domains this onnxruntime build has kernels for.

    Read from the kernel registry only where every provider is built in: listing it loads
    each provider's shared library, and onnxruntime-gpu 1.31 crashes the process there
    (a segmentation fault, not an exception) when one of them, such as TensorRT's, cannot
    load. Elsewhere onnxruntime's own domains."""
    import onnxruntime as ort

    if not set(ort.get_available_providers()) <= BUILT_IN_PROVIDERS:
        return ORT_DOMAINS
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    return frozenset({"ai.onnx"} | {k.domain for k in C.get_all_opkernel_def()})


def check_runnable(model: ir.Model, name: str) -> None:
    """Refuse a model with ops of a domain onnxruntime has no kernels for (a custom-op
    library's): calibration and the output's load check run it in onnxruntime."""
    local = {f.domain for f in model.functions.values()}
    known = _kernel_domains() | local
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in known:
            raise UnsupportedModelError(
                f"{name}: node {node.name!r} is {node.domain}::{node.op_type}, a custom op onnxruntime has no "
                f"kernel for (domain {node.domain!r}); onnxq runs the model in onnxruntime to calibrate and "
                "check it: export it with standard ONNX ops"
            )


def _has_map(type_proto: onnx.TypeProto) -> bool:
    """Whether a type is or contains a map (onnx-ir has no map type)."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind in ("sequence_type", "optional_type"):
        return _has_map(getattr(type_proto, kind).elem_type)
    return False


def _drop_map_types(proto: onnx.ModelProto, name: str) -> None:
    """Refuse map-typed graph inputs and outputs; forget map-typed intermediate annotations.

    onnx-ir cannot hold map types, so a boundary map (ZipMap's seq(map) output, a
    DictVectorizer input) cannot survive; an inner one is left for shape inference.
    """
    graph = proto.graph
    boundary = [("input", v) for v in graph.input] + [("output", v) for v in graph.output]
    for kind, value in boundary:
        if _has_map(value.type):
            raise UnsupportedModelError(
                f"{name}: graph {kind} {value.name!r} has a map type, which onnxq cannot represent; "
                "export the model without it (skl2onnx: zipmap=False) or cut the graph before that value"
            )
    for g in _subgraphs(graph):
        keep = [v for v in g.value_info if not _has_map(v.type)]
        if len(keep) != len(g.value_info):
            del g.value_info[:]
            g.value_info.extend(keep)


def default_opset(proto: onnx.ModelProto) -> int:
    """Version of the default ('' / ai.onnx) opset the model imports."""
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise ModelError("model imports no default ONNX opset; re-export it with a standard opset")


def _upgrade_opset(proto: onnx.ModelProto, opset: int, target: int) -> onnx.ModelProto:
    """Convert to `target` when older; refuse opsets newer than the installed onnx knows."""
    latest = onnx.defs.onnx_opset_version()
    if opset > latest:
        raise ModelError(
            f"model uses opset {opset} but the installed onnx supports up to {latest}; "
            "upgrade the onnx package or export with a lower opset"
        )
    if opset >= target:
        return proto
    try:
        upgraded = onnx.version_converter.convert_version(proto, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors of many kinds
        raise ModelError(
            f"cannot upgrade opset {opset} to {target} ({str(exc).splitlines()[0]}); "
            f"re-export the model with opset >= {target}"
        ) from None
    # The IR version that goes with the opset; initializers need not be inputs from IR 4 on.
    upgraded.ir_version = max(upgraded.ir_version, IR_FOR_OPSET.get(target, 10))
    return upgraded


def _remove_initializer_inputs(graph: ir.Graph) -> int:
    """Drop graph inputs that are initializers (old IR<4 style): weights are constants."""
    initializer_inputs = [v for v in graph.inputs if v.name in graph.initializers]
    for value in initializer_inputs:
        graph.inputs.remove(value)
    return len(initializer_inputs)


def _binary_sum_to_add(graph: ir.Graph) -> None:
    """Rewrite two-input Sum (old exporters' residual add) as Add, which has int8 kernels."""
    for node in list(graph):
        if node.op_type == "Sum" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
            add = ir.node("Add", list(node.inputs), name=node.name)
            ir.convenience.replace_nodes_and_values(
                graph, node, [node], [add], list(node.outputs), list(add.outputs)
            )


@contextlib.contextmanager
def _large_weights_as_inputs(graph: ir.Graph) -> Iterator[None]:
    """Temporarily make initializers above INFERENCE_INLINE_BYTES typed inputs without data.

    Serializing the graph then copies no large weight, so models above 2 GB can be
    inferred; small initializers keep their data for Reshape targets and the like.
    """
    large = [v for v in graph.initializers.values()
             if v.const_value is None or v.const_value.nbytes > INFERENCE_INLINE_BYTES]
    inputs = list(graph.inputs)
    for value in large:
        graph.initializers.pop(value.name)
        graph.inputs.append(value)
    try:
        yield
    finally:
        graph.inputs.clear()
        graph.inputs.extend(inputs)
        for value in large:
            graph.initializers.add(value)


def _inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Type of every named value that onnx shape inference annotated, subgraphs included."""
    types: dict[str, onnx.TypeProto] = {}
    for graph in _subgraphs(proto.graph):
        for value in [*graph.input, *graph.value_info, *graph.output]:
            if value.name and value.type.WhichOneof("value") is not None:
                types.setdefault(value.name, value.type)
    return types


def _merge_type(value: ir.Value, type_proto: onnx.TypeProto) -> None:
    """Set an inferred type and shape on `value`, whole: a sequence stays a sequence.

    onnx-ir's ShapeInferencePass copies only dtype and shape, which turns an untyped
    sequence or optional value into a tensor. Map types are left out (onnx-ir has none).
    """
    if _has_map(type_proto):
        return
    try:
        inferred = ir.serde.deserialize_type_proto_for_type(type_proto)
        shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
    except (ValueError, NotImplementedError):  # a sequence or optional of unknown element
        return
    if inferred is None:
        return
    if value.type != inferred:
        value.type = inferred
    if shape is not None and value.shape != shape:
        value.shape = shape


def infer_shapes(model: ir.Model) -> None:
    """Infer types and shapes with onnx (not strict, with data propagation), in place.

    Values the inference cannot type keep what they had; a model the inference rejects
    is left unchanged, as with onnx-ir's ShapeInferencePass.
    """
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                value.shape = value.shape or value.const_value.shape
                value.dtype = value.dtype or value.const_value.dtype
    with _large_weights_as_inputs(model.graph):
        proto = ir.serde.serialize_model(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=False, data_prop=True)
    except Exception:  # inference is best effort: onnx raises many kinds of errors
        return
    types = _inferred_types(inferred)
    for graph in model.graphs():
        for value in [*graph.inputs, *(o for node in graph for o in node.outputs)]:
            if value.name in types:
                _merge_type(value, types[value.name])


def _channel_slope_shape(node: ir.Node, original_opset: int) -> list[int] | None:
    """[C, 1, ...] for a 1-D PRelu slope meant per channel of X [N, C, ...], else None.

    A slope [C] is per channel below opset 7; from opset 7 it broadcasts against X's last
    axis, so it needs the trailing ones unless that axis happens to be C too.
    """
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    x, slope = node.inputs[0].shape, node.inputs[1].shape
    if x is None or slope is None or len(x) < 3 or len(slope) != 1:
        return None
    channels = x[1]
    if not isinstance(channels, int) or slope[0] != channels or channels == 1:
        return None
    if original_opset >= PRELU_BROADCAST_OPSET and x[-1] == channels:
        return None  # unidirectionally broadcastable, and right-aligned is the model's meaning
    return [channels] + [1] * (len(x) - 2)


def _reshape_slope(node: ir.Node, shape: list[int]) -> None:
    """Give `node`'s slope (input 1) `shape`: the constant rewritten, or a Reshape inserted."""
    slope = node.inputs[1]
    graph = node.graph
    if slope.const_value is not None and not slope.is_graph_input():
        set_constant(graph, node, 1, slope.const_value.numpy().reshape(shape), f"{slope.name}_per_channel")
        return
    editor = GraphEditor(graph)
    target = editor.initializer(f"{slope.name}_channel_shape", np.array(shape, dtype=np.int64))
    out = ir.Value(name=editor.unique(f"{slope.name}_per_channel"), type=slope.type, shape=ir.Shape(shape))
    reshape = ir.node("Reshape", [slope, target], outputs=[out], name=editor.unique(f"{out.name}_Reshape"))
    graph.insert_before(node, reshape)
    node.replace_input_with(1, out)


def fix_prelu_slopes(model: ir.Model, original_opset: int) -> int:
    """Make per-channel PRelu slopes of old models broadcast as opset 7+ requires; count them."""
    fixed = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "PRelu" or node.domain not in ("", "ai.onnx"):
            continue
        shape = _channel_slope_shape(node, original_opset)
        if shape is not None:
            _reshape_slope(node, shape)
            fixed += 1
    return fixed


# Up to this many bytes of external weights are read into memory at load. Bigger models
# keep them in their files, memory-mapped when read; sessions take them as arrays either
# way (`calibrate.session.open_session`), from any working directory.
INLINE_LIMIT = 1 << 30


def _inline_external(model: ir.Model) -> None:
    external = [v.const_value for v in model.graph.initializers.values()
                if isinstance(v.const_value, ir.ExternalTensor)]
    if external and sum(t.nbytes for t in external) <= INLINE_LIMIT:
        ir.external_data.load_to_model(model)


# Models whose embedded weights pass this many bytes keep them out of the parsed protobuf,
# which holds every weight until all of them die: a file's raw weights are memory maps of
# the file itself (`graph.wire`), an in-memory model's are moved into temporary mapped
# files (`_spill_embedded`). A weight replaced by its int4 form then leaves memory
# (SmolLM2 RTN: peak RSS 2.2x -> 1.4x the model file).
SPILL_LIMIT = 256 << 20
_SPILL_MIN_BYTES = 1 << 16  # smaller tensors are copied into memory instead


def _owned(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """A tensor that holds its own bytes (not a view into the parsed protobuf)."""
    if isinstance(tensor, ir.serde.TensorProtoTensor):
        return ir.Tensor(tensor.numpy().copy(), name=tensor.name)
    return tensor


def _spill_embedded(model: ir.Model) -> None:
    """Move the embedded weights of a big model out of the parsed protobuf (see
    `SPILL_LIMIT`): big ones into temporary files mapped read-only (each deleted with its
    tensor, or at exit), the rest, attribute tensors included, into owned arrays."""
    values = [v for g in (model.graph, *model.graph.subgraphs()) for v in g.initializers.values()]
    embedded = [v for v in values if isinstance(v.const_value, ir.serde.TensorProtoTensor)]
    if sum(v.const_value.nbytes for v in embedded) <= SPILL_LIMIT:
        return
    folder = Path(tempfile.mkdtemp(prefix="onnxq-weights-"))
    atexit.register(shutil.rmtree, folder, True)
    for i, value in enumerate(embedded):
        tensor = value.const_value
        if tensor.nbytes < _SPILL_MIN_BYTES or tensor.dtype.bitwidth < 8:
            value.const_value = _owned(tensor)
            continue
        path = folder / f"w{i}.bin"
        array = tensor.numpy()
        array.tofile(path)
        # A read-only memory map, wrapped like any array: serializing the model inlines it.
        mapped = np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)
        del array
        spilled = ir.Tensor(mapped, dtype=tensor.dtype, name=tensor.name)
        weakref.finalize(spilled, _remove, path)
        value.const_value = spilled
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.serde.TensorProtoTensor):
                node.attributes[attr.name] = ir.AttrTensor(attr.name, _owned(attr.value))


def drop_pages(tensor: object) -> None:
    """Let the pages of a weight mapped at load (`graph.wire`, `_spill_embedded`) leave the
    process's memory (they are read again from the file if anything reads it later): for
    weights a stage is done with that a copy of the model (a fallback's pristine clone)
    still references."""
    array = tensor.raw if isinstance(tensor, ir.Tensor) else None
    if not isinstance(array, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base = array.base
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    if isinstance(base, mmap.mmap):  # the model file (`graph.wire`) or a spilled file: this weight's pages
        origin = np.frombuffer(base, np.uint8, count=1).ctypes.data
        start = array.ctypes.data - origin
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, (start + array.nbytes) // page * page
        if last > first:
            with contextlib.suppress(OSError, ValueError):
                base.madvise(mmap.MADV_DONTNEED, first, last - first)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def check_readable(path: str | os.PathLike) -> None:
    """Raise `ModelError` unless `path` parses as an ONNX model with a graph (cheap: big
    files' weights stay in the file), for commands that hand the file to onnxruntime."""
    proto, _, name, _ = _read_proto(path, split=True)
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelError(f"{name} is not an ONNX model (no graph or opset); pass a .onnx model file")


def read_model(source: str | os.PathLike | onnx.ModelProto | ir.Model) -> ir.Model:
    """Read a model as it is (checked, not normalised): for looking at a model this tool
    or another one wrote, where normalising would change what is looked at."""
    if isinstance(source, ir.Model):
        return source
    proto, base_dir, name, _ = _read_proto(source)
    _check(proto, None if isinstance(source, onnx.ModelProto) else str(source))
    model = ir.serde.deserialize_model(proto)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
    return model


def load_model(
    source: str | os.PathLike | onnx.ModelProto | ir.Model, min_opset: int = MIN_OPSET
) -> tuple[ir.Model, LoadReport]:
    """Read, check and normalise a model; the caller's file or proto is never modified.

    Models below `min_opset` (at least 13) are upgraded. Returns the normalised onnx-ir
    model and a report of what changed.
    """
    min_opset = max(min_opset, MIN_OPSET)
    if isinstance(source, ir.Model):
        source = ir.to_proto(source)
    proto, base_dir, name, mapped = _read_proto(source, split=True)
    if mapped and default_opset(proto) < min_opset:  # the opset converter needs the weights
        proto, base_dir, name, mapped = _read_proto(source)
    _refuse_training(proto, name)
    _check(proto, None if isinstance(source, onnx.ModelProto) else str(source), set(mapped))
    original = default_opset(proto)
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto.FromString(proto.SerializeToString())  # never mutate the caller's
    _drop_map_types(proto, name)
    proto = _upgrade_opset(proto, original, min_opset)
    model = ir.serde.deserialize_model(proto)
    for name_, array in mapped.items():
        value = model.graph.initializers[name_]
        value.const_value = ir.Tensor(array, dtype=value.const_value.dtype, name=name_)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
        _inline_external(model)
    _spill_embedded(model)
    del proto
    report = LoadReport(source=name, original_opset=original, opset=max(original, min_opset))
    if original < min_opset:
        report.notes.append(f"upgraded opset {original} -> {min_opset}")
    report.initializer_inputs_removed = _remove_initializer_inputs(model.graph)
    ir_passes.NameFixPass()(model)  # every node and value gets a unique name
    ir_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    report.folded_nodes = fold_constants(model)
    _binary_sum_to_add(model.graph)
    ir_passes.RemoveUnusedNodesPass()(model)
    infer_shapes(model)
    if prelus := fix_prelu_slopes(model, original):
        report.notes.append(f"PRelu slopes [C] reshaped to [C,1,...] to broadcast per channel: {prelus}")
        infer_shapes(model)
    ir_passes.TopologicalSortPass()(model)
    return model, report
