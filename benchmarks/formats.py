"""QDQ against QOperator against float32: accuracy in a default onnxruntime session and
CPU latency at batch 1 and 8 with 1 and 2 threads, on every real model of ../shared, in
one run, with onnxruntime's `quantize_static` in both formats as the reference.

    python benchmarks/formats.py                      # all three models
    python benchmarks/formats.py --models mobilenet resnet20

Rows: `float`; onnxq `default` (QDQ) and `qoperator` (`quant_format: qoperator`);
onnxruntime `ort` (QDQ) and `ort_qop` (QOperator), both U8S8 per-channel MinMax. Latency
is the median over interleaved sessions (benchmarks/deployed.py's `latency`). Ratios:
each onnxq row against onnxruntime's row of the same format.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import deployed as D

VARIANTS = ("default", "qoperator", "ort", "ort_qop")
BASELINE = {"default": "ort", "qoperator": "ort_qop"}
THREADS = (1, 2)
LATENCY = ("b1_ms", "b1_t2_ms", "b8_ms", "b8_t2_ms")


def format_table(name: str, metric: str, rows: dict[str, dict[str, Any]]) -> str:
    head = (f"{name} ({metric} in a default onnxruntime session; latency ms, median; ratios vs onnxruntime "
            "in the same format)\n"
            f"{'row':<10} {'metric':>8} {'vs float':>8} " + " ".join(f"{k[:-3]:>8}" for k in LATENCY)
            + f" {'MB':>6}  ratios (" + ", ".join(k[:-3] for k in LATENCY) + ")")

    def line(row: str, r: dict[str, Any], fl: float) -> str:
        base = rows.get(BASELINE.get(row, ""), {})
        ratios = ", ".join(D._ratio(r.get(k), base.get(k)) for k in LATENCY)
        return (f"{row:<10} {C.fmt(r['deployed'], '8.2f')} {C.fmt(r['deployed'] - fl, '+8.2f')} "
                + " ".join(C.fmt(r.get(k), "8.2f") for k in LATENCY)
                + f" {C.fmt(r.get('size_mb'), '6.2f')}" + (f"  {ratios}" if row in BASELINE else ""))

    return D.table(head, rows, line)


def main(argv: list[str] | None = None) -> int:
    args = D.parse_args(argv)
    args.variants = list(VARIANTS)

    def each_task(task: CO.Task, workdir: Path) -> list[tuple[str, dict[str, Any], str]]:
        rows = D.bench_task(task, args, workdir, THREADS)
        return [(task.name, rows, format_table(task.name, task.metric_name, rows))]

    return D.run_shared("formats", args, None, each_task)


if __name__ == "__main__":
    sys.exit(main())
