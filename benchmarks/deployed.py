"""Accuracy as deployed: every real model of ../shared, in one run, scored in a default
onnxruntime session (fused int8 kernels, what users get) and with reference kernels
(optimisation level basic: Q/DQ unfused, float arithmetic), for onnxq's default, onnxq's
per-target choices and onnxruntime's `quantize_static` with and without `reduce_range`.

    python benchmarks/deployed.py                     # all three models, about 10 min on 2 cores
    python benchmarks/deployed.py --models mobilenet --variants default ort ort_rr

Rows: `float`; onnxq `default` (target auto: pair-safe int8 weights where the kernels
saturate), `latency` (`optimize_for: latency`, the plan timed on this CPU), `8bit` (reduce_range false), `7bit`
(reduce_range true), `u8u8` (uint8 symmetric weights), `s8s8` (S8S8 preset), `bc` (default
plus bias correction), `pt_cle_bc` (per-tensor weights, CLE and bias correction),
`pt_cle_ebc` (the same with the empirical correction, layer by layer on the quantized
model's own inputs), `fp8` (the FP8_E4M3 preset: AdaRound on the float8 grid, first/last
layer inputs float), `fp8_fast` (the same with bias correction instead of AdaRound);
`avx2` / `pt_cle_ebc_avx2` (default / per-tensor CLE + empirical correction with target
x86-avx2 named: weights that never saturate there, so on any CPU the figure is the
AVX2 CPU's);
`ort` / `ort_rr` (quantize_static U8S8 per-channel MinMax, reduce_range off/on),
`ort_pt` (per-tensor), `ort_fp8` (float8 E4M3FN, Distribution calibration), `ort_dyn`
(quantize_dynamic, int8 per-channel weights). Columns: metric deployed and with reference kernels, latency at
batch 1 and 8 (median, sessions taking turns in blocks, 1 thread), quantize time and peak RSS of
the quantizer's own worker process; ratios against onnxruntime's row of the same
granularity. Each quantizer runs in a worker subprocess (`compare_ort` protocol).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import numpy as np

U8S8_WEIGHT = {"dtype": "int8", "symmetric": True, "qscheme": "per_channel"}
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"tool": "onnxq", "config": {}},
    "latency": {"tool": "onnxq", "config": {"optimize_for": "latency"}},
    "8bit": {"tool": "onnxq", "config": {"reduce_range": False}},
    "7bit": {"tool": "onnxq", "config": {"reduce_range": True}},
    "u8u8": {"tool": "onnxq", "config": {"global_quant_config": {"weight": {"dtype": "uint8"}}}},
    "s8s8": {"tool": "onnxq", "preset": "S8S8", "config": {}},
    "bc": {"tool": "onnxq", "config": {"algo_config": [{"name": "bias_correction"}]}},
    "pt_cle_bc": {"tool": "onnxq", "config": {
        "global_quant_config": {"weight": {"qscheme": "per_tensor"}},
        "pre_quant_opt_config": [{"name": "cle"}], "algo_config": [{"name": "bias_correction"}]}},
    "pt_cle_ebc": {"tool": "onnxq", "config": {
        "global_quant_config": {"weight": {"qscheme": "per_tensor"}},
        "pre_quant_opt_config": [{"name": "cle"}],
        "algo_config": [{"name": "bias_correction", "empirical": True}]}},
    # The AVX2 target's choices, measured on any CPU: its weights never saturate (pair-safe
    # per channel, uint8 per tensor), so a CPU with VNNI computes exactly what an AVX2 one
    # does (docs/kernels.md section 9).
    "avx2": {"tool": "onnxq", "config": {"target": "x86-avx2"}},
    "pt_cle_ebc_avx2": {"tool": "onnxq", "config": {
        "target": "x86-avx2", "global_quant_config": {"weight": {"qscheme": "per_tensor"}},
        "pre_quant_opt_config": [{"name": "cle"}],
        "algo_config": [{"name": "bias_correction", "empirical": True}]}},
    "ort": {"tool": "ort", "reduce_range": False, "per_channel": True},
    "ort_rr": {"tool": "ort", "reduce_range": True, "per_channel": True},
    "ort_pt": {"tool": "ort", "reduce_range": False, "per_channel": False},
    "qoperator": {"tool": "onnxq", "config": {"quant_format": "qoperator"}},
    "fp8": {"tool": "onnxq", "preset": "FP8_E4M3", "config": {}},
    "fp8_fast": {"tool": "onnxq", "preset": "FP8_E4M3", "config": {"algo_config": [{"name": "bias_correction"}]}},
    "ort_fp8": {"tool": "ort", "reduce_range": False, "per_channel": True, "type": "float8"},
    "ort_qop": {"tool": "ort", "reduce_range": False, "per_channel": True, "format": "qoperator"},
    "ort_dyn": {"tool": "ort", "reduce_range": False, "per_channel": True, "dynamic": True},
}
# Ratio rows: per-tensor against per-tensor, float8 against float8.
ORT_BASELINE = {"pt_cle_bc": "ort_pt", "pt_cle_ebc": "ort_pt", "fp8": "ort_fp8", "fp8_fast": "ort_fp8",
                "pt_cle_ebc_avx2": "ort_pt"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def quantize_job(job: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Worker side: quantize with onnxq or onnxruntime as the variant says."""
    variant = VARIANTS[job["variant"]]
    if variant["tool"] == "onnxq":
        import onnxq
        from onnxq.config import config_from_dict, config_to_dict, get_preset

        config = config_from_dict(_merge(config_to_dict(get_preset(variant.get("preset", "U8S8"))),
                                         variant["config"]))
        result = onnxq.quantize(job["model"], job["output"], config, arrays, progress=False)
        return {"summary": onnxq.format_summary(result.summary)}
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if variant.get("dynamic"):  # int8 weights, activations quantized at run time (no calibration)
        quantize_dynamic(job["model"], job["output"], weight_type=QuantType.QInt8,
                         per_channel=variant["per_channel"], reduce_range=variant["reduce_range"])
        return {}
    fmt = QuantFormat.QOperator if variant.get("format") == "qoperator" else QuantFormat.QDQ
    float8 = variant.get("type") == "float8"  # onnxruntime calibrates float8 by Distribution only
    types = (QuantType.QFLOAT8E4M3FN,) * 2 if float8 else (QuantType.QUInt8, QuantType.QInt8)
    quantize_static(job["model"], job["output"], C.FeedReader(arrays), quant_format=fmt,
                    activation_type=types[0], weight_type=types[1],
                    per_channel=variant["per_channel"], reduce_range=variant["reduce_range"],
                    calibrate_method=CalibrationMethod.Distribution if float8 else CalibrationMethod.MinMax)
    return {}


def run_worker(job_path: str, quantize: Any = None) -> int:
    """Worker side: load the job's calibration data, run `quantize(job, arrays)` (default
    `quantize_job`) measured, write its result next to the job."""
    job = json.loads(Path(job_path).read_text())
    arrays = CO.load_calibration(job["data"])
    import onnxruntime.quantization  # noqa: F401 - same import baseline for both tools

    import onnxq  # noqa: F401

    quantize = quantize or quantize_job
    info, stats = C.measure_call(lambda: quantize(job, arrays))
    Path(job["result"]).write_text(json.dumps(C.jsonable({**stats, **info,
                                                          "size_mb": C.file_mb(job["output"])})))
    return 0


def latency(paths: dict[str, str], feeds: dict[str, np.ndarray], runs: int,
            threads: tuple[int, ...] = (1,)) -> dict[str, dict[str, float]]:
    """Median ms per run at batch 1 and 8, all sessions taking turns; keys `b{batch}_ms` for
    one thread, `b{batch}_t{threads}_ms` for others."""
    out: dict[str, dict[str, float]] = {name: {} for name in paths}
    for batch in (1, 8):
        feed = {k: v[:batch] for k, v in feeds.items()}
        for n in threads:
            sessions = {name: C.make_session(p, threads=n) for name, p in paths.items()}
            wanted = {name: {i.name for i in s.get_inputs()} for name, s in sessions.items()}
            per = {name: {k: v for k, v in feed.items() if k in wanted[name]} for name in sessions}
            key = f"b{batch}_ms" if n == 1 else f"b{batch}_t{n}_ms"
            for name, t in C.median_latency_ms(sessions, per, runs).items():
                out[name][key] = t["median_ms"]
    return out


def bench_task(task: CO.Task, args: argparse.Namespace, workdir: Path,
               threads: tuple[int, ...] = (1,)) -> dict[str, Any]:
    log = lambda msg: print(f"[{task.name}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    task.eval_feeds, task.labels, task.extra = task.load_eval()
    rows: dict[str, dict[str, Any]] = {}
    fl, reference = CO.evaluate(task, task.model, None, args)
    rows["float"] = {"deployed": fl["metric"], "reference": fl["metric"], "size_mb": C.file_mb(task.model)}
    paths = {"float": str(task.model)}
    for name in args.variants:
        log(f"quantize {name}")
        job = {"variant": name, "model": str(task.model), "data": task.calib_spec}
        res = C.spawn_worker(__file__, "quantize", job, workdir, f"{task.name}.{name}", args.timeout)
        if "error" in res:
            rows[name] = {"error": res["error"]}
            log(res["error"])
            continue
        dep, _ = CO.evaluate(task, res["output"], reference, args)
        ref, _ = CO.evaluate(task, res["output"], reference, args, level="basic")
        rows[name] = {"deployed": dep["metric"], "reference": ref["metric"], "agree": dep.get("agree"),
                      "quant_s": res["time_s"], "peak_rss_mb": res["peak_rss_mb"],
                      "size_mb": res["size_mb"], "summary": res.get("summary")}
        paths[name] = res["output"]
    log("latency")
    for name, t in latency(paths, task.eval_feeds, args.latency_runs, threads).items():
        rows[name].update(t)
    return rows


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b else "-"


def table(head: str, rows: dict[str, dict[str, Any]], line: Any) -> str:
    """`head`, then `line(row, values, float metric)` for each row (an error row says so)."""
    fl = rows["float"]["deployed"]
    return "\n".join([head] + [f"{row:<10} error: {r['error']}" if "error" in r else line(row, r, fl)
                               for row, r in rows.items()])


def format_table(name: str, metric: str, rows: dict[str, dict[str, Any]]) -> str:
    head = (f"{name} ({metric}; deployed = default onnxruntime session, reference = level basic, "
            "no fused int8 kernels)\n"
            f"{'row':<10} {'deployed':>9} {'reference':>9} {'vs float':>8} {'b1 ms':>7} {'b8 ms':>7} "
            f"{'quant s':>7} {'RSS MB':>7} {'MB':>6}  ratios vs ort (b1, b8, time, RSS)")

    def line(row: str, r: dict[str, Any], fl: float) -> str:
        base = rows.get(ORT_BASELINE.get(row, "ort"), {})
        ratios = ", ".join(_ratio(r.get(k), base.get(k)) for k in ("b1_ms", "b8_ms", "quant_s", "peak_rss_mb"))
        fmt = lambda v, spec: format(v, spec) if isinstance(v, float) else "-"  # noqa: E731
        return (
            f"{row:<10} {fmt(r['deployed'], '9.2f')} {fmt(r['reference'], '9.2f')} "
            f"{fmt(r['deployed'] - fl, '+8.2f')} {fmt(r.get('b1_ms'), '7.2f')} {fmt(r.get('b8_ms'), '7.2f')} "
            f"{fmt(r.get('quant_s'), '7.1f')} {fmt(r.get('peak_rss_mb'), '7.0f')} {fmt(r.get('size_mb'), '6.2f')}"
            + (f"  {ratios}" if row not in ("float",) and not row.startswith("ort") else ""))

    return table(head, rows, line)


def add_task_options(p: argparse.ArgumentParser, timeout: float) -> None:
    """The data and evaluation options of a benchmark over the shared tasks."""
    p.add_argument("--samples", type=int, default=200, help="calibration images")
    p.add_argument("--text-samples", type=int, default=256, help="calibration sentences (MiniLM)")
    p.add_argument("--eval-samples", type=int, help="cap on evaluation samples (STS-B: pairs)")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--threads", type=int, help="threads of the evaluation sessions")
    p.add_argument("--timeout", type=float, default=timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = C.harness_parser(__doc__, ("resnet20", "mobilenet", "minilm"), ())
    # The latency plan times models for half a minute each: benchmarks/latency.py runs it.
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "latency"], choices=list(VARIANTS))
    p.add_argument("--latency-runs", type=int, default=20)
    add_task_options(p, 1200.0)
    return p.parse_args(argv)


def run_shared(name: str, args: argparse.Namespace, quantize: Any, each_task: Any) -> int:
    """A benchmark's main over the shared tasks: the worker side, the skip without
    ../shared, and the report of `each_task(task, workdir) -> [(title, rows, table)]`."""
    if args.worker:
        return run_worker(args.job, quantize)
    if not (args.shared_dir / "models").is_dir():
        print(f"{name}: no shared folder at {args.shared_dir}; nothing to do (skipped)")
        return 0
    report = C.start_report(args, CO.machine_info())
    t0 = time.perf_counter()
    with C.scratch_dir(args.keep, f"{name}.") as workdir:
        for task in CO.shared_tasks(args, args.shared_dir):
            for title, rows, text in each_task(task, workdir):
                C.add_result(report, title, rows, text)
            task.eval_feeds = task.labels = None
    return C.finish_report(report, t0, args.json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def each_task(task: CO.Task, workdir: Path) -> list[tuple[str, dict[str, Any], str]]:
        rows = bench_task(task, args, workdir)
        return [(task.name, rows, format_table(task.name, task.metric_name, rows))]

    return run_shared("deployed", args, None, each_task)


if __name__ == "__main__":
    sys.exit(main())
