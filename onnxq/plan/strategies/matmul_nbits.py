"""Weight-only block quantization of MatMul: com.microsoft::MatMulNBits (lowered by
`emit/matmul_nbits`), for configs with `matmul_nbits` and no activation quantization."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, ResolvedSpec
from onnxq.config.spec import Config, DType
from onnxq.graph.fold import constant_array
from onnxq.notes import Note, Topic
from onnxq.plan.draft import Draft
from onnxq.plan.plan import QuantPlan
from onnxq.plan.strategies.registry import Decision, Lower, register_strategy

BITS: dict[DType, int] = {DType.INT4: 4, DType.UINT4: 4, DType.INT8: 8, DType.UINT8: 8}
FLOAT_TYPES: dict[ir.DataType, type] = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


def weight_dtype(node: ir.Node) -> ir.DataType:
    weight = node.inputs[1]
    return weight.dtype if weight.dtype is not None else ir.DataType.FLOAT


def can_use_matmul_nbits(node: ir.Node, spec: ResolvedSpec) -> str | None:
    """Why `node` cannot become MatMulNBits with `spec`, or None when it can."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} is not a MatMul"
    if spec.dtype not in BITS:
        return f"weight dtype {spec.dtype} not supported by MatMulNBits (int4/uint4/int8/uint8)"
    block = spec.group_size
    if block is None:
        return f"the weights are {spec.qscheme.replace('_', '-')}, not in blocks (MatMulNBits takes per-group ones)"
    if block < 16 or block & (block - 1):
        return f"group_size {block} is not a power of two >= 16, as MatMulNBits' block_size must be"
    w = constant_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if w is None:
        return "weight (input 1) is not a constant"
    if w.ndim != 2:
        return f"weight has rank {w.ndim}; MatMulNBits takes a rank-2 weight"
    if w.shape[0] < 1 or w.shape[1] < 1:
        return f"weight shape {w.shape} is empty"
    if weight_dtype(node) not in FLOAT_TYPES:
        return f"weight is {weight_dtype(node)}; MatMulNBits takes float32 or float16"
    a = node.inputs[0]
    if a.dtype is not None and a.dtype != weight_dtype(node):
        return f"input is {a.dtype} but the weight is {weight_dtype(node)}"
    if a.shape is not None and len(a.shape) < 2:
        return "input has rank < 2; MatMulNBits needs A of rank >= 2"
    return None


def row_block(spec: ResolvedSpec, length: int) -> ResolvedSpec:
    """`spec` for rows of `length` stored in blocks: a block past the row's end is the whole
    row either way (one scale, the same codes), so it is narrowed to the next power of two
    from 16 that holds the row, which pads less (SmolLM2 in blocks of 4096, K = 576 and
    1536: a 340 MB file, against 82 MB in blocks of 128; LLM trial)."""
    block = spec.group_size
    if not block or block <= length:
        return spec
    return dataclasses.replace(spec, group_size=max(16, 1 << (max(length, 1) - 1).bit_length()))


# The refusal that costs no speed: 8-bit static inputs run in onnxruntime's integer MatMul.
INTEGER_INPUTS = "its inputs are static 8-bit, which onnxruntime runs in its integer MatMul (MatMulNBits takes float)"


@register_strategy("matmul_nbits", order=50)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    """Lower a weight-only MatMul to MatMulNBits; where `matmul_nbits` is asked for a
    MatMul with a constant weight but cannot be had, say why (the plan's `nbits_refused`:
    it runs as DequantizeLinear + MatMul, far slower for an LLM)."""
    if not draft.config.matmul_nbits or cfg.weight is None or node.op_type != "MatMul" \
            or constant_array(node.inputs[1] if len(node.inputs) > 1 else None) is None:
        return None
    act = cfg.input_tensors
    if act is None:
        why = can_use_matmul_nbits(node, cfg.weight)
    elif act.dtype in (DType.INT8, DType.UINT8) and not act.is_dynamic:
        why = INTEGER_INPUTS
    else:
        why = "its input is quantized too (MatMulNBits takes float inputs)"
    if why is None:
        return Lower(row_block(cfg.weight, constant_array(node.inputs[1]).shape[0]))
    draft.nbits_refused[node.name] = why
    return None


def refused_note(plan: QuantPlan, config: Config) -> Note | None:
    """The summary's word where `matmul_nbits` was asked for and MatMuls did not get it: a
    warning for those left as DequantizeLinear + MatMul (how many, the commonest reason),
    a note for those that run as integer MatMuls instead or where the model has none to
    lower; with none lowered, that the accuracy level is unused."""
    if not config.matmul_nbits:
        return None
    lowered = len(plan.nodes_for("matmul_nbits"))
    unused = f"; accuracy_level {config.accuracy_level} is unused" if config.accuracy_level and not lowered else ""
    slow = {n: why for n, why in plan.nbits_refused.items() if why != INTEGER_INPUTS}
    integer = tuple(n for n, why in plan.nbits_refused.items() if why == INTEGER_INPUTS)
    if slow:
        (why, count), *_ = Counter(slow.values()).most_common()
        return Note(Topic.WARNING, f"warning: matmul_nbits: {len(slow)} MatMul not lowered to MatMulNBits, so they "
                    f"run as DequantizeLinear + MatMul, far slower ({count} because {why}; {lowered} lowered){unused}",
                    tuple(slow))
    if integer:
        return Note(Topic.EMISSION, f"matmul_nbits: {len(integer)} MatMul not lowered to MatMulNBits: "
                    f"{INTEGER_INPUTS}{unused}", integer)
    return None if lowered else Note(Topic.EMISSION, f"matmul_nbits: the model has no MatMul with a constant weight "
                                     f"to lower{unused}")
