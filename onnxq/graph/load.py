"""Stage 1, load: read a model, check it, and normalise it for quantization.

Reading never loads external data into memory: onnx-ir keeps external tensors
memory-mapped, so models above 2 GB load like any other (`external_data.py`). The checks
refuse broken models, training graphs and map-typed graph inputs or outputs (which onnx-ir
cannot represent) with a one-line error (`checks.py`). Normalising upgrades old opsets,
folds constant weight producers into initializers and infers shapes; sequence and
optional values keep their types (`normalize.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
from google.protobuf.message import DecodeError

from onnxq.errors import ModelError
from onnxq.graph.checks import check_proto, check_runnable, drop_map_types, refuse_training
from onnxq.graph.external_data import follow_links, inline_external, read_mapped, spill_embedded
from onnxq.graph.fold import fold_constants
from onnxq.graph.normalize import (
    MIN_OPSET,
    binary_sum_to_add,
    default_opset,
    fix_prelu_slopes,
    infer_shapes,
    remove_initializer_inputs,
    upgrade_opset,
)
from onnxq.graph.upcast import Upcast, upcast_half
from onnxq.graph.wire import read_structure

__all__ = ["LoadReport", "check_readable", "check_runnable", "load_model", "read_model"]


@dataclass
class LoadReport:
    """What loading changed, for the summary."""

    source: str
    original_opset: int
    opset: int
    folded_nodes: int = 0
    notes: list[str] = field(default_factory=list)
    upcast: Upcast | None = None  # a float16/bfloat16 model made float32 inside (`upcast.py`)


def _read_proto(source: str | os.PathLike | onnx.ModelProto, split: bool = False,
                ) -> tuple[onnx.ModelProto, str, str, dict[str, np.ndarray]]:
    """The model proto (external data not loaded), its base directory, a display name and,
    with `split` for a file past `MAP_MIN_BYTES`, its raw weights as memory maps of the file
    (left out of the proto, `graph.wire`)."""
    if isinstance(source, onnx.ModelProto):
        return source, "", "<ModelProto>", {}
    path = _model_file(source)
    if split and (found := read_mapped(path)) is not None:
        proto, weights = found
        return proto, str(path.parent), str(path), weights
    return _parsed(path, lambda: onnx.load(str(path), load_external_data=False)), str(path.parent), str(path), {}


# Mapped weights up to this size go back into the proto for the opset converter: its
# adapters read constant inputs such as shapes and axes, never a layer's weights.
CONVERTER_INLINE_BYTES = 1 << 16


def _restore_small(proto: onnx.ModelProto, mapped: dict[str, np.ndarray]) -> None:
    """Put the mapped weights up to `CONVERTER_INLINE_BYTES` back into `proto` (and out of
    `mapped`), so an inline model past 2 GB is upgraded without reading its weights (it
    was read whole: 6.3x the file in memory at a 1.5 GB model, big-model trial)."""
    for tensor in proto.graph.initializer:
        array = mapped.get(tensor.name)
        if array is not None and array.nbytes <= CONVERTER_INLINE_BYTES:
            tensor.raw_data = np.ascontiguousarray(array).tobytes()
            del mapped[tensor.name]


def _kept_initializers(proto: onnx.ModelProto, mapped: dict[str, np.ndarray]) -> bool:
    """Whether every mapped weight is still an initializer of `proto` as the split left it
    after the converter: no data of any kind, and the map's shape."""
    typed = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
    left = {t.name: tuple(t.dims) for t in proto.graph.initializer
            if not t.raw_data and not any(len(getattr(t, field)) for field in typed)}
    return all(left.get(name) == tuple(array.shape) for name, array in mapped.items())


def _model_file(source: str | os.PathLike) -> Path:
    path = Path(source)
    if not path.exists():
        raise ModelError(f"model file not found: {path}; check the path")
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not an .onnx file; pass the model file itself")
    return path


def _parsed(path: Path, parse: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    try:
        return parse()
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}); "
            "check that the file is a complete .onnx export, not truncated or another format"
        ) from None


def _structure(source: str | os.PathLike) -> onnx.ModelProto:
    """The model file's proto without its weights' bytes (`wire.read_structure`)."""
    path = _model_file(source)
    return _parsed(path, lambda: read_structure(path))


def graph_structure(source: str | os.PathLike | onnx.ModelProto) -> onnx.GraphProto:
    """The main graph of a model file or proto, its weights' bytes left in the file (cheap:
    for reading node names, op types and which inputs are constants)."""
    return source.graph if isinstance(source, onnx.ModelProto) else _structure(source).graph


def check_readable(path: str | os.PathLike) -> None:
    """Raise `ModelError` unless `path` parses as an ONNX model with a graph (cheap: the
    weights stay in the file), for commands that hand the file to onnxruntime."""
    if not (proto := _structure(path)).HasField("graph") or not proto.opset_import:
        raise ModelError(f"{path} is not an ONNX model (no graph or opset); pass a .onnx model file")


def input_names(path: str | os.PathLike) -> list[str]:
    """The graph input names of the model file at `path`, read cheaply (external data not
    loaded, the weights left in the file)."""
    return [value.name for value in _structure(path).graph.input]


def read_model(source: str | os.PathLike | onnx.ModelProto | ir.Model) -> ir.Model:
    """Read a model as it is (checked, not normalised): for looking at a model this tool
    or another one wrote, where normalising would change what is looked at."""
    if isinstance(source, ir.Model):
        return source
    proto, base_dir, name, _ = _read_proto(source)
    check_proto(proto, None if isinstance(source, onnx.ModelProto) else str(source))
    model = ir.serde.deserialize_model(proto)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
        follow_links(model)
    return model


def load_model(
    source: str | os.PathLike | onnx.ModelProto | ir.Model, min_opset: int = MIN_OPSET,
    upcast: Callable[[ir.Model], bool] | None = None,
) -> tuple[ir.Model, LoadReport]:
    """Read, check and normalise a model; the caller's file or proto is never modified.

    Models below `min_opset` (at least 13) are upgraded. A float16 or bfloat16 model is
    made float32 inside (`upcast.py`) where `upcast(model)` says so. Returns the
    normalised onnx-ir model and a report of what changed.
    """
    min_opset = max(min_opset, MIN_OPSET)
    if isinstance(source, ir.Model):
        source = ir.to_proto(source)
    proto, base_dir, name, mapped = _read_proto(source, split=True)
    upgrading = bool(mapped) and default_opset(proto) < min_opset
    if upgrading:  # the opset converter reads small constants (shapes, axes), never a weight
        _restore_small(proto, mapped)
    refuse_training(proto, name)
    checked = check_proto(proto, None if isinstance(source, onnx.ModelProto) else str(source), set(mapped))
    original, proto_ir_version = default_opset(proto), proto.ir_version
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto.FromString(proto.SerializeToString())  # never mutate the caller's
    drop_map_types(proto, name)
    proto = upgrade_opset(proto, original, min_opset)
    if upgrading and not _kept_initializers(proto, mapped):  # an adapter rewrote a mapped weight: read it all
        proto, base_dir, name, mapped = _read_proto(source)
        drop_map_types(proto, name)
        proto = upgrade_opset(proto, original, min_opset)
    model = ir.serde.deserialize_model(proto)
    for name_, array in mapped.items():
        value = model.graph.initializers[name_]
        value.const_value = ir.Tensor(array, dtype=value.const_value.dtype, name=name_)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
        follow_links(model)
        inline_external(model)
    spill_embedded(model)
    del proto
    report = LoadReport(source=name, original_opset=original, opset=max(original, min_opset))
    report.notes.extend(checked)  # an opset upgrade is in the report's opsets (the summary's own line)
    dropped = remove_initializer_inputs(model.graph)
    if dropped and proto_ir_version >= 4:  # before IR 4 every weight was listed as an input
        shown = ", ".join(dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
        report.notes.append(f"{len(dropped)} graph input(s) with a default value (initializer) taken as constant and "
                            f"no longer inputs of the output model: {shown}; its weights are quantized from those "
                            "values, so feeding others at run time is not possible")
    ir_passes.NameFixPass()(model)  # every node and value gets a unique name
    ir_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    report.folded_nodes = fold_constants(model)
    binary_sum_to_add(model.graph)
    ir_passes.RemoveUnusedNodesPass()(model)
    infer_shapes(model)
    report.upcast = upcast_half(model) if upcast is not None and upcast(model) else None  # every value typed
    if prelus := fix_prelu_slopes(model, original):
        report.notes.append(f"PRelu slopes [C] reshaped to [C,1,...] to broadcast per channel: {prelus}")
        infer_shapes(model)
    ir_passes.TopologicalSortPass()(model)
    return model, report
