#!/usr/bin/env python
"""Calibration methods: onnxq's observers against onnxruntime's calibrators, same model and data.

    python benchmarks/calibration.py [--models mobilenet resnet20 minilm] [--json OUT]
    python benchmarks/calibration.py --models mobilenet --methods percentile --ort-methods entropy
    python benchmarks/calibration.py --flat-only --flat-counts 64 256 1024

Part 1, per model of ../shared: onnxq U8S8 (uint8 asymmetric activations, int8 per-channel
weights) with every calibration method, and onnxruntime `quantize_static` (QDQ, QUInt8
activations, QInt8 per-channel weights) with MinMax, Entropy and Percentile. Each quantizer
run is its own subprocess (`--worker onnxq|ort --job JOB.json`) that loads the calibration
data and imports both libraries before it times the quantize call; the parent evaluates
every output with onnxruntime on the CPU.

Part 2, memory flatness: onnxq peak RSS with percentile and minmax on MobileNet at 64, 256
and 1024 calibration samples, fed by a lazy reader that decodes one JPEG per batch-1 feed
(the 1000 images cycled to 1024), so the data itself is never all in memory.

See benchmarks/README.md for the protocol and caveats.
"""

from __future__ import annotations

import sys
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

# Runs as a script: benchmarks/ is sys.path[0], so the helpers import as top-level modules.
import common as C
import compare_ort as CO

ONNXQ_METHODS = ("minmax", "percentile", "minmse", "entropy", "nonoverflow", "ifmr", "hfmg")
HIST_METHODS = ("percentile", "minmse", "entropy", "ifmr", "hfmg")  # onnxq histogram observers
ORT_METHODS = ("minmax", "entropy", "percentile")
PERCENTILE = 99.999  # ORT's default CalibPercentile, used on both sides
MODELS = ("mobilenet", "resnet20", "minilm")


# =========================================================================== worker side


def make_data(spec: dict[str, Any]) -> tuple[Any, int]:
    """(calibration source, sample count): arrays for the shared specs, a lazy reader for
    `imagenet_lazy`."""
    if spec["kind"] == "imagenet_lazy":
        reader = C.ImagenetReader(spec["dir"], spec["count"], spec["input"])
        return reader, len(reader)
    arrays = CO.load_calibration(spec)
    return arrays, C.num_samples(arrays)


def quantize_onnxq(job: dict[str, Any], data: Any, n: int) -> dict[str, Any]:
    import onnxq
    from onnxq.config import get_preset
    from onnxq.config.spec import CalibMethod

    cfg = get_preset("U8S8")
    cfg.calibration.max_samples = n
    if job["batch_size"] is not None:
        cfg.calibration.batch_size = job["batch_size"]
    gqc = cfg.global_quant_config
    for spec in (gqc.input_tensors, gqc.output_tensors):
        spec.calib_method = CalibMethod(job["method"])
        if job["method"] == "percentile":
            spec.percentile = job["percentile"]
    result = onnxq.quantize(
        job["model"], job["output"], config=cfg, calibration_data=data, progress=False
    )
    return {
        "summary": onnxq.format_summary(result.summary),
        "calibrated_samples": result.summary.calibration_samples,
    }


def quantize_ort(job: dict[str, Any], data: Any, n: int) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[job["method"]]
    extra: dict[str, Any] = {}
    if job["method"] == "percentile" and job["percentile"] != PERCENTILE:
        extra["CalibPercentile"] = job["percentile"]
    if job.get("ort_max_intermediate"):
        extra["CalibMaxIntermediateOutputs"] = job["ort_max_intermediate"]
    reader = data if hasattr(data, "get_next") else C.FeedReader(data)
    quantize_static(
        job["model"],
        job["output"],
        reader,
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        calibrate_method=method,
        extra_options=extra or None,
    )
    return {"extra_options": extra}


def run_worker(quantizer: str, job_path: str) -> int:
    def load(spec: Any) -> tuple[tuple[Any, int], int]:
        made = make_data(spec)  # (data, samples): the quantizers take both
        return made, made[1]

    quantizers = {"onnxq": lambda job, d: quantize_onnxq(job, *d), "ort": lambda job, d: quantize_ort(job, *d)}
    return C.quantizer_worker(quantizer, job_path, load, quantizers)


# =========================================================================== parent side


def worker(
    quantizer: str, method: str, job: dict[str, Any], workdir: Path, args: Namespace, tag: str
) -> dict[str, Any]:
    timeout = args.ort_timeout if quantizer == "ort" else args.timeout
    job = {
        **job,
        "method": method,
        "percentile": args.percentile,
        "batch_size": args.batch_size,
        "rss_limit_mb": args.rss_limit_mb,
        "ort_max_intermediate": args.ort_max_intermediate,
    }
    res = C.spawn_worker(__file__, quantizer, job, workdir, f"{tag}.{quantizer}-{method}", timeout)
    res.setdefault("quantizer", quantizer)
    res.setdefault("method", method)
    return res


def methods_task(task: CO.Task, args: Namespace, workdir: Path) -> dict[str, Any]:
    log = CO.task_log(task)
    log(f"calibration: {task.calib_desc}; evaluation: {task.eval_desc}")
    rows: dict[str, dict[str, Any]] = {}
    rows["float"], reference = CO.float_row(task, args)
    runs = [("onnxq", m) for m in args.methods] + [("ort", m) for m in args.ort_methods]
    for quantizer, method in runs:
        name = f"{quantizer}-{method}"
        log(f"{name}: quantizing (load average {C.load_average()[0]:.2f}) ...")
        job = {"model": str(task.model), "data": task.calib_spec}
        res = worker(quantizer, method, job, workdir, args, task.name)
        res["load_average"] = C.load_average()
        rows[name] = CO.score_run(task, res, reference, args, name)
        if args.keep is None and "output" in res:
            Path(res["output"]).unlink(missing_ok=True)
    task.eval_feeds = task.labels = None
    ratios = {f"onnxq-{m}/ort-{o}": r for m in HIST_METHODS for o in ("entropy", "percentile")
              if (r := CO.cost_ratio(rows.get(f"onnxq-{m}", {}), rows.get(f"ort-{o}", {}))) is not None}
    return CO.task_report(task, rows, ratios=ratios)


def flat_runs(args: Namespace, shared: Path, workdir: Path) -> dict[str, Any]:
    """onnxq peak RSS at several calibration sample counts, MobileNet, lazy JPEG reader."""
    model = shared / "models" / "mobilenet_v1_075.onnx"
    d = shared / "data" / "imagenet_sample1000"
    rows: dict[str, dict[str, Any]] = {}
    for method in args.flat_methods:
        for n in args.flat_counts:
            name = f"onnxq-{method}@{n}"
            print(
                f"[flatness] {name}: quantizing (load average {C.load_average()[0]:.2f}) ...",
                file=sys.stderr,
                flush=True,
            )
            job = {
                "model": str(model),
                "data": {"kind": "imagenet_lazy", "dir": str(d), "count": n, "input": "input"},
            }
            res = worker("onnxq", method, job, workdir, args, f"flat{n}")
            res["samples"] = n
            res["load_average"] = C.load_average()
            if args.keep is None and "output" in res:
                Path(res["output"]).unlink(missing_ok=True)
            if "error" in res:
                print(f"[flatness] {name}: FAILED ({res['error']})", file=sys.stderr, flush=True)
            rows[name] = res
    ratios: dict[str, dict[str, float]] = {}
    lo, hi = min(args.flat_counts), max(args.flat_counts)
    for method in args.flat_methods:
        a, b = rows.get(f"onnxq-{method}@{lo}", {}), rows.get(f"onnxq-{method}@{hi}", {})
        if "peak_rss_mb" in a and "peak_rss_mb" in b and "error" not in a and "error" not in b:
            ratios[method] = {
                "peak_rss": b["peak_rss_mb"] / a["peak_rss_mb"],
                "rss_increase": b["rss_increase_mb"] / max(a["rss_increase_mb"], 1e-9),
                "time": b["time_s"] / a["time_s"],
            }
    return {"model": str(model), "low": lo, "high": hi, "rows": rows, "ratios": ratios}


# --------------------------------------------------------------------------- printing


def format_methods(name: str, res: dict[str, Any]) -> str:
    title = f"== {name}: calibration {res['calibration']}; evaluation {res['evaluation']}; U8S8 QDQ, per-channel weights"
    lines = C.run_table(title, res, ("quant s", "peak RSS MB", "+RSS MB", "metric", "agree", "Q/DQ", "load"), 20,
                        "all 1500 pairs")
    for m in HIST_METHODS:
        for o in ("entropy", "percentile"):
            key = f"onnxq-{m}/ort-{o}"
            if f"onnxq-{m}" not in res["rows"] or f"ort-{o}" not in res["rows"]:
                continue
            q = res["ratios"].get(key)
            if q is None:
                lines.append(f"{key}: n/a (a run failed)")
                continue
            lines.append(
                f"{key}: time {q['time']:.2f}, peak rss {q['rss']:.2f}, "
                f"+rss {q['rss_increase']:.3f}"
            )
    return "\n".join(lines)


def format_flat(res: dict[str, Any]) -> str:
    lines = [
        "== memory flatness: onnxq U8S8 on mobilenet_v1_075, lazy JPEG reader (batch-1 feeds, "
        "1000 images cycled), calibration batch 8",
        f"{'':24} {'quant s':>8} {'ms/sample':>9} {'base MB':>8} {'peak RSS MB':>12} "
        f"{'+RSS MB':>8} {'load':>5}",
    ]
    for name, r in res["rows"].items():
        if "error" in r:
            lines.append(f"{name:24} FAILED: {r['error'][:160]}")
            continue
        lines.append(
            f"{name:24} {r['time_s']:8.2f} {1000 * r['time_s'] / r['samples']:9.1f} "
            f"{r['rss_before_mb']:8.0f} {r['peak_rss_mb']:12.0f} {r['rss_increase_mb']:8.0f} "
            f"{r['load_average'][0]:5.2f}"
        )
    for method, q in res["ratios"].items():
        verdict = "within 10%" if q["peak_rss"] <= 1.10 else "ABOVE the 10% target"
        lines.append(
            f"{method} {res['high']}/{res['low']} samples: peak rss {q['peak_rss']:.3f} "
            f"({verdict}), +rss {q['rss_increase']:.2f}, time {q['time']:.2f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> Namespace:
    p = C.harness_parser(__doc__, MODELS, ("onnxq", "ort"))
    p.add_argument(
        "--methods",
        nargs="*",
        default=list(ONNXQ_METHODS),
        choices=ONNXQ_METHODS,
        help="onnxq calibration methods (none: skip)",
    )
    p.add_argument(
        "--ort-methods",
        nargs="*",
        default=list(ORT_METHODS),
        choices=ORT_METHODS,
        help="onnxruntime calibration methods (none: skip)",
    )
    p.add_argument("--samples", type=int, default=200, help="calibration images (default 200)")
    p.add_argument("--text-samples", type=int, default=256, help="MiniLM calibration sentences")
    p.add_argument("--eval-samples", type=int, help="cap on evaluation samples (STS-B: pairs)")
    p.add_argument("--percentile", type=float, default=PERCENTILE)
    p.add_argument("--batch-size", type=int, help="onnxq calibration batch size (default: onnxq's own)")
    p.add_argument("--ort-max-intermediate", type=int, help="ORT CalibMaxIntermediateOutputs")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--threads", type=int, help="intra-op threads of the evaluation sessions")
    p.add_argument("--flat-counts", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument(
        "--flat-methods", nargs="*", default=["percentile", "minmax"], choices=ONNXQ_METHODS
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-flat", action="store_true", help="skip the memory-flatness runs")
    g.add_argument("--flat-only", action="store_true", help="only the memory-flatness runs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per onnxq run")
    p.add_argument("--ort-timeout", type=float, default=900.0, help="seconds per ORT run")
    p.add_argument(
        "--rss-limit-mb",
        type=float,
        help="stop a worker whose RSS passes this (default: 80%% of available memory at start)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.job)
    shared = args.shared_dir
    if not (shared / "models").is_dir():
        print(f"calibration: no shared evaluation folder at {shared}; nothing to do (skipped)")
        return 0
    if args.rss_limit_mb is None:
        args.rss_limit_mb = 0.8 * C.available_mb()
    report = C.start_report(args, {**CO.machine_info(), "git_revision": C.git_revision()})
    t0 = time.perf_counter()
    with C.scratch_dir(args.keep, "calibration.") as workdir:
        if not args.flat_only:
            # compare_ort builds the tasks (data protocol, evaluation loaders); keep our order.
            tasks = {t.name: t for t in CO.shared_tasks(args, shared)}
            names = {
                "mobilenet": "mobilenet_v1_075",
                "resnet20": "resnet20_cifar10",
                "minilm": "all_minilm_l6_v2",
            }
            for key in args.models:
                task = tasks[names[key]]
                res = methods_task(task, args, workdir)
                C.add_result(report, task.name, res, format_methods(task.name, res))
        if not args.no_flat and args.flat_methods:
            report["flatness"] = flat_runs(args, shared, workdir)
            print(format_flat(report["flatness"]), flush=True)
            print(flush=True)
    return C.finish_report(report, t0, args.json)

if __name__ == "__main__":
    sys.exit(main())
