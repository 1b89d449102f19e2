"""Which passes and algorithms a run applies, in which order, on the data it can read.

The rules come from the registered contracts (`optimize/registry.py`), never from names:
an algorithm whose contract `runs_last` goes after the others; one that needs another
read of data the run cannot read again is skipped with a note naming the fix; the target
adds the algorithms whose contract has a `target_default`; an algorithm whose `equalize`
option asks for it gets the equalizing pass before calibration.
"""

from __future__ import annotations

import onnx_ir as ir

from onnxq.calibrate.access import Access, refusal
from onnxq.config.spec import Config
from onnxq.notes import Note, Topic
from onnxq.optimize.registry import (
    Entry,
    equalizing_pass,
    parse_passes,
    target_defaults,
)
from onnxq.optimize.runner import equalizing_algorithm, in_contract_order, without_another_read
from onnxq.plan import Kind, QuantPlan, plan_quantization
from onnxq.target import TargetProfile


def configured_algorithms(config: Config, configured: tuple[Entry, ...], target: TargetProfile, plan: QuantPlan,
                          access: Access) -> tuple[tuple[Entry, ...], list[Note]]:
    """The `configured` algorithms plus those the target adds for quantized Conv/Gemm
    layers (bias correction), static or weight-only where calibration data is given, in
    contract order, less those the data cannot serve; and a note on each such decision."""
    algorithms, moved = in_contract_order(configured)  # one of each exclusive kind: `validate_config`
    notes = [_moved_note(algorithms, moved)] if moved else []
    if access in (Access.ONCE, Access.FILES):
        algorithms, skipped = without_another_read(algorithms, refusal(access))
        notes.extend(skipped)
    # A static plan, or weight-only layers with data to correct them on: MobileNet-v1's int8
    # per-channel weights alone (W8_GROUP128's Convs) gave 16.3 dB logit SQNR and 83.88 top-1
    # (float 85.50, 800 images), with bias correction 28.6 dB and 85.62 (formats-and-targets.md).
    wanted = config.target_algorithms and (plan.calibrated_tensors() or access is not Access.NONE)
    dynamic = plan.nodes_for("dynamic")  # their kernels take no separate bias
    ops = {op for name, op in plan.quantized_nodes.items() if name not in dynamic}
    added = [e for e in (target_defaults(algorithms) if wanted else ()) if ops & set(e.op_types)]
    # Alone (first), an added algorithm takes its statistics from the calibration pass (or
    # the statistics files); after other algorithms it must read the data again.
    enabled = [e for e in algorithms if e.enabled]
    served = access.rereadable if enabled else (access.readable or access is Access.FILES)
    if added and not served:
        why = refusal(access, " and other algorithms read it first" if access is Access.ONCE else "")
        notes.append(Note(Topic.TARGET, f"target {target.name} would add {', '.join(e.name for e in added)} to "
                          f"remove the rounded weights' mean error, but {why}"))
        return algorithms, notes
    notes.extend(Note(Topic.TARGET, f"target {target.name} adds {e.name} ({', '.join(e.op_types)}) to remove the "
                      "rounded weights' mean error per channel; target_algorithms: false turns it off", source=e.name)
                 for e in added)
    return algorithms + tuple(added), notes


def _moved_note(algorithms: tuple[Entry, ...], moved: list[str]) -> Note:
    last = next(e.name for e in algorithms if e.enabled and e.contract.runs_last)
    they, s = ("it", "s") if len(moved) == 1 else ("they", "")
    return Note(Topic.RECIPE, f"{last} runs after {', '.join(moved)}: it removes the error {they} leave{s}, "
                f"and its corrected biases would shift the float model {they} fit{s} to", source=last)


def with_equalization(model: ir.Model, config: Config, passes: tuple[Entry, ...], algorithms: tuple[Entry, ...],
                      target: TargetProfile) -> tuple[tuple[Entry, ...], list[Note]]:
    """The configured `passes`, plus the equalizing pass (CLE) where one of the configured
    `algorithms` wants it (its `equalize` option) and no entry of that pass decides it
    already."""
    equalizer = equalizing_pass()
    if equalizer is None or any(p.name == equalizer for p in passes) or equalizing_algorithm(algorithms, True) is None:
        return passes, []  # nothing would ask for it: no planning pass spent finding out
    plan = plan_quantization(model, config, {}, target)
    per_tensor = any(t.kind is Kind.WEIGHT and t.axis is None and not t.block_size
                     and any(plan.quantized_nodes.get(n) in ("Conv", "Gemm") for n, _ in t.consumers)
                     for t in plan.tensors.values())
    name = equalizing_algorithm(algorithms, per_tensor)
    if name is None:
        return passes, []
    note = Note(Topic.RECIPE, f"{name} adds {equalizer} before calibration (per-tensor Conv/Gemm weights); "
                f"equalize: never, or a {equalizer} entry with enabled: false, turns it off", source=name)
    return (*passes, *parse_passes([{"name": equalizer}])), [note]

