"""Stage 4, emit: turn the plan into graph rewrites.

`emit_model` lowers the plan's tensors to QuantizeLinear/DequantizeLinear (`qdq`, static
integer and float8 types; float8 laid out and centred: `qdq_layout`, the steps trial
emissions share), then hands the nodes each strategy claimed to the lowering registered
for it (`lowering.LOWERINGS`: dynamic, MatMulNBits, GatherBlockQuantized,
float16/bfloat16); a tied embedding and LM head go first, together (`tied`). A node a
lowering refuses stays float; the plan returned says so.
In the QOperator format (`quant_format: qoperator`) the QDQ patterns then become
onnxruntime's integer kernels (`emit/qoperator.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import Config, QuantFormat
from onnxq.emit import (  # noqa: F401 (register lowerings)
    block_format,
    dynamic,
    float_cast,
    gather_block_quantized,
    matmul_nbits,
)
from onnxq.emit.cpu_layout import keep_layernorm_apart
from onnxq.emit.float_kernels import keep_float_kernels
from onnxq.emit.gather_rows import gather_before_dequantize
from onnxq.emit.lowering import ordered
from onnxq.emit.qdq import EmitReport
from onnxq.emit.qdq_layout import lay_out_qdq
from onnxq.emit.qoperator import to_qoperator
from onnxq.emit.tied import copied_notes, lower_tied
from onnxq.graph.edit import drop_unused_initializers
from onnxq.plan import QuantPlan
from onnxq.plan.params import WeightCache


@dataclass
class EmitResult:
    qdq: EmitReport
    plan: QuantPlan  # the plan as emitted: nodes a lowering refused are float in it
    notes: list[str] = field(default_factory=list)


def emit_model(
    model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]], config: Config,
    weights: WeightCache | None = None, cpu: bool = False,
    statistics: Mapping[Statistic, np.ndarray | None] | None = None,
) -> EmitResult:
    """Apply the QDQ lowering and every registered lowering the plan needs to `model`, in
    place (`weights`: weights the algorithms already quantized, not quantized again;
    `cpu`: the target runs onnxruntime's CPU provider, see `cpu_layout`; `statistics`: the
    calibration's, whose channel means centre float8 activations, `float8_center.py`)."""
    extended = config.quant_format == QuantFormat.QDQ_EXT
    copied = copied_notes(model, plan)
    laid = lay_out_qdq(model, plan, ranges, config.qdq_domain, weights, extended, statistics or {})
    result = EmitResult(laid.qdq, plan)
    if result.qdq.extended:
        result.notes.append(f"qdq-ext format: {result.qdq.extended} activations through OnnxqQuantizeDequantize; "
                            "run the model with onnxq.runtime.InferenceSession (onnxruntime-extensions)")
    # float8 Q/DQ laid out so onnxruntime's CPU optimiser keeps it exact (emit/float8.py).
    note = laid.float8.note() if laid.float8 is not None else None
    result.notes.extend([note] if note else [])
    if laid.centred:
        result.notes.append(f"float8: {laid.centred} activations centred per channel on their calibration mean "
                            "(float8's precision is relative: a channel's offset would cost its spread)")
    ops = {n.name: n.op_type for n in model.graph}  # of the claimed nodes, before any rewrite
    tied = lower_tied(model, plan, config, weights)
    result.plan = result.plan.with_quantized_nodes(tied.converted, ops)
    result.notes.extend([*copied, *tied.notes])
    for lowering in ordered():
        nodes = {name: spec for name, spec in plan.nodes_for(lowering.strategy).items() if name not in tied.converted}
        if not nodes:
            continue
        report = lowering.run(model, nodes, config, weights)
        result.plan = result.plan.with_quantized_nodes(report.converted, ops) \
            .with_float_nodes(report.skipped, ops)
        result.notes.extend(report.notes)
    if config.quant_format == QuantFormat.QOPERATOR:
        result.notes.append(to_qoperator(model).note("qoperator format"))
    # Float Conv/Gemm beside quantized ops stay float in onnxruntime (emit/float_kernels.py).
    note = keep_float_kernels(model).note()
    result.notes.extend([note] if note else [])
    gathered = gather_before_dequantize(model)
    if gathered:
        result.notes.append(f"{gathered} Gather{'s' if gathered > 1 else ''} of a quantized table read its integer "
                            "rows and dequantize only those (a DequantizeLinear before a Gather dequantized the whole "
                            "table every run; emit/gather_rows.py)")
    apart = keep_layernorm_apart(model) if cpu else 0
    if apart:
        result.notes.append(f"{apart} float Add -> LayerNormalization written as Sum: onnxruntime's CPU "
                            "SkipLayerNormalization fusion runs slower than the two ops (emit/cpu_layout.py)")
    drop_unused_initializers(model.graph)
    model.graph.sort()
    return result
