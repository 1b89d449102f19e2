"""Convert nodes to compute in float16 or bfloat16 (the `float16` / `bfloat16` dtypes).

How a node assigned a float target is handled, in order:

1. Static checks. Ops outside the default domain, with subgraphs, whose output type is set
   by an attribute (`dtype`), in `keep_float32_ops` (numerically sensitive), whose ONNX
   schema does not accept the target type, or with a constant input outside its range stay
   in float32. The tensors a node converts are those bound to the type constraint of its
   float32 outputs (`T` of Conv, `T1` of Resize); auxiliary inputs with their own constraint
   (Resize roi/scales, BatchNormalization statistics) keep their type.
2. Kernel probe. Each (op, type signature) is built into a one-node model and loaded in
   onnxruntime with `providers` (cached per call). A missing kernel keeps the op in float32.
   On CPU, onnxruntime loads float16 nodes that have no float16 kernel by inserting Casts
   around them and computing in float32; the probe sees those Casts in the optimised probe
   graph and also keeps such ops in float32 (unless `accept_runtime_upcast`), so that
   `converted` only names nodes that really compute in the target type.
3. Islands. Connected groups of converted nodes that only move data (Reshape, Transpose,
   Concat, ...) and touch no converted compute node or weight are left in float32:
   converting them would only add Casts.
4. Rewrite and check. The plan is applied to a clone and loaded in onnxruntime; if loading
   fails with "Could not find an implementation for <Op>(<ver>) node with name '<n>'", that
   op type goes back to float32 and the plan is rebuilt (at most one round per op type).
   The accepted plan is then applied to the model in place.

The rewrite stores float32 initializers used only by converted nodes in the target type.
Weights (>= STORAGE_MIN_ELEMENTS) of nodes assigned the target but kept in float32 for want
of a kernel or schema support are stored in the target type too, with a Cast back to
float32 ("weights stored as <dtype>, compute in float32"): the file still halves and
onnxruntime folds those Casts when it loads the model. A weight also read by a float32
node stays float32 once and is cast for the converted readers (smaller than a duplicate).
One shared Cast per (tensor, type) sits at every boundary, graph inputs and outputs keep
their types, and lossless Cast chains are folded.

onnxruntime 1.31 CPU on x86 has float16 kernels only for data movement (Reshape,
Transpose, Concat, Slice, Gather, ...), Clip, Max, Min, Round, Sign and
LayerNormalization, and bfloat16 kernels only for data movement, Sign and
LayerNormalization: there the result is mostly storage-only. `providers=()` skips the
runtime entirely and converts every eligible node (for models meant for other runtimes).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir
import onnxruntime as ort

from onnxq.config.spec import Config, DType
from onnxq.emit.float_cast.eligibility import DEFAULT_KEEP_FLOAT32, CastPlan, plan_casts
from onnxq.emit.float_cast.probe import KernelProbe, first_line, session_error
from onnxq.emit.float_cast.rewrite import Rewriter
from onnxq.emit.float_cast.types import TARGETS
from onnxq.emit.loadcheck import Trial, find_culprits
from onnxq.emit.lowering import LoweringReport, register_lowering
from onnxq.errors import OnnxqError

__all__ = ["DEFAULT_KEEP_FLOAT32", "FloatCastReport", "convert_float_nodes"]

_CANNOT_LOAD = "onnxruntime cannot load"


@dataclass
class FloatCastReport:
    """What `convert_float_nodes` did.

    `converted` nodes compute in their target type; `kept_float32` maps every other
    assigned node to the reason; `storage_only` names those of them whose weights are
    nevertheless stored in the target type (compute in float32 after a Cast).
    """

    converted: list[str] = field(default_factory=list)
    kept_float32: dict[str, str] = field(default_factory=dict)
    casts_inserted: int = 0
    storage_only: dict[str, str] = field(default_factory=dict)  # node -> dtype of its weights
    no_float: list[str] = field(default_factory=list)  # assigned nodes without float32 tensors
    initializers: dict[str, str] = field(default_factory=dict)  # weight -> stored dtype
    bytes_saved: int = 0
    compute_dtypes: dict[str, str] = field(default_factory=dict)  # converted node -> dtype
    notes: list[str] = field(default_factory=list)

    def summary_line(self) -> str:
        by_type: dict[str, int] = {}
        for dtype in self.compute_dtypes.values():
            by_type[dtype] = by_type.get(dtype, 0) + 1
        computed = ", ".join(f"{n} in {t}" for t, n in sorted(by_type.items())) or "none"
        if not self.converted and not self.kept_float32 and self.no_float:
            return (f"float cast: nothing to convert: none of the {len(self.no_float)} nodes it covers has a float32 "
                    "tensor (the model is already in a half type; the cast converts float32 ops: export the model "
                    "in float32 for another type)")
        # the nodes without a float32 tensor are in no other list (a transformer's counts had
        # not added up), counted here rather than listed as left in float (MiniLM: 130)
        integer = f"; {len(self.no_float)} without a float32 tensor (integer shape and index arithmetic) left as " \
                  "they are" if self.no_float else ""
        return (
            f"float cast: nodes computing {computed}; {len(self.kept_float32)} kept in float32 "
            f"({len(self.storage_only)} with weights stored in the target type); "
            f"{len(self.initializers)} weights converted ({self.bytes_saved / 1024:.1f} KiB saved); "
            f"{self.casts_inserted} Casts inserted{integer}"
        )


def _node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _assigned(model: ir.Model, nodes: Mapping[str, DType | str], report: FloatCastReport) -> dict[int, ir.DataType]:
    """Node index -> target type, in graph order; unknown names become a note."""
    wanted: dict[str, ir.DataType] = {}
    for name, dtype in nodes.items():
        if DType(dtype) not in TARGETS:
            raise ValueError(f"node {name!r}: {dtype} is not a float target (float16 or bfloat16)")
        wanted[name] = TARGETS[DType(dtype)]
    assigned, seen = {}, set()
    for i, node in enumerate(model.graph):
        if node.name in wanted:
            assigned[i] = wanted[node.name]
            seen.add(node.name)
    missing = [name for name in wanted if name not in seen]
    if missing:
        report.notes.append(f"float cast: {len(missing)} assigned nodes not in the graph: {', '.join(missing[:5])}")
    return assigned


def _available(providers: Sequence[str], report: FloatCastReport) -> list[str]:
    available = set(ort.get_available_providers())
    usable = [p for p in providers if p in available]
    skipped = [p for p in providers if p not in available]
    if skipped:
        report.notes.append(f"float cast: {', '.join(skipped)} not available; kernels checked without them")
    if providers and not usable:
        usable = ["CPUExecutionProvider"]
    return usable


def _settle(
    model: ir.Model,
    assigned: dict[int, ir.DataType],
    keep: frozenset[str],
    providers: list[str],
    accept_upcast: bool,
    tensors: dict[tuple[str, ir.DataType], ir.Tensor],
    report: FloatCastReport,
) -> CastPlan:
    """Plan, rewrite a clone and load it. If onnxruntime refuses it, find the (op type,
    target) pairs to keep in float32 by bisection (`loadcheck.find_culprits`): each trial
    loads a rewrite with some pairs excluded, so no decision reads the error text."""
    with tempfile.TemporaryDirectory(prefix="onnxq_float_cast_") as tmp:
        workdir = Path(tmp)
        if not providers:
            return plan_casts(model, assigned, keep, None, {})
        probe = KernelProbe(model, providers, workdir, accept_upcast)
        where = ", ".join(providers)

        def trial(excluded: set) -> Trial:
            reasons = {g: f"no {g[1].name.lower()} kernel in {where}" for g in excluded}
            trial_plan = plan_casts(model, assigned, keep, probe, reasons)
            copy = model.clone()
            Rewriter(copy, trial_plan, tensors).run()
            return Trial(copy, session_error(copy, providers, workdir) is None, trial_plan)

        first = trial(set())
        if first.loads:
            return first.payload
        if session_error(model, providers, workdir) is not None:
            report.notes.append(f"float cast: {_CANNOT_LOAD} the model before conversion; runtime check skipped")
            return first.payload
        nodes = list(model.graph)
        groups = list(dict.fromkeys((nodes[i].op_type, t) for i, (t, _) in first.payload.compute.items()))
        try:
            final, _ = find_culprits(groups, trial)
        except OnnxqError:
            error = session_error(first.model, providers, workdir)
            raise RuntimeError(f"float cast: {_CANNOT_LOAD} the converted model: {first_line(error or '')}") from None
        return final.payload


def convert_float_nodes(
    model: ir.Model,
    nodes: Mapping[str, DType],
    keep_float32_ops: Iterable[str] = DEFAULT_KEEP_FLOAT32,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    accept_runtime_upcast: bool = False,
) -> FloatCastReport:
    """Make the named nodes compute in float16 / bfloat16 where `providers` can; in place.

    `nodes` maps node names to DType.FLOAT16 or DType.BFLOAT16. Graph inputs and outputs
    keep their types. Nodes that stay in float32 are reported with the reason; weights of
    assigned nodes without a kernel are still stored in the target type. With empty
    `providers` nothing is checked in onnxruntime: every eligible node is converted.
    `accept_runtime_upcast` keeps float16 nodes that onnxruntime can only run by inserting
    Casts around them (CPU), for models meant for another runtime.
    """
    report = FloatCastReport()
    assigned = _assigned(model, nodes, report)
    if not assigned:
        return report
    keep = frozenset(keep_float32_ops)
    tensors: dict[tuple[str, ir.DataType], ir.Tensor] = {}
    plan = _settle(model, assigned, keep, _available(providers, report), accept_runtime_upcast, tensors, report)
    node_list = list(model.graph)
    rewriter = Rewriter(model, plan, tensors)
    rewriter.run()
    _fill_report(report, node_list, plan, rewriter)
    return report


def _fill_report(report: FloatCastReport, nodes: list[ir.Node], plan: CastPlan, rewriter: Rewriter) -> None:
    for i, (target, _) in plan.compute.items():
        label = _node_label(nodes[i], i)
        report.converted.append(label)
        report.compute_dtypes[label] = target.name.lower()
    for name, (target, saved) in rewriter.converted_weights.items():
        report.initializers[name] = target.name.lower()
        report.bytes_saved += saved
    for i in sorted(plan.kept):
        label, reason = _node_label(nodes[i], i), plan.kept[i]
        if i in rewriter.storage_nodes:
            dtype = plan.storage[i][0].name.lower()
            report.storage_only[label] = dtype
            reason += f"; weights stored as {dtype}, compute in float32"
        report.kept_float32[label] = reason
    report.no_float = [_node_label(nodes[i], i) for i in plan.no_float]
    report.casts_inserted = len(rewriter.inserted)


@register_lowering("float_target", order=40)
def _lower(model: ir.Model, nodes: Mapping[str, DType], config: Config, weights: object = None) -> LoweringReport:
    keep = (*DEFAULT_KEEP_FLOAT32, *config.float_op_types)
    report = convert_float_nodes(model, nodes, keep, config.calibration.providers)
    return LoweringReport(dict(report.kept_float32), list(report.converted), [report.summary_line(), *report.notes])
