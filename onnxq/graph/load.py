"""Stage 1, load: read a model, check it, and normalise it for quantization.

Reading never loads external data into memory: onnx-ir keeps external tensors
memory-mapped, so models above 2 GB load like any other. Normalising upgrades old opsets,
folds constant weight producers into initializers and infers shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx.version_converter
import onnx_ir as ir
import onnx_ir.passes.common as ir_passes
from google.protobuf.message import DecodeError

from onnxq.errors import ModelError
from onnxq.graph.fold import fold_constants

# Per-channel QuantizeLinear/DequantizeLinear (the `axis` attribute) needs opset 13.
MIN_OPSET = 13
IR_FOR_OPSET = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}


@dataclass
class LoadReport:
    """What loading changed, for the summary."""

    source: str
    original_opset: int
    opset: int
    folded_nodes: int = 0
    initializer_inputs_removed: int = 0
    notes: list[str] = field(default_factory=list)


def _read_proto(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str, str]:
    """The model proto (external data not loaded), its base directory and a display name."""
    if isinstance(source, onnx.ModelProto):
        return source, "", "<ModelProto>"
    path = Path(source)
    if not path.exists():
        raise ModelError(f"model file not found: {path}; check the path")
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not an .onnx file; pass the model file itself")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelError(
            f"{path} is not a readable ONNX model ({type(exc).__name__}); "
            "check that the file is a complete .onnx export, not truncated or another format"
        ) from None
    return proto, str(path.parent), str(path)


def _check(proto: onnx.ModelProto, path: str | None) -> None:
    """Run onnx.checker; by path when we have one, so >2 GB and external data work."""
    if not proto.HasField("graph") or not proto.opset_import:
        name = path or "the model"
        raise ModelError(f"{name} is not an ONNX model (no graph or opset); pass a .onnx model file")
    try:
        if path is not None:
            onnx.checker.check_model(path)
        else:
            onnx.checker.check_model(proto)
    except (onnx.checker.ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model fails onnx.checker: {first}; fix or re-export the model") from None


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
    proto, base_dir, name = _read_proto(source)
    _check(proto, None if isinstance(source, onnx.ModelProto) else str(source))
    original = default_opset(proto)
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto.FromString(proto.SerializeToString())  # never mutate the caller's
    proto = _upgrade_opset(proto, original, min_opset)
    model = ir.serde.deserialize_model(proto)
    if base_dir:
        ir.external_data.set_base_dir(model.graph, base_dir)
    report = LoadReport(source=name, original_opset=original, opset=max(original, min_opset))
    if original < min_opset:
        report.notes.append(f"upgraded opset {original} -> {min_opset}")
    report.initializer_inputs_removed = _remove_initializer_inputs(model.graph)
    ir_passes.NameFixPass()(model)  # every node and value gets a unique name
    ir_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    report.folded_nodes = fold_constants(model)
    _binary_sum_to_add(model.graph)
    ir_passes.RemoveUnusedNodesPass()(model)
    ir_passes.ShapeInferencePass(strict_mode=False)(model)
    ir_passes.TopologicalSortPass()(model)
    return model, report
