"""Checks that refuse a model with a one-line error before anything runs it: onnx.checker
without copying the weights, training graphs, map-typed graph inputs and outputs (which
onnx-ir cannot represent), and ops of a domain onnxruntime has no kernels for."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from google.protobuf.message import Message
from onnxruntime.capi import onnxruntime_pybind11_state as C

from onnxq.errors import ModelError, UnsupportedModelError

TRAINING_DOMAIN = "ai.onnx.preview.training"


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


def check_proto(proto: onnx.ModelProto, path: str | None, mapped: set[str] = frozenset()) -> list[str]:
    """Run onnx.checker on a copy without weight data, plus a size check of each weight
    (a full copy for the checker doubled peak memory on big models) and of each external
    data file (`_check_external_data`: followed through links, as onnxruntime reads them).
    Ops of the default domain that onnx does not know but onnxruntime runs (its contrib
    ops registered there, such as SimplifiedLayerNormalization in genai models) are
    checked against onnxruntime's kernels instead; the returned notes say so."""
    if not proto.HasField("graph") or not proto.opset_import:
        name = path or "the model"
        raise ModelError(f"{name} is not an ONNX model (no graph or opset); pass a .onnx model file")
    if path is None:
        _check_unloaded_external(proto)
    stub = _without_weight_data(proto)
    notes = _onnxruntime_only_ops(stub)
    try:
        if path is not None:
            _check_external_data(proto, Path(path).parent)
        _check_weight_sizes(proto, mapped)
        onnx.checker.check_model(stub)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"model fails onnx.checker: {_one_line(exc)}; fix or re-export the model") from None
    return notes


# The longest checker message kept whole in the one-line error.
_CHECKER_CHARS = 300


def _one_line(exc: Exception) -> str:
    """onnx's message on one line: its lines joined (a node's name and op come on lines of
    their own), its '==> Context:' dump of the node left out, cut at `_CHECKER_CHARS`."""
    text = " ".join(str(exc).split("==> Context:")[0].split()) or type(exc).__name__
    return text if len(text) <= _CHECKER_CHARS else text[:_CHECKER_CHARS - 3].rstrip() + "..."


def _check_unloaded_external(proto: onnx.ModelProto) -> None:
    """A ModelProto in memory whose weights point at external data files it was loaded
    without (onnx.load(..., load_external_data=False)): the files are looked up from the
    working directory, and one that is not there is a one-line error, not a raw
    FileNotFoundError."""
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if not Path(location).is_file():
            raise ModelError(f"the ModelProto's weight {tensor.name!r} is in external data ({location}) it was loaded "
                             "without, and that file is not in the working directory; load the model with "
                             "onnx.load(path) (which reads its external data), or pass the model's path")


# The private domain the checker's copy moves onnxruntime-only ops to: the checker leaves
# ops of domains it has no schemas for to the runtime.
UNCHECKED_DOMAIN = "onnxq.onnxruntime_only"


def _onnxruntime_only_ops(stub: onnx.ModelProto) -> list[str]:
    """Move the default-domain nodes whose op onnx has no schema for, but onnxruntime has
    a kernel for, out of the checker's way (in the copy `stub`), and say which."""
    counts: dict[str, int] = {}
    for graph in subgraphs(stub.graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or onnx.defs.has(node.op_type):
                continue
            known = _onnxruntime_ops()  # only here: listing the kernels costs 4 ms a process
            if known is not None and node.op_type not in known:
                continue  # onnxruntime has no kernel either: the checker's error stands
            node.domain = UNCHECKED_DOMAIN
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    if not counts:
        return []
    stub.opset_import.add(domain=UNCHECKED_DOMAIN, version=1)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
    how = "its CPU kernels" if _onnxruntime_ops() is not None else "the sessions that calibrate and check it"
    return [f"onnx.checker does not know {ops} (default domain); onnxruntime runs them: checked by {how}"]


@functools.cache
def _onnxruntime_ops() -> frozenset[str] | None:
    """The default-domain ops onnxruntime's CPU provider has kernels for (None where the
    kernel registry cannot be listed safely, `_kernel_domains`)."""
    if not set(ort.get_available_providers()) <= BUILT_IN_PROVIDERS:
        return None
    return frozenset(k.op_name for k in C.get_all_opkernel_def()
                     if k.domain in ("", "ai.onnx") and k.provider == "CPUExecutionProvider")


def _check_external_data(proto: onnx.ModelProto, folder: Path) -> None:
    """Each external tensor's file lies under the model's folder by its name (a relative
    location without '..', as onnx requires) and holds the bytes the tensor names. The
    file itself may be a symbolic or hard link (a model folder that shares its weights
    with a cache): it is read through the link, as onnxruntime reads it."""
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        parts = Path(location).parts
        if not location or Path(location).is_absolute() or ".." in parts:
            raise ModelError(f"model fails onnx.checker: external data of {tensor.name!r} is at {location!r}, "
                             "outside the model's folder; re-export the model with its data beside it")
        file = folder / location
        if not file.is_file():
            raise ModelError(f"model fails onnx.checker: external data of {tensor.name!r} not found at {file}; "
                             "keep the data file beside the model (same name as when it was saved)")
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        if end > file.stat().st_size:
            raise ModelError(f"model fails onnx.checker: external data of {tensor.name!r} ends at byte {end}, past "
                             f"the end of {file} ({file.stat().st_size} bytes); the data file is truncated")


def subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every graph nested in its nodes' attributes (If, Loop, Scan bodies)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from subgraphs(sub)


def refuse_training(proto: onnx.ModelProto, name: str) -> None:
    """Training graphs (gradient, optimizer nodes) have no inference meaning to quantize."""
    nodes = [n for g in subgraphs(proto.graph) for n in g.node]
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
    if not set(ort.get_available_providers()) <= BUILT_IN_PROVIDERS:
        return ORT_DOMAINS
    return frozenset({"ai.onnx"} | {k.domain for k in C.get_all_opkernel_def()})


def check_runnable(model: ir.Model, name: str) -> None:
    """Refuse a model with ops of a domain onnxruntime has no kernels for (a custom-op
    library's): calibration and the output's load check run it in onnxruntime."""
    # The default domain needs no look-up (every build has its kernels): listing the
    # registry costs 4 ms a process, a fortieth of ResNet-20's default quantize.
    local = {f.domain for f in model.functions.values()} | {"", "ai.onnx"}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in local and node.domain not in _kernel_domains():
            raise UnsupportedModelError(
                f"{name}: node {node.name!r} is {node.domain}::{node.op_type}, a custom op onnxruntime has no "
                f"kernel for (domain {node.domain!r}); onnxq runs the model in onnxruntime to calibrate and "
                "check it: export it with standard ONNX ops"
            )


def has_map(type_proto: onnx.TypeProto) -> bool:
    """Whether a type is or contains a map (onnx-ir has no map type)."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        return True
    if kind in ("sequence_type", "optional_type"):
        return has_map(getattr(type_proto, kind).elem_type)
    return False


def drop_map_types(proto: onnx.ModelProto, name: str) -> None:
    """Refuse map-typed graph inputs and outputs; forget map-typed intermediate annotations.

    onnx-ir cannot hold map types, so a boundary map (ZipMap's seq(map) output, a
    DictVectorizer input) cannot survive; an inner one is left for shape inference.
    """
    graph = proto.graph
    boundary = [("input", v) for v in graph.input] + [("output", v) for v in graph.output]
    for kind, value in boundary:
        if has_map(value.type):
            raise UnsupportedModelError(
                f"{name}: graph {kind} {value.name!r} has a map type, which onnxq cannot represent; "
                "export the model without it (skl2onnx: zipmap=False) or cut the graph before that value"
            )
    for g in subgraphs(graph):
        keep = [v for v in g.value_info if not has_map(v.type)]
        if len(keep) != len(g.value_info):
            del g.value_info[:]
            g.value_info.extend(keep)
