"""Config pairs onnxruntime's kernels cannot run, relaxed per node before the strategies
see them; each relaxation is recorded with its reason (the plan's `float_inputs`).

Per-group 8-bit MatMul weights with 8-bit integer inputs: onnxruntime fuses DequantizeLinear
on both inputs and the MatMul into MatMulIntegerToFloat, whose weight takes one scale per
column; on blocks shorter than the column it fails at run time ("Per-column quantization
parameter of batched matrix should have same dimension as the matrix", onnxruntime 1.32).
4-bit weights are not fused, nor are Gemm and Conv with blocked weights: they run. Such a MatMul keeps its quantized weight and reads
float inputs (weight-only: DequantizeLinear + MatMul, or MatMulNBits where the config asks).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.config.spec import DType, QScheme
from onnxq.graph.fold import constant_array
from onnxq.notes import Note, Topic
from onnxq.plan.plan import QuantPlan

# Input types onnxruntime fuses with DequantizeLinear'd weights into its integer MatMul.
_FUSED_INPUTS = (DType.INT8, DType.UINT8)


def blocked_integer_matmul(node: ir.Node, cfg: ResolvedConfig) -> str | None:
    """Why `node` cannot run with `cfg`'s static 8-bit inputs, or None where it can."""
    weight, act = cfg.weight, cfg.input_tensors
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or weight is None or act is None:
        return None
    if weight.qscheme != QScheme.PER_GROUP.value or act.is_dynamic or act.dtype not in _FUSED_INPUTS \
            or weight.dtype not in _FUSED_INPUTS:  # 4-bit weights are not fused: they run
        return None
    array = constant_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if array is None or array.ndim < 2 or (weight.group_size or 0) >= array.shape[-2]:
        return None  # one block per column is one scale per column: the kernel takes it
    return (f"per_group weights with {act.dtype.value} inputs: onnxruntime's integer MatMul takes one weight "
            "scale per column; per_channel weights keep the inputs integer")


def runnable(node: ir.Node, cfg: ResolvedConfig) -> tuple[ResolvedConfig, str | None]:
    """`cfg` as onnxruntime can run it on `node`, with the reason where it was relaxed."""
    why = blocked_integer_matmul(node, cfg)
    if why is None:
        return cfg, None
    return dataclasses.replace(cfg, input_tensors=None, output_tensors=None), why


def float_inputs_note(plan: QuantPlan) -> Note | None:
    """The summary's note on the nodes that read float inputs against the config: how many,
    and why (the commonest reason)."""
    if not plan.float_inputs:
        return None
    (why, _), *_ = Counter(plan.float_inputs.values()).most_common()
    count = len(plan.float_inputs)
    return Note(Topic.FLOAT, f"{count} MatMul{'s keep' if count != 1 else ' keeps'} float inputs, weight-only "
                f"({why})", tuple(plan.float_inputs))
