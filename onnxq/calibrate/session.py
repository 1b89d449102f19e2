"""An onnxruntime session over the model with the tensors to calibrate exposed as outputs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Collection, Iterator, Mapping

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from onnxq.errors import CalibrationDataError, ModelError, OnnxqError
from onnxq.graph.edit import values_by_name
from onnxq.graph.external_data import drop_pages
from onnxq.graph.layout import clip_bounds
from onnxq.graph.save import tensors_replaced
from onnxq.runtime import options_for


def check_providers(providers: list[str]) -> list[str]:
    """Reject execution providers this onnxruntime build does not have."""
    available = ort.get_available_providers()
    for p in providers:
        if p not in available:
            raise OnnxqError(
                f"execution provider {p!r} is not available in this onnxruntime; available: {', '.join(available)}"
            )
    return providers


def session_options(threads: int = 0, level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                    ) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 4  # errors reach the caller as exceptions, said once (`run_on_data`)
    options.intra_op_num_threads = threads
    # Nodes in the order the graph lists them (`place_observers` puts each reduction right
    # after its tensor): by default onnxruntime ran the added reductions last, keeping every
    # observed tensor alive to the end of the run (MobileNet at batch 8: 480 MB, not 50).
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # The same statistics every run: CUDA autotunes cuDNN's convolution algorithms, and
    # one whose float sums vary between runs would change the saved model's bytes. This
    # keeps to deterministic kernels (no cost on the CPU; on an H200, three CUDA runs of
    # MobileNet gave identical files with and without it, but a different file each way).
    options.use_deterministic_compute = True
    return options


def calibration_options() -> ort.SessionOptions:
    """`session_options` for a calibration pass, at onnxruntime's default level, without a
    memory pattern (with the reductions added, the planned arena grew by 120 MB on
    MobileNet-v1, no time lost).

    The default level runs convolutions on blocked layouts (NCHWc), fused with their
    activation, 2x faster than the basic level's. A reduction that reads an image in plain
    layout makes the Conv before it reorder its output, so the reductions of images are
    made of ops with blocked kernels: GlobalMaxPool for a bounded tensor's maximum
    (`_bounded`), GlobalAveragePool for channel means, counts from small outputs' shapes
    (`reductions.py`); and batches are cut so one sample's largest image stays in cache
    (`runner.calibration_batch`). MobileNet-v1's default int8 quantize, 2 cores with VNNI:
    1.98 s and 353 MB at the basic level, 1.64 s and 469 MB at this one at batch 8, 1.46 s
    and 349 MB at the batch of 2 it is cut to."""
    options = session_options(level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    options.enable_mem_pattern = False
    return options


REDUCED_SUFFIXES = ("__onnxq_min", "__onnxq_max")

# What onnxruntime raises when a model cannot run on the data it is given: inputs of a
# sample whose lengths do not broadcast, indices past a table (token ids beyond the
# vocabulary), a shape a Reshape cannot take.
DATA_FAILURES = (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                  ort.capi.onnxruntime_pybind11_state.RuntimeException)

# What onnxruntime raises when it cannot open a model (a kernel or a type it lacks, a graph
# it rejects).
OPEN_FAILURES = (*DATA_FAILURES, ort.capi.onnxruntime_pybind11_state.NotImplemented,
                 ort.capi.onnxruntime_pybind11_state.InvalidGraph, ort.capi.onnxruntime_pybind11_state.EPFail,
                 ort.capi.onnxruntime_pybind11_state.InvalidProtobuf)


def refusal(text: str) -> str:
    """onnxruntime's error, short: the node and its message, without the source location
    and the failed assertion."""
    first = (text.splitlines() or ["onnxruntime error"])[0].split(" : ", 3)[-1]  # past "[ONNXRuntimeError] : 1 : FAIL : "
    found = re.search(r"running (\S+) node\. Name:'([^']*)' Status Message: (.*)", first)
    if found:
        op, node, message = found.groups()
        message = message.split(" was false. ")[-1]
        message = re.sub(r"^[\w/.-]+\.(?:h|cc|cpp):\d+ (?:(?:\w+ )?[\w:]*::\w+\([^)]*\) )?", "", message)  # file, function
        first = f"{op} node '{node}': {message}"
    return first[:300]


def run_on_data(session: ort.InferenceSession, names: list[str], feed: Mapping[str, np.ndarray],
                kind: str = "calibration") -> list[np.ndarray]:
    """`session.run(names, feed)` on the user's data, onnxruntime's refusal of that data
    a one-line `CalibrationDataError` naming the batch's shapes (a failure inside a node
    onnxq added, `__onnxq`/`onnxq_` in its name, is raised as it is: a bug, not the data)."""
    try:
        return session.run(names, feed)
    except DATA_FAILURES as exc:
        text = str(exc).strip()
        if "onnxq_" in text:
            raise
        _out_of_memory(text, kind, feed)
        raise CalibrationDataError(
            f"the model cannot run on this {kind} data ({_shapes(feed)}): {refusal(text)}; check that every input of a sample "
            "has the others' length and values the model takes (token ids within its vocabulary)") from None


def _shapes(feed: Mapping[str, np.ndarray]) -> str:
    """A batch's inputs and their shapes, for an error about the batch."""
    return ", ".join(f"{name} {list(np.shape(value))}" for name, value in feed.items())


def _out_of_memory(text: str, kind: str, feed: Mapping[str, np.ndarray]) -> None:
    """Raise the one-line out-of-memory error where onnxruntime's `text` says so: the batch
    is too big, whichever model ran it."""
    if "Failed to allocate memory" in text:
        raise OnnxqError(f"onnxruntime ran out of memory on a {kind} batch ({_shapes(feed)}); lower --batch-size "
                         "(calibration.batch_size) or bound the exposed tensors with --max-calib-memory") from None


def run_quantized(session: ort.InferenceSession, names: list[str], feed: Mapping[str, np.ndarray],
                  isolated: str | None = None) -> list[np.ndarray]:
    """`session.run` of a quantized model on data the float model has just run on, or
    `run_on_data` of the float model with copies of the quantized layers (node names
    starting `isolated`): onnxruntime's failure in the quantized model or a copy is a
    one-line `ModelError` (a model that loads but whose kernel refuses its parameters at
    run time), not a traceback or the data's fault."""
    try:
        return session.run(names, feed) if isolated is None else run_on_data(session, names, feed, "evaluation")
    except DATA_FAILURES as exc:
        text = str(exc).strip()
        _out_of_memory(text, "evaluation", feed)
        if isolated is not None and isolated not in text:
            raise
        shown = refusal(text).replace(isolated, "") if isolated else refusal(text)  # the copy's node as the user's
        raise ModelError(f"the quantized model fails in onnxruntime on data the float model runs on: {shown}; "
                         "quantize the float model again (onnxq checks that its output runs), or leave that node "
                         "float") from None


def lower_bound(value: ir.Value) -> float | None:
    """The bound b >= 0 below which `value` cannot go, when a Relu, a Clip with a
    constant non-negative minimum, a Sigmoid or a Softmax produces it; None otherwise."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ("Relu", "Clip", "Sigmoid",
                                                                                   "Softmax"):
        return None
    bounds = clip_bounds(node) if node.op_type == "Clip" else (0.0, np.inf)
    # a Clip whose min passes its max outputs the max everywhere: no bound worth taking
    return bounds[0] if bounds is not None and 0 <= bounds[0] <= bounds[1] else None


def _bounded(value: ir.Value, bound: float) -> tuple[list[ir.Node], list[ir.Value]]:
    """[min, max] of a tensor bounded below by `bound` >= 0, in one pass over it: the
    min is the bound itself. Every range includes zero (`qmath`), so a minimum in
    [0, max] quantizes as the observed one would; the ranges reported read `bound`
    (MobileNet-v1's calibration pass, 27 Relu6 outputs: 3.5 s -> 2.9 s)."""
    low = ir.Value(name=value.name + REDUCED_SUFFIXES[0], type=value.type, shape=ir.Shape([]))
    high = ir.Value(name=value.name + REDUCED_SUFFIXES[1], type=value.type, shape=ir.Shape([]))
    constant = ir.Tensor(np.array(bound, dtype=value.dtype.numpy()))
    nodes = [ir.node("Constant", [], {"value": constant}, outputs=[low], name=low.name)]
    source = value
    if value.shape is not None and len(value.shape) == 4 and value.dtype == ir.DataType.FLOAT:
        # each channel's maximum on the blocked layout (`calibration_options`), then theirs
        pooled = ir.Value(name=high.name + "_pool")
        nodes.append(ir.node("GlobalMaxPool", [value], outputs=[pooled], name=pooled.name))
        source = pooled
    nodes.append(ir.node("ReduceMax", [source], {"keepdims": 0}, outputs=[high], name=high.name))
    return nodes, [low, high]


def _reduction_nodes(values: list[ir.Value]) -> tuple[list[ir.Node], list[ir.Value]]:
    """ReduceMin/ReduceMax over all axes of each value (no axes input: every axis); for
    a tensor bounded below, `_bounded`."""
    nodes, outputs = [], []
    for value in values:
        bound = lower_bound(value)
        if bound is not None and value.dtype is not None and value.dtype.is_floating_point():
            built = _bounded(value, bound)
            nodes += built[0]
            outputs += built[1]
            continue
        for op, suffix in zip(("ReduceMin", "ReduceMax"), REDUCED_SUFFIXES):
            out = ir.Value(name=value.name + suffix, type=value.type, shape=ir.Shape([]))
            nodes.append(ir.node(op, [value], {"keepdims": 0}, outputs=[out], name=out.name))
            outputs.append(out)
    return nodes, outputs


# Main-graph weights from this size on reach onnxruntime as arrays, not serialized bytes.
INJECT_MIN_BYTES = 1 << 16
# Types onnxruntime takes from numpy arrays (OrtValue.ortvalue_from_numpy).
_NUMPY_TYPES = frozenset({
    ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BOOL,
    ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16,
    ir.DataType.INT32, ir.DataType.UINT32, ir.DataType.INT64, ir.DataType.UINT64,
})
_IN_MEMORY = "onnxq-in-memory"  # the stand-ins' location, never read


def injected(tensor: ir.TensorProtocol) -> bool:
    """Whether onnxruntime takes this weight as an array rather than serialized."""
    return tensor.nbytes >= INJECT_MIN_BYTES and tensor.dtype in _NUMPY_TYPES


def stand_in(tensor: ir.TensorProtocol, folder: str | None = None) -> ir.TensorProtocol | None:
    """An external-data stub for a weight onnxruntime will take as an array, or read from
    its own file where that file is under `folder` (`read_by_session`); the data itself,
    inline, for a small weight kept in an external file (whose relative location
    onnxruntime would resolve against the working directory)."""
    if injected(tensor) and folder is not None and _file_folder(tensor) == folder:
        return ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, tensor.dtype, shape=tensor.shape,
                                 name=tensor.name)
    if injected(tensor):
        return ir.ExternalTensor(_IN_MEMORY, None, None, tensor.dtype, shape=tensor.shape, name=tensor.name)
    if isinstance(tensor, ir.ExternalTensor):
        return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name)
    return None


def _file_folder(tensor: ir.TensorProtocol) -> str | None:
    """The folder an external-data weight's location is relative to, None for others."""
    if isinstance(tensor, ir.ExternalTensor) and tensor.base_dir:
        return os.path.abspath(tensor.base_dir)
    return None


def external_folder(graph: ir.Graph, big_only: bool = False) -> str | None:
    """The one folder every external-data weight of `graph` (`big_only`: every `injected`
    one) is relative to, None where there are none or several: a session over a proto that
    still names those files resolves them there (`read_files_in`), not against the
    working directory."""
    folders = {_file_folder(v.const_value) for v in graph.initializers.values()
               if v.const_value is not None and (not big_only or injected(v.const_value))}
    folders.discard(None)
    return folders.pop() if len(folders) == 1 else None


def read_by_session(graph: ir.Graph) -> str | None:
    """The folder whose external data files onnxruntime reads itself, where the model's
    big weights all sit in one: handed over as arrays, a weight's pages were touched as
    onnxruntime copied them, the model's size twice over at the session's start."""
    return external_folder(graph, big_only=True)


def read_files_in(options: ort.SessionOptions, folder: str | None) -> None:
    """Have the session `options` open resolve external data locations in `folder`."""
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)


def add_arrays(options: ort.SessionOptions, weights: Mapping[str, ir.TensorProtocol]) -> list[ort.OrtValue]:
    """Hand the `injected` ones of `weights` (name -> tensor, serialized as `stand_in`s)
    to the session `options` will open; the values, which must live as long as it."""
    names = [n for n, t in weights.items() if injected(t)]
    arrays = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(weights[n].numpy())) for n in names]
    if names:
        options.add_external_initializers(names, arrays)
    return arrays


# A session keeps its model's serialized bytes up to this size (`open_session`): ResNet-20's
# load-check session is saved from them, 4 ms of a 145 ms quantize; a big model's bytes
# would add their size to the run's peak.
KEPT_MESSAGE_BYTES = 64 << 20


def open_session(model: ir.Model, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """A session over `model` as it is in memory, with `options` (used up: give each
    session its own). The graph is serialized without its large weights: those in one
    folder's external data files onnxruntime reads from there (`read_by_session`), the
    others it takes from their arrays (`add_external_initializers`): no serialized copy
    of the weights, no temporary file, no 2 GB protobuf limit, and the same graph, options
    and kernels as the model written to a file (SmolLM2 int4 load check: 1.5 s -> 0.5 s).
    onnxruntime (1.32) still copies arrays into its own buffers: a 256 MB float32 MatMul
    weight adds 265 MB, with graph optimisations and prepacking off too."""
    folder = read_by_session(model.graph)
    with tensors_replaced(model.graph, lambda tensor: stand_in(tensor, folder)) as weights:
        message = ir.to_proto(model).SerializeToString()
    read_files_in(options, folder)
    if folder is not None:
        weights = {name: t for name, t in weights.items() if _file_folder(t) != folder}
    arrays = add_arrays(options, weights)
    session = ort.InferenceSession(message, options, providers=check_providers(providers))
    session._onnxq_weights = arrays  # onnxruntime may read them in place: they live as long as the session
    # the whole model's bytes, where no weight was held out of them and they are small: what
    # `graph.save.save_model` writes for the model as it is (`serialized`), not serialized again
    session._onnxq_message = message if not weights and len(message) <= KEPT_MESSAGE_BYTES else None
    for tensor in weights.values():  # copied into onnxruntime's buffers: a mapped weight's pages may go
        if injected(tensor):
            drop_pages(tensor)
    return session


def profiled_largest(model: ir.Model, feed: Mapping[str, np.ndarray], providers: list[str]) -> int:
    """Bytes of the largest node output (all of a node's outputs) on one run of `feed`,
    from onnxruntime's profiler in a default session: what shape inference cannot size
    where shapes are computed at run time (a VAE's attention after Shape and Reshape).
    0 where the run fails (calibration then says why)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    with tempfile.TemporaryDirectory(prefix="onnxq_probe_") as folder:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "probe")
        try:
            session = open_session(model, options, providers)
            session.run(None, dict(feed))
            with open(session.end_profiling()) as events:
                nodes = [e for e in json.load(events) if e.get("cat") == "Node"]
        except Exception:  # noqa: BLE001  a probe: the calibration run reports any failure itself
            return 0
    return max((int(e.get("args", {}).get("output_size", 0)) for e in nodes), default=0)


def place_observers(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Insert `nodes` (reductions of the graph's tensors and their constants, in dependency
    order) into `graph`, each right after the last producer of its inputs, so that the
    session runs it as soon as its tensor exists and can free the tensor."""
    order = list(graph)
    position = {node: i for i, node in enumerate(order)}
    tail: dict[int, ir.Node] = {}  # anchor position -> last node inserted after it
    for node in nodes:
        anchor = max((position[v.producer()] for v in node.inputs
                      if v is not None and v.producer() in position), default=-1)
        after = tail.get(anchor, order[anchor] if anchor >= 0 else None)
        if after is not None:
            graph.insert_after(after, node)
        elif order:
            graph.insert_before(order[0], node)
        else:
            graph.append(node)
        position[node] = anchor
        tail[anchor] = node


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
    place_observers(graph, nodes)
    graph.outputs.extend(added)

    def restore() -> None:
        for value in added:
            graph.outputs.remove(value)
        for node in reversed(nodes):
            graph.remove(node, safe=True)

    try:
        # qdq-ext models (analysed) need onnxq's ops
        session = open_session(model, options_for(model, options or session_options()), providers)
    except BaseException as exc:  # the model as it was, whatever stopped the opening
        restore()
        if isinstance(exc, OPEN_FAILURES):
            _refuse_unloadable(model, providers)  # the model alone fails too: the user's to fix
        raise  # it opens without the added nodes (at the basic level): onnxq's error, as it is
    try:
        yield session
    finally:
        restore()


def _refuse_unloadable(model: ir.Model, providers: list[str]) -> None:
    """A one-line `ModelError` where the model as given does not open in onnxruntime either
    (a bfloat16 MatMul on the CPU): a user's model onnxruntime cannot run, not onnxq's."""
    try:
        open_session(model, options_for(model, session_options()), providers)
    except OPEN_FAILURES as exc:
        raise ModelError(f"onnxruntime cannot run this model on {', '.join(providers)}: {refusal(str(exc))}; "
                         "quantize a model that runs in a default onnxruntime session (a float32 export, or "
                         "another execution provider with --providers)") from None
