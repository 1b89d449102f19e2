"""The sessions onnxq opens on a user's models as a deployment would: default options
(all graph optimisations, onnxq's extended ops registered only for a model that imports
them) or reference kernels, a model file, serialized bytes or an onnx-ir model in memory;
the inputs a session takes, batched on their batch axis; and onnxruntime's refusal of a
model as one line naming it. Used by `compare`, `analyze`, `run`, the output check, the
latency measurement and the accuracy search."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.data import InputSpec
from onnxq.calibrate.inputs import axis_name, batch_axes
from onnxq.calibrate.session import OPEN_FAILURES, open_session, refusal
from onnxq.errors import ModelError
from onnxq.graph.load import load_model
from onnxq.graph.normalize import MIN_OPSET
from onnxq.graph.wire import read_structure
from onnxq.runtime import DOMAIN, session_options


def session_inputs(session: ort.InferenceSession, recurrent: Mapping[str, int] | None = None) -> list[InputSpec]:
    """The session's inputs, batched as their names and `recurrent` (`inputs.recurrent_axes`
    of the model it runs, which a session does not show) say (`inputs.batch_axes`)."""
    kinds = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(float16)": np.float16, "tensor(double)": np.float64, "tensor(uint8)": np.uint8,
             "tensor(bool)": np.bool_, "tensor(int8)": np.int8, "tensor(string)": np.object_}
    named = lambda shape: [d if isinstance(d, int | str) else None for d in shape or []]  # noqa: E731
    axes = batch_axes({i.name: named(i.shape) for i in session.get_inputs()},
                      [named(o.shape) for o in session.get_outputs()], recurrent)
    specs = []
    for i in session.get_inputs():
        shape = tuple(d if isinstance(d, int) else None for d in i.shape)
        axis = axes.get(i.name, 0)
        specs.append(InputSpec(i.name, np.dtype(kinds.get(i.type, np.float32)), shape, batch_axis=axis,
                               batch_name=axis_name(named(i.shape), axis)))
    return specs


def deployed_options(reference: bool = False, extended: bool = False) -> ort.SessionOptions:
    """Default session options, as a deployment has them (quiet), or reference kernels;
    onnxq's extended ops are registered (`onnxq.runtime`) only for a model that imports
    them (`extended`, see `imports_extended`): a deployment of any other model runs
    without that library."""
    options = session_options() if extended else ort.SessionOptions()
    options.log_severity_level = 4  # errors come as exceptions (`run_on_data`), not log lines too
    if reference:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return options


def imports_extended(model: str | os.PathLike | bytes | ir.Model) -> bool:
    """Whether `model` imports the extended ops' domain (an unreadable file: no, and
    onnxruntime says why when it opens it)."""
    if isinstance(model, ir.Model):
        return DOMAIN in model.opset_imports
    return extends(structure(model))


def structure(model: str | os.PathLike | bytes) -> onnx.ModelProto | None:
    """The model's proto, a file's without its weights' bytes (`read_structure`); None
    where it cannot be read (not a model: the session reports it)."""
    try:
        return onnx.load_from_string(model) if isinstance(model, bytes) else read_structure(model)
    except Exception:  # noqa: BLE001
        return None


def extends(proto: onnx.ModelProto | None) -> bool:
    return proto is not None and any(o.domain == DOMAIN for o in proto.opset_import)


def deployed_session(
    model: str | os.PathLike | bytes | ir.Model, providers: list[str], reference: bool = False,
    extended: bool | None = None,
) -> ort.InferenceSession:
    """A session as a deployment opens it (default options), or with reference kernels.
    `extended`: whether the model imports the extended ops (None: read it from the model)."""
    if extended is None:
        extended = imports_extended(model)
    return open_any(model, deployed_options(reference, extended), providers)


def open_any(model: str | os.PathLike | bytes | ir.Model, options: ort.SessionOptions,
             providers: list[str]) -> ort.InferenceSession:
    """A session of a model file, serialized bytes, or an onnx-ir model as it is in
    memory (`open_session`)."""
    if isinstance(model, ir.Model):
        return open_session(model, options, providers)
    if isinstance(model, onnx.ModelProto):  # in memory, as the Python API takes it
        model = model.SerializeToString()
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=providers)


def opened(which: str, open_it: Callable[[], ort.InferenceSession]) -> ort.InferenceSession:
    """`open_it()`, onnxruntime's refusal a one-line `ModelError` naming `which` model (it
    had been a 30-line traceback with exit 1, legacy trial)."""
    try:
        return open_it()
    except OPEN_FAILURES as exc:
        raise _refused(which, exc) from None


def _refused(which: str, exc: Exception) -> ModelError:
    return ModelError(f"onnxruntime cannot open the {which} model: {refusal(str(exc))}; compare models a default "
                      "onnxruntime session loads (onnxq's outputs always do)")


def float_session(model: Any, proto: onnx.ModelProto | None, providers: list[str]) -> ort.InferenceSession:
    """The float model's default session; a model file or serialized model onnxruntime
    cannot open as given (an opset-6 BatchNormalization, which it has no kernel for) is
    read as `quantize` reads it, upgraded (`graph/load.py`), where that opens."""
    try:
        return deployed_session(model, providers, extended=extends(proto))
    except OPEN_FAILURES as exc:
        if proto is None or default_opset(proto) >= MIN_OPSET:
            raise _refused("float", exc) from None
    upgraded, _ = load_model(model if isinstance(model, str | os.PathLike) else onnx.load_from_string(model)
                             if isinstance(model, bytes) else model)
    return opened("float", lambda: deployed_session(upgraded, providers, extended=extends(proto)))


def default_opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET)
