#!/usr/bin/env python
"""Data types and strategies: accuracy, size and CPU latency of onnxq's presets on real models.

    python benchmarks/dtypes.py [--models mobilenet resnet20 minilm] [--presets U8S8 FP16] [--json OUT]

For each model of ../shared: float32 and the presets FP16, BF16, U8S8 (static int8), A16W8
(int16 activations, int8 weights), W8_DYNAMIC (dynamic int8), W4_GROUP128 (weight-only
int4), FP8_E4M3 and XINT8. Each (model, preset) runs in its own subprocess
(`--worker variant --job JOB.json`): quantize (static presets calibrate on the same data
as compare_ort.py), evaluate on the held-out data (top-1 or STS-B Spearman, agreement with
the float outputs of this run), then time onnxruntime CPU inference at batch 1 and 8 with
1 and 2 intra-op threads, the quantized and the float32 session taking turns so that both
see the same machine load. A preset that fails to quantize or to run gets a row with the
error. See benchmarks/README.md.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from argparse import Namespace
from pathlib import Path
from typing import Any

# Runs as a script: benchmarks/ is sys.path[0], so the helpers import as top-level modules.
import common as C
import compare_ort as CO
import numpy as np

PRESETS = ("FP16", "BF16", "U8S8", "A16W8", "W8_DYNAMIC", "W4_GROUP128", "FP8_E4M3", "XINT8")
NEEDS_CALIBRATION = {"U8S8", "A16W8", "FP8_E4M3", "XINT8"}
FLOAT = "float32"
MODELS = ("mobilenet", "resnet20", "minilm")
TASK_NAMES = {
    "mobilenet": "mobilenet_v1_075",
    "resnet20": "resnet20_cifar10",
    "minilm": "all_minilm_l6_v2",
}


# =========================================================================== worker side


def _task(job: dict[str, Any]) -> CO.Task:
    """The model's task (data protocol, evaluation loader) as compare_ort.py builds it."""
    ns = Namespace(
        samples=job["samples"],
        text_samples=job["text_samples"],
        eval_samples=job["eval_samples"],
        models=[job["model_key"]],
    )
    (task,) = CO.shared_tasks(ns, Path(job["shared_dir"]))
    return task


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


# Fallback when onnxruntime rejects a quantized model at its default optimization level
# ("all"): ORT 1.31's QDQ fusions turn float8 DQ -> Conv -> Q into a QLinearConv, which has
# no float8 kernel ("Type 'tensor(float8e4m3fn)' of input parameter ... of operator
# (QLinearConv) is invalid"). Level "extended" fails the same way, and "all" with
# session.disable_quant_qdq=1 loads but computes wrong results on float8 QDQ (the ResNet-20
# FP8 model agrees 0% with float there, 100% with ORT_DISABLE_ALL and the ONNX reference
# evaluator), so the fallback is level "basic" (constant folding and simple rewrites only).
FALLBACK_LEVEL = "basic"


def latency(
    job: dict[str, Any],
    paths: dict[str, str],
    feeds: dict[str, np.ndarray],
    levels: dict[str, str | None],
) -> dict:
    """{"b{B}_t{T}": {name: {median_ms, ...}}}: all sessions at each setting, interleaved."""
    out: dict[str, Any] = {}
    for threads in job["threads"]:
        sessions = {name: C.make_session(p, threads, levels.get(name)) for name, p in paths.items()}
        for batch, runs in zip(job["batches"], job["runs"]):
            sub = {}
            for name, sess in sessions.items():
                wanted = {i.name for i in sess.get_inputs()}
                sub[name] = {k: v[:batch] for k, v in feeds.items() if k in wanted}
            out[f"b{batch}_t{threads}"] = C.median_latency_ms(
                sessions, sub, runs, warmup=job["warmup"]
            )
        del sessions
    return out


def run_worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    task = _task(job)
    preset = job["preset"]
    res: dict[str, Any] = {"preset": preset}
    path = str(task.model)

    def finish() -> int:
        Path(job["result"]).write_text(json.dumps(C.jsonable(res), indent=2))
        return 0

    if preset != FLOAT:
        import onnxq

        try:
            data = CO.load_calibration(task.calib_spec) if preset in NEEDS_CALIBRATION else None
            cfg = onnxq.get_preset(preset)
            if job["batch_size"] is not None:
                cfg.calibration.batch_size = job["batch_size"]
            t0 = time.perf_counter()
            result = onnxq.quantize(
                path, job["output"], config=cfg, calibration_data=data, progress=False
            )
            res["quant_s"] = time.perf_counter() - t0
            res["summary"] = onnxq.format_summary(result.summary)
            path = job["output"]
            res["size_mb"] = C.file_mb(path)
            res.update(CO.qdq_counts(path))
            del data, result
        except Exception as exc:  # noqa: BLE001 - any quantizer failure becomes a table row
            res.update(error=f"quantize: {_short(exc)}", traceback=traceback.format_exc())
            return finish()
    else:
        res["size_mb"] = C.file_mb(path)
        res.update(CO.qdq_counts(path))

    task.eval_feeds, task.labels, task.extra = task.load_eval()
    reference = np.load(job["reference"]) if job.get("reference") else None
    eval_args = Namespace(eval_batch=job["eval_batch"], threads=job["eval_threads"])
    level: str | None = None
    try:
        C.make_session(path)  # default options: does onnxruntime accept the model?
    except Exception as exc:  # noqa: BLE001
        first = _short(exc)
        try:
            C.make_session(path, None, FALLBACK_LEVEL)
        except Exception:  # noqa: BLE001 - report the error of the default session
            res.update(error=f"run: {first}", traceback=traceback.format_exc())
            return finish()
        level = FALLBACK_LEVEL
        res["session_fallback"] = {"level": level, "default_session_error": first}
    try:
        t0 = time.perf_counter()
        metrics, out = CO.evaluate(task, path, reference, eval_args, level)
        res["eval_s"] = time.perf_counter() - t0
        res.update(metrics)
        if job.get("save_output"):
            np.save(job["save_output"], out)
    except Exception as exc:  # noqa: BLE001
        res.update(error=f"run: {_short(exc)}", traceback=traceback.format_exc())
        return finish()

    try:
        paths = {preset: path}
        if preset != FLOAT:
            paths[FLOAT] = str(task.model)
        res["latency"] = latency(job, paths, task.eval_feeds, {preset: level})
    except Exception as exc:  # noqa: BLE001
        res.update(error=f"latency: {_short(exc)}", traceback=traceback.format_exc())
    return finish()


# =========================================================================== parent side


def model_rows(key: str, args: Namespace, workdir: Path) -> dict[str, Any]:
    task = _task(_job_base(key, args))
    rows: dict[str, dict[str, Any]] = {}
    ref_path = workdir / f"{task.name}.float_outputs.npy"
    for preset in [FLOAT, *args.presets]:
        print(
            f"[{task.name}] {preset} (load average {C.load_average()[0]:.2f}) ...",
            file=sys.stderr,
            flush=True,
        )
        job = _job_base(key, args)
        job.update(preset=preset)
        if preset == FLOAT:
            job["save_output"] = str(ref_path)
        elif ref_path.exists():
            job["reference"] = str(ref_path)
        res = C.spawn_worker(
            __file__, "variant", job, workdir, f"{task.name}.{preset}", args.timeout
        )
        res.setdefault("preset", preset)
        res["load_average"] = C.load_average()
        if args.keep is None and "output" in res:
            Path(res["output"]).unlink(missing_ok=True)
        if "error" in res:
            print(f"[{task.name}] {preset}: FAILED ({res['error']})", file=sys.stderr, flush=True)
        else:
            print(
                f"[{task.name}] {preset}: metric {res.get('metric'):.2f}, "
                f"size {res.get('size_mb'):.2f} MB, worker {res['worker_wall_s']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        rows[preset] = res
    if task.kind == "encoder":
        rows[FLOAT]["agree"] = 1.0
    elif "error" not in rows[FLOAT]:
        rows[FLOAT]["agree"] = 100.0
    return CO.task_report(task, rows)


def _job_base(key: str, args: Namespace) -> dict[str, Any]:
    return {
        "model_key": key,
        "shared_dir": str(args.shared_dir),
        "samples": args.samples,
        "text_samples": args.text_samples,
        "eval_samples": args.eval_samples,
        "batch_size": args.batch_size,
        "eval_batch": args.eval_batch,
        "eval_threads": args.eval_threads,
        "batches": args.batches,
        "runs": args.runs,
        "threads": args.threads,
        "warmup": args.warmup,
    }


# --------------------------------------------------------------------------- printing


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_model(name: str, res: dict[str, Any]) -> str:
    encoder = res["metric"].startswith("Spearman")
    agree_name = "cos vs fp" if encoder else "agree %"
    agree_fmt = ".4f" if encoder else ".2f"
    rows = res["rows"]
    float_size = rows[FLOAT].get("size_mb")
    lines = [
        f"== {name}: calibration {res['calibration']}; evaluation {res['evaluation']}",
        f"{'':12} {res['metric']:>14} {agree_name:>10} {'size MB':>8} {'% float':>8} "
        f"{'quant s':>8} {'Q/DQ':>9} {'nodes':>6}",
    ]
    for preset, r in rows.items():
        if "error" in r:
            lines.append(f"{preset:12} FAILED: {r['error'][:200]}")
            continue
        pct = 100.0 * r["size_mb"] / float_size if float_size and r.get("size_mb") else None
        qdq = f"{r.get('QuantizeLinear', 0)}/{r.get('DequantizeLinear', 0)}"
        label = preset + ("*" if r.get("session_fallback") else "")
        lines.append(
            f"{label:12} {_fmt(r.get('metric'), '14.2f'):>14} "
            f"{_fmt(r.get('agree'), agree_fmt):>10} {_fmt(r.get('size_mb'), '8.2f'):>8} "
            f"{_fmt(pct, '7.1f'):>7}% {_fmt(r.get('quant_s'), '8.2f'):>8} "
            f"{qdq if preset != FLOAT else '-':>9} {_fmt(r.get('nodes'), 'd'):>6}"
        )
    for preset, r in rows.items():
        if r.get("session_fallback"):
            lines.append(
                f"* {preset}: onnxruntime rejects it with default session options "
                f"({r['session_fallback']['default_session_error'][:160]}); accuracy and latency "
                f"with graph optimization level {r['session_fallback']['level']!r}"
            )
    # Latency: median ms; for presets also the ratio to float32 timed in the same worker.
    keys = next((list(r["latency"]) for r in rows.values() if "latency" in r), [])
    if keys:
        head = " ".join(f"{k.replace('_', ' '):>17}" for k in keys)
        lines.append("latency, median ms per run (x float32 interleaved in the same worker):")
        lines.append(f"{'':12} {head} {'load':>5}")
        for preset, r in rows.items():
            lat = r.get("latency")
            if not lat:
                reason = r.get("error", "no latency")[:150]
                lines.append(f"{preset:12} -  ({reason})")
                continue
            cells = []
            for k in keys:
                own = lat[k][preset]["median_ms"]
                if preset == FLOAT:
                    cells.append(f"{own:17.2f}")
                else:
                    ratio = own / lat[k][FLOAT]["median_ms"]
                    cells.append(f"{own:9.2f} (x{ratio:4.2f})")
            lines.append(f"{preset:12} {' '.join(cells)} {r['load_average'][0]:5.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> Namespace:
    p = C.harness_parser(__doc__, MODELS, ("variant",))
    p.add_argument(
        "--presets",
        nargs="*",
        default=list(PRESETS),
        type=str.upper,
        help=f"onnxq presets to run besides float32 (default: {' '.join(PRESETS)})",
    )
    p.add_argument("--samples", type=int, default=200, help="calibration images (default 200)")
    p.add_argument("--text-samples", type=int, default=256, help="MiniLM calibration sentences")
    p.add_argument("--eval-samples", type=int, help="cap on evaluation samples (STS-B: pairs)")
    p.add_argument("--batch-size", type=int, help="onnxq calibration batch size (default: onnxq's own)")
    p.add_argument("--eval-batch", type=int, default=32, help="batch of the accuracy runs")
    p.add_argument(
        "--eval-threads", type=int, help="intra-op threads of the accuracy runs (ORT default)"
    )
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="latency batch sizes")
    p.add_argument(
        "--runs",
        nargs="+",
        type=int,
        default=[20, 10],
        help="timed runs per batch size (one per --batches entry)",
    )
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="intra-op threads")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (model, preset)")
    args = p.parse_args(argv)
    if not args.worker and len(args.runs) != len(args.batches):
        p.error("--runs needs one count per --batches entry")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.job)
    shared = args.shared_dir
    if not (shared / "models").is_dir():
        print(f"dtypes: no shared evaluation folder at {shared}; nothing to do (skipped)")
        return 0
    report = C.start_report(args, {**CO.machine_info(), "git_revision": C.git_revision()})
    t0 = time.perf_counter()
    with C.scratch_dir(args.keep, "dtypes.") as workdir:
        for key in args.models:
            res = model_rows(key, args, workdir)
            C.add_result(report, TASK_NAMES[key], res, format_model(TASK_NAMES[key], res))
    return C.finish_report(report, t0, args.json)

if __name__ == "__main__":
    sys.exit(main())
