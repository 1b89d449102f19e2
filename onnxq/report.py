"""The quantization summary: what was quantized, what stayed float and why, and timings."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from onnxq.notes import Note, counted
from onnxq.plan.plan import INTEGER_ONLY


@dataclass(frozen=True)
class Promotion:
    """A layer the search raised, and how it ranked: the noise / signal of the model's first
    output with only that layer quantized (`analyze/impact.py`; NaN where the ranking's
    budget left it unmeasured), and the same as an SQNR (`output dB` in `onnxq analyze`)."""

    node: str
    rung: str
    relative_noise: float
    output_db: float | None = None


@dataclass
class MixedPrecisionSummary:
    """What the accuracy-target search measured, promoted and what that cost."""

    target: str
    met: bool
    float_score: float
    base_score: float  # every layer quantized
    final_score: float
    promotions: list[Promotion]
    ranked_layers: int
    evaluations: int  # models scored, the float and all-quantized ones included
    trials: list[dict[str, Any]]
    size_before: int
    size_after: int
    latency_ms_before: float  # batch 1, default session, median
    latency_ms_after: float
    seconds: float
    config: Any = None  # the resulting Config: node overrides, reusable without searching
    scored_on: str = "the eval data"  # what the scores were measured on
    rungs: list[dict[str, Any]] = field(default_factory=list)  # algorithm rungs tried (`search/climb.py`)
    algorithm_score: float | None = None  # all quantized, after the kept algorithm rungs
    # Where the target is not met: the best score any model scored, and the model written
    # in words (the best, or the cheapest as good within the noise: `search/unmet.py`)
    best_score: float | None = None
    written: str = ""


@dataclass
class Summary:
    """Everything a user needs to trust the result, printable with `format_summary`."""

    source: str = ""
    output: str | None = None
    opset: tuple[int, int] = (0, 0)
    target: str = ""
    quantized_by_op: dict[str, int] = field(default_factory=dict)
    float_nodes: dict[str, tuple[str, str]] = field(default_factory=dict)
    # quantized activations around a float weight: float arithmetic -> (op, why the weight is float)
    float_weight_nodes: dict[str, tuple[str, str]] = field(default_factory=dict)
    fused_activations: int = 0
    kept_activations: list[str] = field(default_factory=list)
    float_biases: list[str] = field(default_factory=list)
    calibration_samples: int = 0
    calibrated_tensors: int = 0
    calibration_passes: int = 1
    size_before: int = 0
    size_after: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)  # rendered at the end (`notes.py`)
    mixed_precision: MixedPrecisionSummary | None = None
    fidelity: Any = None  # emit.fidelity.Fidelity: the output check, when it ran
    latency: Any = None  # emit.latency.Latency: float against quantized, when measured
    # the algorithms that chose weights on the calibration data (`registry.fits_data`), those
    # that found nothing to change left out: what the check and the report say was fitted
    fitted_by: tuple[str, ...] = ()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + time.perf_counter() - start

    def rest_as(self, name: str, total: float) -> None:
        """Count as stage `name` what of `total` seconds no stage accounts for: a search's
        trials around the run whose stages this summary holds."""
        self.stage_seconds[name] = max(0.0, total - sum(v for k, v in self.stage_seconds.items() if k != name))

    @property
    def note_texts(self) -> list[str]:
        """The notes as the summary prints them."""
        return [note.text for note in self.notes]

# Fewer calibration samples than this get a warning in the summary.
FEW_SAMPLES = 8


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_summary(s: Summary) -> str:
    """A human-readable multi-line summary (of a `QuantizationResult`'s too: its `summary`)."""
    s = getattr(s, "summary", s)
    lines = [f"onnxq: {s.source} -> {s.output or '(not saved)'}"]
    if s.opset[0] != s.opset[1]:
        lines.append(f"  opset upgraded {s.opset[0]} -> {s.opset[1]}")
    if s.target:
        lines.append(f"  {s.target}")
    total_q = sum(s.quantized_by_op.values())
    by_op = ", ".join(f"{op} {n}" for op, n in sorted(s.quantized_by_op.items()))
    lines.append(f"  quantized nodes: {total_q} ({by_op})" if total_q else "  quantized nodes: 0")
    weights = Counter(s.float_weight_nodes.values())
    if weights:
        count = len(s.float_weight_nodes)
        lines.append(f"  float weights, quantized activations (float arithmetic): {count} node{'s' * (count != 1)}")
        lines.extend(f"    {op} x{n}: {why}" for (op, why), n in sorted(weights.items()))
    if s.fused_activations:
        lines.append(f"  Relu/Clip absorbed into the preceding op: {s.fused_activations}")
    if s.kept_activations:
        lines.append(f"  Relu/Clip kept (activation range not zero-based): {len(s.kept_activations)}")
    reasons = Counter((op, why) for op, why in s.float_nodes.values() if why != INTEGER_ONLY)
    integers = Counter(op for op, why in s.float_nodes.values() if why == INTEGER_ONLY)
    if reasons or integers:
        lines.append(f"  left in float: {len(s.float_nodes)} nodes")
        for (op, why), n in sorted(reasons.items()):
            lines.append(f"    {op} x{n}: {why}")
        if integers:  # shape and index arithmetic: one line
            lines.append(f"    {', '.join(f'{op} x{n}' for op, n in sorted(integers.items()))}: {INTEGER_ONLY}")
    for bias in s.float_biases:
        lines.append(f"  bias kept in float: {bias}")
    passes = f" in {s.calibration_passes} passes" if s.calibration_passes > 1 else ""
    n = s.calibration_samples
    if s.calibrated_tensors:
        lines.append(f"  calibration: {n} sample{'' if n == 1 else 's'}, {s.calibrated_tensors} tensors{passes}")
    elif n:  # weight-only layers' statistics (the target's bias correction): no activation range
        lines.append(f"  calibration: {n} sample{'' if n == 1 else 's'} for the algorithms' statistics{passes} (no "
                     "activation is quantized statically)")
    else:  # weight-only: an algorithm that reads data says how much in its own note ("none" read as no data read)
        lines.append("  calibration: no activation ranges (no activation is quantized statically)")
    if 0 < n < FEW_SAMPLES and s.calibrated_tensors:
        lines.append(f"  warning: activation ranges from {n} calibration sample{'' if n == 1 else 's'} rarely cover "
                     "what the model sees; pass about 100 or more representative samples, stacked along axis 0 "
                     "(an array without that axis is one sample)")
    if s.size_before:
        ratio = s.size_after / s.size_before if s.size_before else 0
        lines.append(f"  size: {_mb(s.size_before)} -> {_mb(s.size_after)} ({ratio:.0%})")
    timing = ", ".join(f"{k} {v:.2f}s" for k, v in s.stage_seconds.items())
    lines.append(f"  time: {timing}")
    if s.fidelity is not None:
        lines.append(f"  {s.fidelity.line()}")
        warning = s.fidelity.warning()
        if warning:
            lines.append(f"  warning: {warning}")
    if s.latency is not None:
        lines.extend(f"  {line}" for line in s.latency.lines())
    if s.mixed_precision is not None:
        lines.extend(format_mixed_precision(s.mixed_precision))
    lines.extend(f"  {n.text}" if n.text.startswith("warning: ") else f"  note: {n.text}" for n in s.notes)
    return "\n".join(lines)


def _precision_rung_lines(m: MixedPrecisionSummary) -> list[str]:
    """One line per precision rung the search tried (`search/bisect.py`): every ranked
    layer raised to it, then the fewest that meet the target."""
    lines = []
    for rung in dict.fromkeys(t["rung"] for t in m.trials):
        tried = [t for t in m.trials if t["rung"] == rung]
        first = tried[0]
        line = (f"  rung {rung}: {first['promoted']} layer{'' if first['promoted'] == 1 else 's'} raised: "
                f"{first['score']:.4g}{' (meets the target)' if first['met'] else ''}")
        meeting = [t for t in tried if t["met"]]
        if len(tried) > 1 and meeting:
            fewest = min(meeting, key=lambda t: t["promoted"])
            line += f"; fewest that meet: {fewest['promoted']} ({fewest['score']:.4g}), {len(tried)} models scored"
        lines.append(line)
    return lines


def format_mixed_precision(m: MixedPrecisionSummary) -> list[str]:
    verdict = "met" if m.met else "NOT met"
    lines = [f"  accuracy target {m.target}: {verdict} on {m.scored_on} (float {m.float_score:.4g}, all quantized "
             f"{m.base_score:.4g}, final {m.final_score:.4g}); {counted(m.evaluations, 'model')} scored for "
             f"{counted(m.ranked_layers, 'ranked layer')} in {m.seconds:.1f}s"]
    for t in m.rungs:
        if t["score"] is None:
            lines.append(f"  rung {t['rung']}: not tried: {t['why']}")
        else:
            lines.append(f"  rung {t['rung']}: {t['score']:.4g}{' (meets the target)' if t['met'] else ''}, "
                         f"{'kept' if t['kept'] else 'dropped'}, {t['seconds']:.1f}s: {t['why']}")
    lines.extend(_precision_rung_lines(m))
    if m.promotions:
        by_rung = Counter(p.rung for p in m.promotions)
        lines.append("  promoted: " + ", ".join(f"{n} to {r}" for r, n in sorted(by_rung.items())) + ": "
                     + ", ".join(p.node for p in m.promotions[:6]) + (", ..." if len(m.promotions) > 6 else ""))
        lines.append(f"  promotion cost: weights {_mb(m.size_before)} -> {_mb(m.size_after)}, latency (batch 1) "
                     f"{m.latency_ms_before:.2f} -> {m.latency_ms_after:.2f} ms")
    return lines


