"""The float16/bfloat16 targets: their types, the slots of a node that carry its compute
type, and constants and type attributes cast to a target (read by eligibility, the kernel
probe and the rewrite alike)."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from onnxq.config.spec import DType

TARGETS: dict[DType, ir.DataType] = {
    DType.FLOAT16: ir.DataType.FLOAT16,
    DType.BFLOAT16: ir.DataType.BFLOAT16,
}
NUMPY_TYPES = {ir.DataType.FLOAT16: np.dtype(np.float16), ir.DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


@dataclass(frozen=True)
class Slots:
    """Input and output positions of a node that carry its compute type."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def fits(array: np.ndarray, target: ir.DataType) -> bool:
    """True when every finite value of `array` is inside the target type's range."""
    finite = np.abs(array[np.isfinite(array)]) if array.size else array
    return not finite.size or float(finite.max()) <= float(ml_dtypes.finfo(NUMPY_TYPES[target]).max)


def cast_array(array: np.ndarray, target: ir.DataType) -> np.ndarray:
    return np.asarray(array, dtype=np.float32).astype(NUMPY_TYPES[target])


def typed_attributes(node: ir.Node, target: ir.DataType) -> list[ir.Attr]:
    """New values of the attributes that fix the output type (Cast `to`, Constant `value`)."""
    if node.op_type == "Cast":
        return [ir.AttrInt64("to", int(target))]
    if node.op_type in ("ConstantOfShape", "Constant"):
        attr = node.attributes.get("value")
        array = attr.as_tensor().numpy() if attr is not None else np.zeros(1, np.float32)
        return [ir.AttrTensor("value", ir.Tensor(cast_array(array, target)))]
    return []
