"""Which external data files a model names, read without its weights."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from onnxq.graph.wire import read_structure

# Files up to this size are searched for an external-data entry before they are parsed:
# one without the key names no data file. The search reads the whole file (about 0.5 ms a
# MB), the parse only its structure: ResNet-20's 1.1 MB 0.5 against 1.2 ms, MobileNet-v1's
# 10 MB 6.0 against 1.6 ms.
SCAN_MAX_BYTES = 2 << 20


def _names_no_data(model: Path) -> bool:
    """Whether `model` surely names no external data file: no `location` key in its bytes
    (every external tensor's entry holds one, verbatim)."""
    with open(model, "rb") as f:
        if os.fstat(f.fileno()).st_size > SCAN_MAX_BYTES:
            return False
        return b"location" not in f.read()


def model_data_files(model: Path) -> tuple[str, ...]:
    """The external data files `model` names, relative to its folder (its weights are not
    parsed: `read_structure`)."""
    try:
        if _names_no_data(model):
            return ()
        proto = read_structure(model)
    except Exception:  # noqa: BLE001  an unreadable model gets its own error when it is loaded
        return ()
    return external_locations(proto)


def external_locations(model: object) -> tuple[str, ...]:
    """The external data files a model in memory (`onnx.ModelProto` or `ir.Model`) names;
    none for any other source (a path)."""
    if isinstance(model, ir.Model):
        names = {value.const_value.location for value in model.graph.initializers.values()
                 if isinstance(value.const_value, ir.ExternalTensor)}
    elif isinstance(model, onnx.ModelProto):
        names = {entry.value for tensor in model.graph.initializer if tensor.data_location == onnx.TensorProto.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    else:
        return ()
    return tuple(sorted(names))


def data_files(model: str | os.PathLike) -> tuple[str, ...]:
    """The external data files the saved model at `model` names (none where there is no
    file there yet)."""
    try:
        return model_data_files(Path(model)) if Path(model).is_file() else ()
    except OSError:  # a path the system refuses (too long): its own error comes when it is written
        return ()
