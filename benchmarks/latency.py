#!/usr/bin/env python
"""How fast the quantized models run against float: onnxq's default output, its latency plan
(`optimize_for: latency`, searched afresh: the cache of earlier runs is not read),
onnxruntime's `quantize_static` and `quantize_dynamic` outputs, on every real model of
../shared.

    python benchmarks/latency.py                         # all three models
    python benchmarks/latency.py --models mobilenet --profile

Latency: median ms per `session.run` of default onnxruntime sessions (fused int8 kernels),
all rows' sessions taking turns in blocks, at batch 1 and 8 with one thread and with every core. The
table prints each row's speed-up over float (float ms / row ms: above 1 is faster) and its
metric in a default session. `--profile` adds, per row, the share of kernel time of each
op type at batch 8 on every core (onnxruntime's profiler): where int8 gains, where it
loses, and what the Q/DQ boundaries cost. The first line says the CPU and whether it has
VNNI (AVX2 CPUs without VNNI run u8s8 products at half VNNI's rate; `--target x86-avx2`
does not stand in for timing).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import deployed as D
import numpy as np
import onnx

from onnxq.emit.latency import kernel_ms
from onnxq.parallel import cpu_count

VARIANTS = ("default", "latency", "ort", "ort_dyn")


def op_profile(path: str, feeds: dict[str, np.ndarray], threads: int) -> dict[str, float]:
    """Share (%) of kernel time per op type at batch 8 (`onnxq.emit.latency.kernel_ms`)."""
    graph = onnx.load(path, load_external_data=False).graph
    names = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    spent = kernel_ms(path, {k: v[:8] for k, v in feeds.items() if k in names}, ["CPUExecutionProvider"], threads)
    total = sum(spent.values()) or 1
    return {op: 100.0 * t / total for op, t in sorted(spent.items(), key=lambda item: -item[1])}


def speed_table(name: str, metric: str, rows: dict[str, dict[str, Any]], keys: list[str]) -> str:
    head = (f"{name} ({metric} in a default session; ms median, sessions taking turns; x: float ms / row ms)\n"
            f"{'row':<9} {'metric':>7} " + " ".join(f"{k[:-3]:>15}" for k in keys))
    fl = rows["float"]

    def line(row: str, r: dict[str, Any], metric_float: float) -> str:
        cells = []
        for k in keys:
            ms, base = r.get(k), fl.get(k)
            speed = f"{base / ms:.2f}x" if isinstance(ms, float) and isinstance(base, float) and ms else "-"
            cells.append(f"{C.fmt(ms, '8.2f')} {speed:>6}")
        return f"{row:<9} {C.fmt(r['deployed'], '7.2f')} " + " ".join(cells)

    return D.table(head, rows, line)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    profile = "--profile" in argv
    argv = [a for a in argv if a != "--profile"]
    args = D.parse_args(argv)
    if "--variants" not in argv:
        args.variants = list(VARIANTS)
    every = cpu_count()
    threads = (1, every) if every > 1 else (1,)
    keys = [f"b{b}_ms" if n == 1 else f"b{b}_t{n}_ms" for b in (1, 8) for n in threads]
    if not args.worker:
        print(C.cpu_line())

    def each_task(task: CO.Task, workdir: Path) -> list[tuple[str, dict[str, Any], str]]:
        rows = D.bench_task(task, args, workdir, threads)
        text = speed_table(task.name, task.metric_name, rows, keys)
        if profile:
            paths = {"float": str(task.model), **{v: str(workdir / f"{task.name}.{v}.onnx") for v in args.variants}}
            for row, path in paths.items():
                if row in rows and Path(path).exists():
                    shares = op_profile(path, task.eval_feeds, every)
                    rows[row]["op_share"] = shares
                    top = ", ".join(f"{op} {share:.0f}%" for op, share in list(shares.items())[:6])
                    text += f"\n  {row} ops at b8, {every} threads: {top}"
        return [(task.name, rows, text)]

    # The latency plan searched afresh, not read from the user's cache of earlier runs.
    before = os.environ.get("ONNXQ_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="onnxq-latency-bench-") as cache:
        os.environ["ONNXQ_CACHE_DIR"] = cache
        try:
            return D.run_shared("latency", args, None, each_task)
        finally:
            if before is None:
                os.environ.pop("ONNXQ_CACHE_DIR", None)
            else:
                os.environ["ONNXQ_CACHE_DIR"] = before


if __name__ == "__main__":
    sys.exit(main())
