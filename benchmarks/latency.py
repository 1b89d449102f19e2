#!/usr/bin/env python
"""How fast the quantized models run against float: onnxq's default output, onnxruntime's
`quantize_static` and `quantize_dynamic` outputs, on every real model of ../shared.

    python benchmarks/latency.py                         # all three models
    python benchmarks/latency.py --models mobilenet --profile

Latency: median ms per `session.run` of default onnxruntime sessions (fused int8 kernels),
all rows' sessions interleaved, at batch 1 and 8 with one thread and with every core. The
table prints each row's speed-up over float (float ms / row ms: above 1 is faster) and its
metric in a default session. `--profile` adds, per row, the share of kernel time of each
op type at batch 8 on every core (onnxruntime's profiler): where int8 gains, where it
loses, and what the Q/DQ boundaries cost. The first line says the CPU and whether it has
VNNI (AVX2 CPUs without VNNI run u8s8 products at half VNNI's rate; `--target x86-avx2`
does not stand in for timing).
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import deployed as D
import numpy as np

from onnxq.parallel import cpu_count

VARIANTS = ("default", "ort", "ort_dyn")


def op_profile(path: str, feeds: dict[str, np.ndarray], threads: int, runs: int = 5) -> dict[str, float]:
    """Share (%) of kernel time per op type over `runs` runs at batch 8."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "onnxq-latency")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    feed = {k: v[:8] for k, v in feeds.items() if k in names}
    session.run(None, feed)
    for _ in range(runs):
        session.run(None, feed)
    trace = Path(session.end_profiling())
    spent: collections.Counter[str] = collections.Counter()
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            spent[event["args"]["op_name"]] += event["dur"]
    trace.unlink()
    total = sum(spent.values()) or 1
    return {op: 100.0 * t / total for op, t in spent.most_common()}


def speed_table(name: str, metric: str, rows: dict[str, dict[str, Any]], keys: list[str]) -> str:
    head = (f"{name} ({metric} in a default session; ms median, interleaved; x: float ms / row ms)\n"
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

    return D.run_shared("latency", args, None, each_task)


if __name__ == "__main__":
    sys.exit(main())
