"""Compare a quantized model against its float original on the same inputs.

Metrics: SQNR (dB) and cosine similarity of every output, top-1 agreement for outputs
that look like class scores, and top-1 accuracy when labels are given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxq.calibrate.data import InputSpec, iter_batches
from onnxq.calibrate.session import check_providers, session_options


@dataclass
class OutputMetrics:
    name: str
    sqnr_db: float
    cosine: float
    top1_agreement: float | None = None


@dataclass
class Comparison:
    samples: int
    outputs: list[OutputMetrics] = field(default_factory=list)
    float_accuracy: float | None = None
    quant_accuracy: float | None = None


def sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical)."""
    noise = float(np.sum((ref.astype(np.float64) - test) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(max(signal, 1e-30) / noise)


def cosine(ref: np.ndarray, test: np.ndarray) -> float:
    a, b = ref.astype(np.float64).ravel(), test.astype(np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom else 1.0


def _inputs(session: ort.InferenceSession) -> list[InputSpec]:
    kinds = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(float16)": np.float16, "tensor(double)": np.float64, "tensor(uint8)": np.uint8,
             "tensor(bool)": np.bool_, "tensor(int8)": np.int8}
    specs = []
    for i in session.get_inputs():
        shape = tuple(d if isinstance(d, int) else None for d in i.shape)
        specs.append(InputSpec(i.name, np.dtype(kinds.get(i.type, np.float32)), shape))
    return specs


def compare_models(
    float_model: str | os.PathLike | bytes,
    quant_model: str | os.PathLike | bytes,
    data: Any,
    labels: np.ndarray | None = None,
    max_samples: int | None = None,
    batch_size: int = 32,
    providers: list[str] | None = None,
) -> Comparison:
    """Run both models on `data` (any calibration-data source) and compare their outputs."""
    providers = check_providers(providers or ["CPUExecutionProvider"])
    ref = ort.InferenceSession(str(float_model), session_options(), providers=providers)
    test = ort.InferenceSession(str(quant_model), session_options(), providers=providers)
    names = [o.name for o in ref.get_outputs()]
    refs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    tests: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in iter_batches(data, _inputs(ref), batch_size, max_samples):
        for n, r, t in zip(names, ref.run(names, feed), test.run(names, feed)):
            refs[n].append(r)
            tests[n].append(t)
    result = Comparison(samples=sum(len(r) for r in refs[names[0]]))
    for n in names:
        r, t = np.concatenate(refs[n]), np.concatenate(tests[n])
        metrics = OutputMetrics(n, sqnr_db(r, t), cosine(r, t))
        if r.ndim == 2 and r.shape[1] > 1 and np.issubdtype(r.dtype, np.floating):
            metrics.top1_agreement = float(np.mean(r.argmax(1) == t.argmax(1)))
            if labels is not None and n == names[0]:
                y = np.asarray(labels)[: len(r)]
                result.float_accuracy = float(np.mean(r.argmax(1) == y))
                result.quant_accuracy = float(np.mean(t.argmax(1) == y))
        result.outputs.append(metrics)
    return result


def format_comparison(c: Comparison) -> str:
    lines = [f"compared on {c.samples} samples"]
    for m in c.outputs:
        extra = f", top-1 agreement {m.top1_agreement:.2%}" if m.top1_agreement is not None else ""
        lines.append(f"  {m.name}: SQNR {m.sqnr_db:.1f} dB, cosine {m.cosine:.5f}{extra}")
    if c.float_accuracy is not None:
        lines.append(f"  top-1 accuracy: float {c.float_accuracy:.2%}, quantized {c.quant_accuracy:.2%}")
    return "\n".join(lines)
