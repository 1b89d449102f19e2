"""The integer kernels of the QOperator format: one table (`QOPS`) of how each float op
becomes onnxruntime's integer kernel, read in both directions (`qoperator.py` from QDQ,
`qoperator_expand.py` back), and what both directions share: the report, the
per-channel axis and bias scale a kernel takes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.graph.fold import constant_array

CONTRIB = "com.microsoft"
EIGHT_BIT = (ir.DataType.UINT8, ir.DataType.INT8)
# Layout slots of an integer kernel's inputs: ("q", i) the float op's input i as its
# quantized tensor, scale and zero point; ("split", i, j) inputs i and j as x_i, x_j,
# scale_i, scale_j, zp_i, zp_j (MatMulIntegerToFloat); ("raw", i) the float op's input i
# unchanged (the int32 bias, whose DequantizeLinear is dropped); ("out",) the output's
# scale and zero point; ("q*",) every input, quantized (variadic).
Slot = tuple


@dataclass(frozen=True)
class QOp:
    """How the float op `op` becomes the integer kernel `qop`."""

    op: str
    qop: str
    domain: str
    layout: tuple[Slot, ...]
    # "required": needs a QuantizeLinear after it; "optional": float output allowed too;
    # "float": writes float (no QuantizeLinear after it).
    output: str = "required"
    per_channel: tuple[int, ...] = ()  # quantized inputs that may have per-channel scales
    extra: Callable[[ir.Node, ir.Model], dict] = lambda node, model: {}
    drop: tuple[str, ...] = ()  # float-op attributes the kernel does not take
    check: Callable[[ir.Node], str | None] = lambda node: None


def _softmax_extra(node: ir.Node, model: ir.Model) -> dict:
    return {"opset": model.opset_imports.get("", 13)}


def _gemm_check(node: ir.Node) -> str | None:
    beta = node.attributes.get("beta")
    if len(node.inputs) > 2 and beta is not None and beta.as_float() != 1.0:
        return "Gemm with beta != 1"
    return None


def _pool_check(node: ir.Node) -> str | None:
    return "AveragePool with dilations" if "dilations" in node.attributes else None


_TABLE = (
    QOp("Conv", "QLinearConv", "", (("q", 0), ("q", 1), ("out",), ("raw", 2)), per_channel=(1,)),
    QOp("MatMul", "QLinearMatMul", "", (("q", 0), ("q", 1), ("out",)), per_channel=(1,)),
    QOp("MatMul", "MatMulIntegerToFloat", CONTRIB, (("split", 0, 1),), output="float", per_channel=(1,)),
    QOp("Gemm", "QGemm", CONTRIB, (("q", 0), ("q", 1), ("raw", 2), ("out",)), output="optional",
        per_channel=(1,), drop=("beta",), check=_gemm_check),
    QOp("Add", "QLinearAdd", CONTRIB, (("q", 0), ("q", 1), ("out",))),
    QOp("Mul", "QLinearMul", CONTRIB, (("q", 0), ("q", 1), ("out",))),
    QOp("Concat", "QLinearConcat", CONTRIB, (("out",), ("q*",))),
    QOp("AveragePool", "QLinearAveragePool", CONTRIB, (("q", 0), ("out",)),
        extra=lambda node, model: {"channels_last": 0}, check=_pool_check),
    QOp("GlobalAveragePool", "QLinearGlobalAveragePool", CONTRIB, (("q", 0), ("out",)),
        extra=lambda node, model: {"channels_last": 0}),
    QOp("Sigmoid", "QLinearSigmoid", CONTRIB, (("q", 0), ("out",))),
    QOp("LeakyRelu", "QLinearLeakyRelu", CONTRIB, (("q", 0), ("out",))),
    QOp("Softmax", "QLinearSoftmax", CONTRIB, (("q", 0), ("out",)), extra=_softmax_extra),
)
QOPS: dict[str, tuple[QOp, ...]] = {op: tuple(q for q in _TABLE if q.op == op) for op in dict.fromkeys(q.op for q in _TABLE)}
BY_KERNEL = {(q.domain, q.qop): q for q in _TABLE}
# Ops that only move or select data: they run on 8-bit tensors as they are (input 0); a
# constant Pad pads with the zero point (0 in float), its value input rewritten each way.
DATA_MOVEMENT = ("MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Resize", "Gather",
                 "Slice", "DepthToSpace", "SpaceToDepth", "Identity", "Pad")


@dataclass
class FormatReport:
    """What a format conversion did: converted ops by kernel, and quantized nodes left in
    Q/DQ form with the reason."""

    converted: Counter = field(default_factory=Counter)
    kept: dict[str, str] = field(default_factory=dict)
    left: Counter = field(default_factory=Counter)  # weight-only / dynamic kernels, not rewritten

    def note(self, what: str) -> str:
        done = ", ".join(f"{op} {n}" for op, n in sorted(self.converted.items())) or "nothing"
        line = {"qoperator": f"qoperator: made {done}",
                "qdq": f"qdq: rewrote {done} as Q/DQ around float ops",
                "float": f"float: removed {done}"}.get(what, f"{what}: {done}")
        if self.kept:
            reasons = Counter(self.kept.values())
            line += "; kept as Q/DQ: " + "; ".join(f"{why} x{n}" for why, n in sorted(reasons.items()))
        if self.left:
            line += "; left as they are (weight-only or dynamic kernels): " + ", ".join(
                f"{op} x{n}" for op, n in sorted(self.left.items()))
        return line


def constant_size(value: ir.Value) -> int | None:
    """The number of elements of a constant `value`; None when it is not constant."""
    array = constant_array(value)
    return None if array is None else int(array.size)


def channel_axis(qop: QOp, node: ir.Node) -> int | None:
    """The axis of the weight (input 1) along which the kernel takes per-channel scales."""
    if qop.op == "Gemm":
        trans = node.attributes.get("transB")
        return 0 if trans is not None and trans.as_int() else 1
    if qop.op == "MatMul":
        weight = node.inputs[1]
        return 1 if weight.shape is not None and weight.shape.rank() == 2 else None
    return 0


def same_scales(have: np.ndarray, want: np.ndarray) -> bool:
    """Whether a bias's scales equal the wanted ones: one value for all, or one per channel
    (a single channel's [1] and () both count as one)."""
    have, want = np.ravel(have), np.ravel(want)
    return have.size in (1, want.size) and bool(np.allclose(np.broadcast_to(have, want.shape), want,
                                                             rtol=1e-5, atol=0))


def bias_scale(node: ir.Node, x_scale: ir.Value, w_scale: ir.Value) -> np.ndarray | None:
    """The scale an int32 bias must have: input scale x weight scale (x alpha for Gemm)."""
    arrays = [constant_array(x_scale), constant_array(w_scale)]
    if any(a is None for a in arrays):
        return None
    alpha = node.attributes.get("alpha")
    scale = arrays[0].astype(np.float32) * arrays[1].astype(np.float32)
    if alpha is not None:
        scale = scale * np.float32(alpha.as_float())
    return scale.reshape(-1) if scale.size > 1 else scale.reshape(())


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Make `new` take the place of `old` for its readers (graph outputs too) and its name."""
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = None
    new.name = name
