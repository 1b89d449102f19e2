"""An onnxruntime session over the model with the tensors to calibrate exposed as outputs."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

import onnx_ir as ir
import onnxruntime as ort

from onnxq.errors import OnnxqError
from onnxq.graph.edit import values_by_name
from onnxq.graph.load import INLINE_LIMIT  # above it, sessions read the model from a file


def check_providers(providers: list[str]) -> list[str]:
    """Reject execution providers this onnxruntime build does not have."""
    available = ort.get_available_providers()
    for p in providers:
        if p not in available:
            raise OnnxqError(
                f"execution provider {p!r} is not available in this onnxruntime; available: {', '.join(available)}"
            )
    return providers


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def session_options(threads: int = 0) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return options


REDUCED_SUFFIXES = ("__onnxq_min", "__onnxq_max")


def _reduction_nodes(values: list[ir.Value]) -> tuple[list[ir.Node], list[ir.Value]]:
    """ReduceMin/ReduceMax over all axes of each value (no axes input: every axis)."""
    nodes, outputs = [], []
    for value in values:
        for op, suffix in zip(("ReduceMin", "ReduceMax"), REDUCED_SUFFIXES):
            out = ir.Value(name=value.name + suffix, type=value.type, shape=ir.Shape([]))
            nodes.append(ir.node(op, [value], {"keepdims": 0}, outputs=[out], name=out.name))
            outputs.append(out)
    return nodes, outputs


@contextlib.contextmanager
def session_source(model: ir.Model) -> Iterator[str | bytes]:
    """The model as onnxruntime takes it: serialized bytes, or a temporary file with
    external data when the weights pass `INLINE_LIMIT` (protobuf stops at 2 GB)."""
    with tempfile.TemporaryDirectory(prefix="onnxq-session-") as tmp:
        if _weight_bytes(model) > INLINE_LIMIT:
            path = Path(tmp) / "model.onnx"
            ir.save(model, path, external_data="model.onnx.data")
            yield str(path)
        else:
            yield ir.to_proto(model).SerializeToString()


@contextlib.contextmanager
def exposed_session(
    model: ir.Model, tensor_names: list[str], providers: list[str], reduced: Collection[str] = (),
    extra: tuple[list[ir.Node], list[ir.Value]] = ([], []), also_whole: Collection[str] = (),
    options: ort.SessionOptions | None = None,
) -> Iterator[ort.InferenceSession]:
    """Yield a session whose outputs include `tensor_names`; the model is left unchanged.

    Tensors in `reduced` are not returned whole: the session computes their min and max
    (outputs `<name>__onnxq_min` / `<name>__onnxq_max`), so only two scalars come back.
    `extra`: more nodes and outputs to add for the session (statistics reductions);
    `also_whole`: tensors of `reduced` that are returned whole as well; `options`: the
    session's options (default: basic optimisation, as calibration runs).
    """
    graph = model.graph
    values = values_by_name(graph)
    present = {v.name for v in graph.outputs}
    nodes, reduced_outputs = _reduction_nodes([values[n] for n in tensor_names if n in reduced])
    nodes += extra[0]
    whole = [n for n in tensor_names if n not in reduced or n in also_whole]
    added = [values[n] for n in dict.fromkeys(whole) if n not in present] + reduced_outputs
    added += extra[1]
    graph.extend(nodes)
    graph.outputs.extend(added)
    try:
        from onnxq.runtime import options_for  # qdq-ext models (analysed) need onnxq's ops

        with session_source(model) as source:
            session = ort.InferenceSession(source, options_for(model, options or session_options()),
                                           providers=check_providers(providers))
        yield session
    finally:
        for value in added:
            graph.outputs.remove(value)
        for node in reversed(nodes):
            graph.remove(node, safe=True)
