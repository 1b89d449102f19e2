"""Whether onnxruntime has a real kernel for a typed node (one-node probe models), and
whether a whole model loads. Decisions read only success or failure, never error text."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.emit.float_cast.types import NUMPY_TYPES, Slots, cast_array, typed_attributes
from onnxq.graph.fold import constant_array
from onnxq.graph.save import EXTERNAL_DATA_LIMIT, weight_bytes

_PROBE_CONSTANT_LIMIT = 1024  # constant inputs up to this many elements go into probe models


def _value_info(name: str, dtype: ir.DataType, shape: ir.Shape | None) -> onnx.ValueInfoProto:
    dims = None
    if shape is not None:
        dims = [d if isinstance(d, int) else (str(d) if d.value else None) for d in shape]
    return onnx.helper.make_tensor_value_info(name, int(dtype), dims)


class KernelProbe:
    """Finds, with one-node models, whether the runtime has a real kernel for a typed node."""

    def __init__(self, model: ir.Model, providers: list[str], workdir: Path, accept_upcast: bool) -> None:
        self.opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
        self.ir_version = model.ir_version
        self.providers = providers
        self.where = ", ".join(providers)
        self.workdir = workdir
        self.accept_upcast = accept_upcast
        self.cache: dict[tuple, str | None] = {}

    def reason(self, node: ir.Node, target: ir.DataType, slots: Slots) -> str | None:
        """Why the node cannot compute in `target` in the runtime; None if it can."""
        ins = tuple(target if i in slots.inputs else (v.dtype if v else None) for i, v in enumerate(node.inputs))
        outs = tuple(target if i in slots.outputs else v.dtype for i, v in enumerate(node.outputs))
        key = (node.op_type, ins, outs)
        if key not in self.cache:
            self.cache[key] = self._probe(node, ins, outs, target)
        return self.cache[key]

    def _model(self, node: ir.Node, ins: tuple, outs: tuple) -> onnx.ModelProto:
        inputs, initializers, seen = [], [], set()
        for value, dtype in zip(node.inputs, ins):
            if value is None or value.name in seen:
                continue
            seen.add(value.name)
            array = constant_array(value)
            if array is not None and array.size <= _PROBE_CONSTANT_LIMIT and dtype != value.dtype:
                array = cast_array(array, dtype) if dtype in NUMPY_TYPES else None
            if array is not None and array.size <= _PROBE_CONSTANT_LIMIT:
                initializers.append(ir.serde.serialize_tensor(ir.Tensor(array, name=value.name)))
            else:
                inputs.append(_value_info(value.name, dtype, value.shape))
        outputs = [_value_info(v.name, t, None) for v, t in zip(node.outputs, outs) if v.name]
        proto = ir.serde.serialize_node(node)
        target = next((t for t, v in zip(outs, node.outputs) if t != v.dtype), None)
        for attr in typed_attributes(node, target) if target is not None else []:
            kept = [a for a in proto.attribute if a.name != attr.name]
            del proto.attribute[:]
            proto.attribute.extend([*kept, ir.serde.serialize_attribute(attr)])
        graph = onnx.helper.make_graph([proto], "probe", inputs, outputs, initializers)
        return onnx.helper.make_model(graph, opset_imports=self.opsets, ir_version=self.ir_version)

    def _load(self, proto: onnx.ModelProto) -> tuple[str | None, list[str]]:
        """Load in onnxruntime: (error or None, op types of the graph it would run)."""
        path = self.workdir / f"probe{len(self.cache)}.onnx"
        options = session_options()
        options.optimized_model_filepath = str(path)
        try:
            ort.InferenceSession(proto.SerializeToString(), options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises several exception types
            return str(exc), []
        ops = [n.op_type for n in onnx.load(str(path)).graph.node if not n.op_type.startswith("Memcpy")]
        return None, ops

    def _probe(self, node: ir.Node, ins: tuple, outs: tuple, target: ir.DataType) -> str | None:
        dtype = target.name.lower()
        error, ops = self._load(self._model(node, ins, outs))
        if error is not None:
            original = tuple(v.dtype if v else None for v in node.inputs)
            control, _ = self._load(self._model(node, original, tuple(v.dtype for v in node.outputs)))
            if control is not None:
                return None  # the probe itself is not representative; the model check decides
            return f"no {dtype} kernel in {self.where}"  # the one-node model loads in float32 only
        if ops != [node.op_type] and not self.accept_upcast:
            return f"no {dtype} kernel in {self.where} (onnxruntime would compute it in float32)"
        return None


def session_options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0][:200] if lines else "unknown error"


def session_error(model: ir.Model, providers: list[str], workdir: Path) -> str | None:
    """Load `model` in onnxruntime; the error message, or None when it loads."""
    try:
        if weight_bytes(model) > EXTERNAL_DATA_LIMIT:
            path = workdir / "check.onnx"
            ir.save(model, path, external_data="check.onnx.data")
            ort.InferenceSession(str(path), session_options(), providers=providers)
        else:
            ort.InferenceSession(ir.to_proto(model).SerializeToString(), session_options(), providers=providers)
    except Exception as exc:  # onnxruntime raises several exception types
        return str(exc)
    return None
