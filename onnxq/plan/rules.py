"""Which inputs and outputs of each op type are quantized, and how.

One table entry per op type; the planner reads it instead of branching on op types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import onnx_ir as ir

from onnxq.graph.layout import weight_in_axis, weight_out_axis


class OutputMode(Enum):
    OWN = "own"  # the output gets its own calibrated range
    SHARED = "shared"  # the output reuses the range of input 0 (data movement, max)


def pads_with_zero_or_edges(node: ir.Node) -> bool:
    """Pad's output stays within its input's range (plus 0) unless it pads a nonzero constant."""
    attr = node.attributes.get("mode")
    if attr is not None and attr.as_string() != "constant":
        return True
    value = node.inputs[2] if len(node.inputs) > 2 else None
    if value is None:
        return True
    return value.const_value is not None and float(value.const_value.numpy().reshape(-1)[0]) == 0.0


@dataclass(frozen=True)
class OpRule:
    """How to quantize one op type.

    activation_inputs: input indices quantized as activations (None: all inputs).
    weight_input / bias_input: indices of the weight and bias when they are constants.
    weight_axis: the output-channel axis of the weight, for per-channel quantization.
    weight_in_axis: the input-channel (reduction) axis, along which per-group blocks run.
    Both come from `onnxq.graph.layout`, which knows every weighted op's geometry.
    output: OWN (calibrated) or SHARED (same parameters as input 0).
    """

    activation_inputs: tuple[int, ...] | None
    output: OutputMode
    weight_input: int | None = None
    bias_input: int | None = None
    weight_axis: Callable[[ir.Node, int], int] | None = None
    weight_in_axis: Callable[[ir.Node, int], int] | None = None
    # SHARED ops: a constant float data input (an embedding table) is quantized with the
    # activation spec and the output reuses its parameters.
    quantize_constant_data: bool = False
    # Extra condition on the node (attributes, constant inputs); None: always applies.
    applies: Callable[[ir.Node], bool] | None = None
    # The fused integer kernel can write float (onnxruntime's QGemm, MatMulIntegerToFloat):
    # an output that only float ops read needs no QuantizeLinear.
    float_output: bool = False


_SHARED = OpRule(activation_inputs=(0,), output=OutputMode.SHARED)

OP_RULES: dict[str, OpRule] = {
    "Conv": OpRule((0,), OutputMode.OWN, 1, 2, weight_out_axis, weight_in_axis),
    "ConvTranspose": OpRule((0,), OutputMode.OWN, 1, 2, weight_out_axis, weight_in_axis),
    "Gemm": OpRule(
        (0, 1), OutputMode.OWN, 1, 2, weight_out_axis, weight_in_axis, float_output=True
    ),
    "MatMul": OpRule(
        (0, 1), OutputMode.OWN, 1, None, weight_out_axis, weight_in_axis, float_output=True
    ),
    "Add": OpRule(None, OutputMode.OWN),
    "Mul": OpRule(None, OutputMode.OWN),
    "Concat": OpRule(None, OutputMode.OWN),
    "AveragePool": OpRule((0,), OutputMode.OWN),
    "GlobalAveragePool": OpRule((0,), OutputMode.OWN),
    # Elementwise ops with integer kernels (QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax);
    # Softmax stays float unless configured (Config.float_op_types).
    "Sigmoid": OpRule((0,), OutputMode.OWN),
    "LeakyRelu": OpRule((0,), OutputMode.OWN),
    "Softmax": OpRule((0,), OutputMode.OWN),
    "MaxPool": _SHARED,
    "GlobalMaxPool": _SHARED,
    "Resize": _SHARED,
    "Reshape": _SHARED,
    "Flatten": _SHARED,
    "Transpose": _SHARED,
    "Squeeze": _SHARED,
    "Unsqueeze": _SHARED,
    "Slice": _SHARED,
    "Split": _SHARED,
    # An embedding table: rows are its channels, blocks run along the embedding dimension.
    "Gather": OpRule(
        (0,), OutputMode.SHARED, weight_input=0, weight_axis=weight_out_axis,
        weight_in_axis=weight_in_axis, quantize_constant_data=True,
    ),
    "Pad": OpRule((0,), OutputMode.SHARED, applies=pads_with_zero_or_edges),
    "Identity": _SHARED,
    "Dropout": _SHARED,
}

# Op types with integer kernels for dynamic quantization (activations quantized at run time).
DYNAMIC_OPS = {"MatMul", "Gemm", "Conv", "LSTM"}

# Activations that a preceding quantized op absorbs (calibrated after the activation).
FUSABLE_ACTIVATIONS = {"Relu", "Clip"}
