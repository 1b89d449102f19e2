"""Stage 4, emit: turn the plan into graph rewrites, one emitter per strategy.

`emit_model` runs them in order: QDQ (static integer and float8 types), dynamic
(run-time activation quantization), MatMulNBits (weight-only int4 MatMul),
GatherBlockQuantized (int4 embedding lookups) and float targets (float16/bfloat16). A node an emitter refuses stays float, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from onnxq.config.spec import Config
from onnxq.emit.dynamic import emit_dynamic
from onnxq.emit.float8 import make_float8_deployable
from onnxq.emit.float_cast import DEFAULT_KEEP_FLOAT32, convert_float_nodes
from onnxq.emit.gather_block_quantized import emit_gather_block_quantized
from onnxq.emit.matmul_nbits import emit_matmul_nbits
from onnxq.emit.qdq import EmitReport, emit_qdq
from onnxq.numerics.qmath import is_float8
from onnxq.plan import QuantPlan


@dataclass
class EmitResult:
    qdq: EmitReport
    notes: list[str] = field(default_factory=list)


def _refused(plan: QuantPlan, model: ir.Model, skipped: dict[str, str]) -> None:
    """Record nodes an emitter left in float (they were planned as quantized)."""
    ops = {n.name: n.op_type for n in model.graph}
    for name, reason in skipped.items():
        plan.quantized_nodes.pop(name, None)
        plan.float_nodes[name] = (ops.get(name, "?"), reason)


def emit_model(
    model: ir.Model, plan: QuantPlan, ranges: dict[str, tuple[float, float]], config: Config
) -> EmitResult:
    """Apply every emitter the plan needs to `model`, in place."""
    result = EmitResult(emit_qdq(model, plan, ranges, config.qdq_domain))
    if any(is_float8(t.spec.dtype) for t in plan.tensors.values()):
        # Lay float8 Q/DQ out so onnxruntime's CPU optimiser keeps it exact (emit/float8.py).
        note = make_float8_deployable(model).note()
        result.notes.extend([note] if note else [])
    if plan.dynamic_nodes:
        report = emit_dynamic(model, plan.dynamic_nodes)
        _refused(plan, model, report.skipped)
        result.notes.extend(f"dynamic {name}: {note}" for name, note in report.notes.items())
    if plan.nbits_nodes:
        _refused(plan, model, emit_matmul_nbits(model, plan.nbits_nodes))
    if plan.gather_nodes:
        _refused(plan, model, emit_gather_block_quantized(model, plan.gather_nodes))
    if plan.float_target_nodes:
        ops = {n.name: n.op_type for n in model.graph}
        keep = (*DEFAULT_KEEP_FLOAT32, *config.float_op_types)
        report = convert_float_nodes(model, plan.float_target_nodes, keep, config.calibration.providers)
        plan.quantized_nodes.update({name: ops.get(name, "?") for name in report.converted})
        _refused(plan, model, dict(report.kept_float32))
        result.notes.append(report.summary_line())
        result.notes.extend(report.notes)
    model.graph.sort()
    return result
