#!/usr/bin/env python
"""Quantized models on an execution provider: where their nodes run, accuracy, latency.

    python benchmarks/providers.py --provider CUDAExecutionProvider [--models resnet20 mobilenet]
        [--presets U8S8 FP16 BF16 FP8_E4M3 W4_GROUP128] [--eval-samples 400] [--json OUT]

onnxq calibrates on the provider (`calibration.providers`, so `target: auto` resolves from
it; `--calib-provider` to calibrate elsewhere) and each model, float and quantized, then
opens in a default session (all graph optimisations) on [provider, CPU], as a deployment
would. Per (model, preset): the target
the summary names, how many nodes the provider ran and which op types fell back to the
CPU (from onnxruntime's profile), top-1 and top-1 agreement with the float model on the
same provider, and median latency at batch 1 and 32 against float on that provider (node
counts are those onnxruntime ran after optimisation, Memcpy nodes included). The `ort`
row is onnxruntime's own quantizer (`quantize_static`, QDQ U8S8 per-channel MinMax) on the
same model and data, measured the same way (`--no-ort` leaves it out). `--presets latency`
adds a row for the default recipe with `optimize_for: latency`, its plan timed on the
provider (on a GPU provider it tries float16 first), the plan's notes in place of the target. A
synthetic MatMul MLP covers the weight-only formats (MatMulNBits) where the shared
models have none. Without ../shared only the MLP runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import numpy as np

DEFAULT_PRESETS = ("U8S8", "S8S8", "FP16", "BF16", "FP8_E4M3", "W4_GROUP128")
# Not a preset: the default recipe with `optimize_for: latency`, its plan timed on the provider.
LATENCY = "latency"


def open_session(path: str | Path, providers: list[str], profile: bool = False) -> Any:
    """A default session (all optimisations) on `providers`, optionally profiling."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.gettempdir()) / "onnxq_providers")
    return ort.InferenceSession(str(path), so, providers=providers)


def placement(path: str | Path, providers: list[str], feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """Nodes per provider after optimisation, and the op types that ran on the CPU."""
    sess = open_session(path, providers, profile=True)
    sess.run(None, feed)
    trace = Path(sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink(missing_ok=True)
    where: dict[str, tuple[str, str]] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and "provider" in args:
            where[e["name"].rsplit("_kernel_time", 1)[0]] = (args["provider"], args.get("op_name", "?"))
    counts = Counter(p for p, _ in where.values())
    cpu_ops = Counter(op for p, op in where.values() if p == "CPUExecutionProvider")
    return {"nodes": dict(counts), "cpu_ops": dict(cpu_ops)}


def run_all(sess: Any, feeds: dict[str, np.ndarray], batch: int) -> np.ndarray:
    name = sess.get_outputs()[0].name
    wanted = {i.name for i in sess.get_inputs()}
    outs = [sess.run([name], {k: v for k, v in b.items() if k in wanted})[0]
            for b in C.batches(feeds, batch)]
    return np.concatenate(outs)


def latency_ms(sess: Any, feeds: dict[str, np.ndarray], batch: int, runs: int) -> float:
    """Median ms of one batch of `batch` samples (`common.median_latency_ms`, 5 warm-up runs)."""
    wanted = {i.name for i in sess.get_inputs()}
    feed = {k: v[:batch] for k, v in feeds.items() if k in wanted}
    return C.median_latency_ms({"s": sess}, {"s": feed}, runs, warmup=5)["s"]["median_ms"]


def mlp_task(workdir: Path) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A 4-layer MatMul+Gelu MLP (hidden 1024) with random weights: calibration and eval feeds."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    width, layers = 1024, 4
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Gelu", [f"m{i}"], [out]) if i < layers - 1
                     else helper.make_node("Identity", [f"m{i}"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 64, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    path = workdir / "mlp.onnx"
    onnx.save(model, path)
    calib = {"x": rng.standard_normal((32, 64, width)).astype(np.float32)}
    evals = {"x": rng.standard_normal((64, 64, width)).astype(np.float32)}
    return path, calib, evals


def with_cpu(provider: str) -> list[str]:
    return [provider] + (["CPUExecutionProvider"] if provider != "CPUExecutionProvider" else [])


def config_for(preset: str, providers: list[str]) -> Any:
    import onnxq

    cfg = onnxq.get_preset(preset)
    cfg.calibration.providers = list(providers)
    return cfg


def measure(path: Path, providers: list[str], feeds: dict[str, np.ndarray],
            reference: np.ndarray | None, labels: np.ndarray | None, args: argparse.Namespace,
            encoder: bool) -> tuple[dict[str, Any], np.ndarray]:
    row: dict[str, Any] = {"placement": placement(path, providers, next(C.batches(feeds, 1)))}
    sess = open_session(path, providers)
    row["providers"] = sess.get_providers()
    out = run_all(sess, feeds, args.eval_batch)
    if labels is not None:
        row["top1"] = 100.0 * float((C.top1(out) == labels[: len(out)]).mean())
    if reference is not None:
        flat, ref = out.reshape(len(out), -1), reference.reshape(len(reference), -1)
        row["cosine"] = float(C.row_cosine(flat, ref).mean())
        noise = float(np.sum((flat.astype(np.float64) - ref) ** 2))
        row["sqnr_db"] = 10.0 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / max(noise, 1e-30))
        if not encoder and out.ndim == 2 and out.shape[1] > 1:
            row["agree"] = 100.0 * float((C.top1(out) == C.top1(reference)).mean())
    row["latency_ms"] = {str(b): latency_ms(sess, feeds, b, args.runs) for b in args.batches
                         if b <= C.num_samples(feeds)}
    return row, out


def model_report(name: str, model: Path, calib: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
                 labels: np.ndarray | None, args: argparse.Namespace, workdir: Path,
                 presets: list[str]) -> dict[str, Any]:
    import onnxq

    providers = with_cpu(args.provider)
    calib_providers = with_cpu(args.calib_provider or args.provider)
    encoder = labels is None
    rows: dict[str, Any] = {}
    print(f"[{name}] float ...", file=sys.stderr, flush=True)
    rows["float32"], reference = measure(model, providers, feeds, None, labels, args, encoder)
    for preset in [*presets, *(["ort"] if args.ort else [])]:
        print(f"[{name}] {preset} ...", file=sys.stderr, flush=True)
        out = workdir / f"{name}.{preset}.onnx"
        try:
            t0 = time.perf_counter()
            if preset == "ort":  # onnxruntime's quantizer, U8S8 QDQ per-channel MinMax (its CPU calibration)
                CO.quantize_ort({"model": str(model), "output": str(out), "method": "minmax",
                                 "per_tensor": False}, calib)
                target = "onnxruntime.quantization.quantize_static (QDQ, U8S8, per-channel, MinMax)"
            elif preset == LATENCY:  # the default recipe, its plan timed (and so calibrated) on the provider
                config = onnxq.as_config({"optimize_for": "latency", "calibration": {"providers": providers}})
                result = onnxq.quantize(str(model), str(out), config=config, calibration_data=calib, progress=False)
                target = "; ".join(t for t in result.summary.note_texts if t.startswith("latency plan"))
            else:
                result = onnxq.quantize(str(model), str(out), config=config_for(preset, calib_providers),
                                        calibration_data=calib, progress=False)
                target = next((line for line in onnxq.format_summary(result.summary).splitlines()
                               if "target" in line), "")
            quant_s = time.perf_counter() - t0
            row, _ = measure(out, providers, feeds, reference, labels, args, encoder)
            row.update(quant_s=quant_s, target=target.strip(), size_mb=C.file_mb(out))
        except Exception as exc:  # noqa: BLE001 - a failing preset is a row, not the end
            row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
        rows[preset] = row
    return rows


def print_rows(name: str, rows: dict[str, Any], batches: list[int], provider: str) -> None:
    base = rows["float32"]["latency_ms"]
    print(f"\n## {name}")
    head = "| variant | nodes on provider / fallen back to CPU | op types on the CPU | top-1 | agree | SQNR dB | " + \
        " | ".join(f"b{b} ms (x float)" for b in batches) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for variant, r in rows.items():
        if "error" in r:
            print(f"| {variant} | failed: {r['error']} |")
            continue
        nodes = r["placement"]["nodes"]
        cpu = nodes.get("CPUExecutionProvider", 0)
        on = sum(nodes.values()) - (0 if provider == "CPUExecutionProvider" else cpu)
        cpu = 0 if provider == "CPUExecutionProvider" else cpu
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["placement"]["cpu_ops"].items())) or "-"
        lat = " | ".join(
            f"{r['latency_ms'][str(b)]:.2f} ({r['latency_ms'][str(b)] / base[str(b)]:.2f})"
            if str(b) in r["latency_ms"] else "-" for b in batches)
        print(f"| {variant} | {on} / {cpu} | {ops} | {C.fmt(r.get('top1'), '.2f')} | "
              f"{C.fmt(r.get('agree'), '.2f')} | {C.fmt(r.get('sqnr_db'), '.1f')} | {lat} |")
        if r.get("target"):
            print(f"|  | {r['target']} |")


def print_ratios(rows: dict[str, Any], batches: list[int]) -> None:
    """onnxq's rows of the ort row's format (U8S8, the default) against onnxruntime's."""
    ours, theirs = rows.get("U8S8", {}), rows.get("ort", {})
    if "latency_ms" not in ours or "latency_ms" not in theirs:
        return
    lat = ", ".join(f"b{b} {ours['latency_ms'][str(b)] / theirs['latency_ms'][str(b)]:.2f}"
                    for b in batches if str(b) in ours["latency_ms"] and str(b) in theirs["latency_ms"])
    sq = (f"; SQNR {ours['sqnr_db']:.1f} against {theirs['sqnr_db']:.1f} dB"
          if "sqnr_db" in ours and "sqnr_db" in theirs else "")
    print(f"\nonnxq U8S8 / onnxruntime latency: {lat}; quantize time "
          f"{ours['quant_s'] / max(theirs['quant_s'], 1e-9):.2f}{sq}")


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="CPUExecutionProvider",
                   help="execution provider the models run on (default: CPUExecutionProvider)")
    p.add_argument("--calib-provider", help="provider onnxq calibrates on (default: --provider)")
    p.add_argument("--models", nargs="+", default=["resnet20", "mobilenet"],
                   choices=["resnet20", "mobilenet", "minilm", "none"],
                   help="shared models to run besides the synthetic MLP (none: the MLP alone)")
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                   help=f"onnxq presets (default: {' '.join(DEFAULT_PRESETS)}; the MLP adds W8_DYNAMIC), "
                        f"or {LATENCY}: the default recipe with optimize_for latency timed on the provider")
    p.add_argument("--no-ort", dest="ort", action="store_false",
                   help="leave out the onnxruntime.quantization row (quantize_static U8S8)")
    p.add_argument("--no-mlp", dest="mlp", action="store_false", help="leave out the synthetic MLP")
    p.add_argument("--samples", type=int, default=200, help="calibration images")
    p.add_argument("--eval-samples", type=int, default=400, help="evaluation samples after them")
    p.add_argument("--eval-batch", type=int, default=32, help="batch of the accuracy runs")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32], help="latency batch sizes")
    p.add_argument("--runs", type=int, default=20, help="timed runs per latency figure (median)")
    p.add_argument("--shared-dir", type=Path, default=C.default_shared_dir())
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    from onnxq.config.presets import PRESETS

    unknown = [pr for pr in args.presets if pr not in PRESETS and pr != LATENCY]
    if unknown:
        p.error(f"unknown preset {', '.join(unknown)}; presets: {', '.join(PRESETS)}")
    if args.provider not in ort.get_available_providers():
        print(f"error: {args.provider} is not available in this onnxruntime "
              f"({ort.get_available_providers()})", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"provider": args.provider, "onnxruntime": ort.__version__,
                              "models": {}}
    with tempfile.TemporaryDirectory(prefix="onnxq_providers_") as tmp:
        workdir = Path(tmp)
        if args.shared_dir and (args.shared_dir / "models").is_dir():
            ns = argparse.Namespace(samples=args.samples, text_samples=256,
                                    eval_samples=args.eval_samples, models=args.models)
            for task in CO.shared_tasks(ns, args.shared_dir):
                calib = CO.load_calibration(task.calib_spec)
                feeds, labels, _ = task.load_eval()
                rows = model_report(task.name, task.model, calib, feeds,
                                    labels if task.kind == "classifier" else None, args, workdir,
                                    args.presets)
                report["models"][task.name] = rows
                print_rows(task.name, rows, args.batches, args.provider)
                print_ratios(rows, args.batches)
        if args.mlp:
            path, calib, feeds = mlp_task(workdir)
            mlp_presets = list(dict.fromkeys([*args.presets, "W8_DYNAMIC"]))
            rows = model_report("mlp", path, calib, feeds, None, args, workdir, mlp_presets)
            report["models"]["mlp"] = rows
            print_rows("mlp (synthetic, 4 x MatMul 1024)", rows, args.batches, args.provider)
            print_ratios(rows, args.batches)
    if args.json:
        args.json.write_text(json.dumps(C.jsonable(report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
