#!/usr/bin/env python
"""Compare onnxq with `onnxruntime.quantization.quantize_static` on one model, data and machine.

    python benchmarks/compare_ort.py MODEL --calib DATA [--eval DATA --labels Y] [--samples N]
    python benchmarks/compare_ort.py --shared [--models mobilenet resnet20 minilm]

Each quantizer run happens in its own subprocess (`--worker onnxq|ort --job JOB.json`):
the worker loads the calibration data and imports both libraries first, then times only the
quantize call and records the peak resident memory of that call. The parent then evaluates
the float model and every quantized model with onnxruntime on the CPU and prints one table
per model. See benchmarks/README.md for the settings used on each side.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Runs as a script: benchmarks/ is sys.path[0], so the helpers import as a top-level module.
import common as C
import numpy as np

QUANTIZERS = ("onnxq", "ort")
METHODS = ("minmax", "percentile")
PERCENTILE = 99.999


# =========================================================================== worker side


def load_calibration(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """The calibration arrays (samples on axis 0) described by a job's `data` entry."""
    kind = spec["kind"]
    if kind == "imagenet":
        x, _ = C.load_imagenet(spec["dir"], spec["start"], spec["stop"])
        return {spec["input"]: x}
    if kind == "cifar":
        x, _ = C.load_cifar(spec["dir"], spec["start"], spec["stop"])
        return {spec["input"]: x}
    if kind == "stsb":
        return C.load_stsb(spec["dir"], C.stsb_rows(spec["pairs"]))
    if kind == "file":
        return C.load_arrays(spec["path"], spec["inputs"], spec.get("stop"))
    raise ValueError(f"unknown data kind {kind!r}")


def quantize_onnxq(job: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    import onnxq

    if job.get("same_arguments"):  # onnxruntime's arguments, read by onnxq.ort_compat
        from onnxq.ort_compat import quantize_static

        result = quantize_static(job["model"], job["output"], C.FeedReader(arrays), **ort_arguments(job))
        return {"summary": onnxq.format_summary(result.summary), "same_arguments": True}
    from onnxq.config import get_preset
    from onnxq.config.spec import CalibMethod, QScheme

    cfg = get_preset("U8S8")
    cfg.calibration.max_samples = C.num_samples(arrays)
    if job["batch_size"] is not None:
        cfg.calibration.batch_size = job["batch_size"]
    gqc = cfg.global_quant_config
    if job["method"] == "percentile":
        for spec in (gqc.input_tensors, gqc.output_tensors):
            spec.calib_method = CalibMethod.PERCENTILE
            spec.percentile = job["percentile"]
    if job["per_tensor"]:
        gqc.weight.qscheme = QScheme.PER_TENSOR
    result = onnxq.quantize(
        job["model"], job["output"], config=cfg, calibration_data=arrays, progress=False
    )
    return {"summary": onnxq.format_summary(result.summary)}


def ort_arguments(job: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of onnxruntime's quantize_static for `job` (with
    --same-arguments, onnxq's worker passes them to onnxq.ort_compat.quantize_static)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    method = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}[
        job["method"]
    ]
    extra: dict[str, Any] = {}
    if job["method"] == "percentile" and job["percentile"] != PERCENTILE:
        extra["CalibPercentile"] = job["percentile"]
    if job.get("ort_max_intermediate"):
        extra["CalibMaxIntermediateOutputs"] = job["ort_max_intermediate"]
    return {"quant_format": QuantFormat.QDQ, "activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8,
            "per_channel": not job["per_tensor"], "calibrate_method": method, "extra_options": extra or None}


def quantize_ort(job: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    from onnxruntime.quantization import quantize_static

    arguments = ort_arguments(job)
    quantize_static(job["model"], job["output"], C.FeedReader(arrays), **arguments)
    return {"extra_options": arguments["extra_options"] or {}}


def run_worker(quantizer: str, job_path: str) -> int:
    def load(spec: Any) -> tuple[dict[str, np.ndarray], int]:
        arrays = load_calibration(spec)
        return arrays, C.num_samples(arrays)

    return C.quantizer_worker(quantizer, job_path, load, {"onnxq": quantize_onnxq, "ort": quantize_ort})


# =========================================================================== parent side


@dataclass
class Task:
    """One model to compare: where it is, how to calibrate it and how to score it.

    `load_eval` returns (eval feeds, labels or None, extra); it runs only when the model's
    turn comes, so the parent holds one model's evaluation data at a time.
    """

    name: str
    model: Path
    kind: str  # classifier | encoder | generic
    calib_spec: dict[str, Any]
    calib_desc: str
    eval_desc: str
    metric_name: str
    load_eval: Callable[[], tuple[dict[str, np.ndarray], np.ndarray | None, dict[str, Any]]]
    eval_feeds: dict[str, np.ndarray] | None = None
    labels: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def model_inputs(path: Path) -> list[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _image_eval(
    loader: Callable[..., tuple[np.ndarray, np.ndarray]], d: Path, start: int, stop: int | None
) -> Callable[[], tuple[dict[str, np.ndarray], np.ndarray, dict[str, Any]]]:
    def load() -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, Any]]:
        x, y = loader(d, start, stop)
        return {"input": x}, y, {}

    return load


def shared_tasks(args: argparse.Namespace, shared: Path) -> list[Task]:
    """The three real models of ../shared (see its MANIFEST.md)."""
    models, data = shared / "models", shared / "data"
    n_img = args.samples if args.samples is not None else 200
    tasks = []
    wanted = set(args.models)
    for key, name, folder, total, loader, kind in (
        ("resnet20", "resnet20_cifar10", "cifar10_test2000", 2000, C.load_cifar, "cifar"),
        ("mobilenet", "mobilenet_v1_075", "imagenet_sample1000", 1000, C.load_imagenet, "imagenet"),
    ):
        if key not in wanted:
            continue
        d = data / folder
        stop = total if args.eval_samples is None else min(total, n_img + args.eval_samples)
        tasks.append(
            Task(
                name,
                models / f"{name}.onnx",
                "classifier",
                {"kind": kind, "dir": str(d), "start": 0, "stop": n_img, "input": "input"},
                f"first {n_img} images",
                f"next {stop - n_img} images",
                "top-1 %",
                _image_eval(loader, d, n_img, stop),
            )
        )
    if "minilm" in wanted:
        d = data / "stsb_dev"
        calib_pairs, eval_pairs = C.stsb_split(args.text_samples, args.eval_samples)

        def load_stsb_eval() -> tuple[dict[str, np.ndarray], None, dict[str, Any]]:
            # Embed the held-out pairs (the metric) and the calibration pairs (for the
            # all-pairs figure); held-out pairs come first.
            all_pairs = eval_pairs + calib_pairs
            feeds = C.load_stsb(d, C.stsb_rows(all_pairs))
            scores = C.load_stsb_scores(d)[np.asarray(all_pairs)]
            return (
                feeds,
                None,
                {"scores": scores, "n_eval_pairs": len(eval_pairs), "n_all_pairs": len(all_pairs)},
            )

        tasks.append(
            Task(
                "all_minilm_l6_v2",
                models / "all_minilm_l6_v2.onnx",
                "encoder",
                {"kind": "stsb", "dir": str(d), "pairs": calib_pairs},
                f"{2 * len(calib_pairs)} sentences (pairs 0-{len(calib_pairs) - 1})",
                f"STS-B pairs {eval_pairs[0]}-{eval_pairs[-1]} ({len(eval_pairs)} held-out pairs)",
                "Spearman x100",
                load_stsb_eval,
            )
        )
    return tasks


def file_task(args: argparse.Namespace) -> Task:
    model = Path(args.model)
    inputs = model_inputs(model)
    calib = C.load_arrays(args.calib, inputs, args.samples)
    n_calib = C.num_samples(calib)
    if args.eval:
        feeds = C.load_arrays(args.eval, inputs, args.eval_samples)
        eval_desc = f"{C.num_samples(feeds)} samples of {args.eval}"
    else:
        feeds, eval_desc = calib, f"the {n_calib} calibration samples (no --eval given)"
    labels = C.load_labels(args.labels, args.eval, args.eval_samples) if args.labels else None
    return Task(
        model.stem,
        model,
        "generic",
        {"kind": "file", "path": str(args.calib), "inputs": inputs, "stop": args.samples},
        f"{n_calib} samples of {args.calib}",
        eval_desc,
        "top-1 %" if labels is not None else "metric",
        lambda: (feeds, labels, {}),
    )


def spawn_worker(
    quantizer: str, job: dict[str, Any], workdir: Path, timeout: float
) -> dict[str, Any]:
    """One quantizer run in its own worker process (`common.spawn_worker`), labelled."""
    tag = f"{job['tag']}.{quantizer}-{job['method']}"
    res = C.spawn_worker(__file__, quantizer, job, workdir, tag, timeout)
    if "error" in res:
        res.update(quantizer=quantizer, method=job["method"])
    return res


def run_repeated(
    quantizer: str, job: dict[str, Any], workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """`--repeat` fresh workers; keep the fastest run, report every time and the largest peak."""
    runs = []
    for _ in range(max(args.repeat, 1)):
        res = spawn_worker(quantizer, job, workdir, args.timeout)
        if "error" in res:
            return res
        runs.append(res)
    best = dict(min(runs, key=lambda r: r["time_s"]))
    if len(runs) > 1:
        best["all_times_s"] = [r["time_s"] for r in runs]
        best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
        best["rss_increase_mb"] = max(r["rss_increase_mb"] for r in runs)
    return best


def run_model(
    path: str | Path,
    feeds: dict[str, np.ndarray],
    output: str | None,
    batch_size: int,
    threads: int | None,
    level: str | None = None,
) -> tuple[np.ndarray, float]:
    """Outputs of `output` (or the first output) over all samples, and ms per sample.

    `level`: onnxruntime graph optimisation level (`common.ORT_LEVELS`; default: all, as
    deployed)."""
    sess = C.make_session(path, threads, level)
    name = output or sess.get_outputs()[0].name
    wanted = {i.name for i in sess.get_inputs()}
    chunks = []
    warm = next(C.batches(feeds, batch_size))
    sess.run([name], {k: v for k, v in warm.items() if k in wanted})  # warm-up, not timed
    t0 = time.perf_counter()
    for batch in C.batches(feeds, batch_size):
        chunks.append(sess.run([name], {k: v for k, v in batch.items() if k in wanted})[0])
    ms = (time.perf_counter() - t0) * 1000.0 / max(C.num_samples(feeds), 1)
    return np.concatenate(chunks), ms


def evaluate(
    task: Task, path: str | Path, reference: np.ndarray | None, args: argparse.Namespace,
    level: str | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """Score one model on the task's eval data; `reference` is the float model's output.
    `level` as in `run_model` (None: a default session, what deploys)."""
    assert task.eval_feeds is not None
    if task.kind == "encoder":
        out, ms = run_model(
            path, task.eval_feeds, "sentence_embedding", args.eval_batch, args.threads, level
        )
        n_all = task.extra["n_all_pairs"]
        n_eval = task.extra["n_eval_pairs"]
        sims = C.row_cosine(out[:n_all], out[n_all:])
        scores = task.extra["scores"]
        m = {
            "metric": 100.0 * C.spearman(sims[:n_eval], scores[:n_eval]),
            "spearman_all_pairs": 100.0 * C.spearman(sims, scores),
            "infer_ms": ms,
        }
        if reference is not None:
            cos = C.row_cosine(out, reference)
            m.update(agree=float(cos.mean()), cosine_min=float(cos.min()))
        return m, out
    out, ms = run_model(path, task.eval_feeds, None, args.eval_batch, args.threads, level)
    m: dict[str, Any] = {"infer_ms": ms, "metric": None}
    pred = C.top1(out) if out.ndim == 2 and out.shape[1] > 1 else None
    if task.labels is not None and pred is not None:
        m["metric"] = 100.0 * float((pred == task.labels[: len(pred)]).mean())
    if reference is not None:
        cos = C.row_cosine(out, reference)
        m["cosine_vs_float"] = float(cos.mean())
        if pred is not None:
            m["agree"] = 100.0 * float((pred == C.top1(reference)).mean())
        else:
            m["agree"] = float(cos.mean())
    return m, out


def qdq_counts(path: str | Path) -> dict[str, int]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    return {
        "nodes": len(ops),
        "QuantizeLinear": ops.count("QuantizeLinear"),
        "DequantizeLinear": ops.count("DequantizeLinear"),
    }


def _metric(row: dict[str, Any]) -> str:
    """A row's metric for the log; "n/a" without labels (--calib alone: time and memory)."""
    return "n/a" if row.get("metric") is None else f"{row['metric']:.2f}"


def task_log(task: Task) -> Any:
    return lambda msg: print(f"[{task.name}] {msg}", file=sys.stderr, flush=True)


def float_row(task: Task, args: argparse.Namespace) -> tuple[dict[str, Any], np.ndarray]:
    """Load the task's evaluation data and score the float model: its row and outputs."""
    task.eval_feeds, task.labels, task.extra = task.load_eval()
    row, reference = evaluate(task, task.model, None, args)
    row.update(size_mb=C.file_mb(task.model), **qdq_counts(task.model))
    if task.kind == "encoder":
        row["agree"] = 1.0
    elif reference.ndim == 2 and reference.shape[1] > 1:
        row["agree"] = 100.0
    task_log(task)(f"float: metric {_metric(row)}")
    return row, reference


def score_run(task: Task, res: dict[str, Any], reference: np.ndarray, args: argparse.Namespace,
              name: str) -> dict[str, Any]:
    """Score a quantizer's output (unless it failed) into its row, and log it."""
    log = task_log(task)
    if "error" in res:
        log(f"{name}: FAILED ({res['error']})")
        return res
    metrics, _ = evaluate(task, res["output"], reference, args)
    res.update(metrics, **qdq_counts(res["output"]))
    log(f"{name}: {res['time_s']:.2f} s, peak {res['peak_rss_mb']:.0f} MB, metric {_metric(res)}")
    return res


def cost_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float] | None:
    """Time and memory of run `a` over run `b`, when both ran."""
    if "time_s" not in a or "time_s" not in b or "error" in a or "error" in b:
        return None
    return {"time": a["time_s"] / b["time_s"], "rss": a["peak_rss_mb"] / b["peak_rss_mb"],
            "rss_increase": a["rss_increase_mb"] / max(b["rss_increase_mb"], 1e-9)}


def task_report(task: Task, rows: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": str(task.model), "calibration": task.calib_desc, "evaluation": task.eval_desc,
            "metric": task.metric_name, "rows": rows, **extra}


def compare_task(task: Task, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    log = task_log(task)
    log(f"calibration: {task.calib_desc}; evaluation: {task.eval_desc}")
    rows: dict[str, dict[str, Any]] = {}
    rows["float"], reference = float_row(task, args)
    for method in args.methods:
        for quantizer in QUANTIZERS:
            job = {
                "tag": task.name,
                "model": str(task.model),
                "method": method,
                "per_tensor": args.per_tensor,
                "percentile": args.percentile,
                "batch_size": args.batch_size,
                "data": task.calib_spec,
                "ort_max_intermediate": args.ort_max_intermediate,
                "same_arguments": args.same_arguments,
            }
            log(f"{quantizer}-{method}: quantizing ...")
            res = run_repeated(quantizer, job, workdir, args)
            rows[f"{quantizer}-{method}"] = score_run(task, res, reference, args, f"{quantizer}-{method}")
    ratios = {m: r for m in args.methods
              if (r := cost_ratio(rows.get(f"onnxq-{m}", {}), rows.get(f"ort-{m}", {}))) is not None}
    return {**task_report(task, rows, methods=list(args.methods), ratios=ratios), "same_arguments": args.same_arguments}


def format_table(name: str, res: dict[str, Any], per_tensor: bool) -> str:
    weights = "per-tensor" if per_tensor else "per-channel"
    title = f"== {name}: calibration {res['calibration']}; evaluation {res['evaluation']}; U8S8 QDQ, {weights} weights"
    if res.get("same_arguments"):
        title += "; onnxq given onnxruntime's arguments (onnxq.ort_compat)"
    lines = C.run_table(title, res, ("quant s", "peak RSS MB", "+RSS MB", "size MB", "metric", "agree",
                                      "infer ms", "Q/DQ"), 18, "all evaluated pairs")
    for method in res["methods"]:
        q = res["ratios"].get(method)
        if q is None:
            lines.append(f"onnxq/ort {method}: n/a (a run failed)")
            continue
        lines.append(
            f"onnxq/ort {method}: time {q['time']:.2f}, rss {q['rss']:.2f} "
            f"(rss increase over data+imports {q['rss_increase']:.2f})"
        )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import onnx
    import onnxruntime

    import onnxq

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxq": onnxq.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = C.harness_parser(__doc__, (), QUANTIZERS, keep="keep quantized models and worker logs in this folder")
    p.add_argument("model", nargs="?", help="float ONNX model (not with --shared)")
    p.add_argument(
        "--calib",
        help=".npz (arrays keyed by input name) or .npy (single input), samples on axis 0",
    )
    p.add_argument(
        "--eval", help="evaluation data, same format as --calib (default: the calibration data)"
    )
    p.add_argument("--labels", help="int labels for top-1: a .npy file or a key of the --eval .npz")
    p.add_argument(
        "--shared", action="store_true", help="run the real models of ../shared (see MANIFEST.md)"
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["resnet20", "mobilenet", "minilm"],
        choices=["resnet20", "mobilenet", "minilm"],
        help="subset of the --shared models",
    )
    p.add_argument(
        "--samples", type=int, help="calibration samples (default: all; 200 images with --shared)"
    )
    p.add_argument(
        "--text-samples", type=int, default=256, help="calibration sentences for MiniLM (--shared)"
    )
    p.add_argument("--eval-samples", type=int, help="cap on evaluation samples (STS-B: pairs)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--percentile", type=float, default=PERCENTILE)
    p.add_argument("--per-tensor", action="store_true", help="per-tensor weights on both sides")
    p.add_argument("--batch-size", type=int, help="onnxq calibration batch size (default: onnxq's own)")
    p.add_argument("--same-arguments", action="store_true",
                   help="onnxq reads onnxruntime's quantize_static arguments (onnxq.ort_compat): the same recipe "
                        "on both sides, onnxq's defaults (bias correction, target-aware ranges) included")
    p.add_argument(
        "--ort-max-intermediate",
        type=int,
        help="ORT MinMax: CalibMaxIntermediateOutputs (default: ORT's default, keep all)",
    )
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument(
        "--threads", type=int, help="intra-op threads for evaluation sessions (default: ORT's)"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="quantizer runs per row (fastest kept; default 1)"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per quantizer run")
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.shared == bool(args.model):
        p.error("give either MODEL --calib DATA or --shared")
    if args.model and not args.calib:
        p.error("MODEL needs --calib DATA")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.job)

    if args.shared:
        shared = args.shared_dir
        if not (shared / "models").is_dir():
            print(f"compare_ort: no shared evaluation folder at {shared}; nothing to do (skipped)")
            return 0
        print(f"loading evaluation data from {shared} ...", file=sys.stderr, flush=True)
        tasks = shared_tasks(args, shared)
    else:
        tasks = [file_task(args)]

    report = C.start_report(args, machine_info())
    t0 = time.perf_counter()
    with C.scratch_dir(args.keep, "compare_ort.") as workdir:
        for task in tasks:
            res = compare_task(task, args, workdir)
            task.eval_feeds = task.labels = None  # free the evaluation data before the next model
            C.add_result(report, task.name, res, format_table(task.name, res, args.per_tensor))
    return C.finish_report(report, t0, args.json)

if __name__ == "__main__":
    sys.exit(main())
