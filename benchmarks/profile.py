#!/usr/bin/env python
"""Where quantizing spends its time: each stage's share, against the physical floor.

    python benchmarks/profile.py                                   # shared models + bundled example
    python benchmarks/profile.py --models mobilenet --recipes default FP8_E4M3 pt_adaround
    python benchmarks/profile.py --models digits --cprofile 25     # plus the hottest functions

For each model and recipe, one child process loads the calibration data, measures the
floor (one float inference pass over the same data, at the calibration batch size, in a
default onnxruntime session: the cost of the forward pass calibration is built on), then
times `onnxq.quantize` and records each stage's seconds from the summary (`load`,
`optimise`, `calibrate`, `emit`, `check`, `save`; `other` is what no stage accounts
for) and the child's peak RSS. The table prints every stage's share of the wall time and
its ratio to the floor. `--cprofile K` adds the K functions with the most cumulative time.

Models: `mobilenet`, `resnet20`, `minilm` (../shared, skipped when absent: the first 200
images / 256 sentences, as compare_ort.py) and `digits` (models/, bundled). Recipes:
`default` (no config: what `onnxq quantize in out --calib-data d` does), any preset name,
`pt_adaround` / `pt_adaquant` (per-tensor int8 weights with AdaRound / AdaQuant, the
issue-36 settings).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common as C
import numpy as np

# This file's folder comes first on sys.path and its name is the standard library's
# `profile`, which cProfile imports: import both with the folder out of the way.
_HERE = sys.path.pop(0)
import cProfile  # noqa: E402
import pstats  # noqa: E402

sys.path.insert(0, _HERE)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mobilenet", "resnet20", "minilm", "digits")
STAGES = ("load", "optimise", "calibrate", "emit", "check", "save")
PER_TENSOR = {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}}
RECIPES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "pt_adaround": ("U8S8", {**PER_TENSOR, "algo_config": [{"name": "adaround"}]}),
    "pt_adaquant": ("U8S8", {**PER_TENSOR, "algo_config": [{"name": "adaquant"}]}),
}


def calibration_arrays(model: str, shared: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The model file and its calibration arrays (compare_ort.py's protocol)."""
    if model == "digits":
        path = ROOT / "models" / "digits_cnn.onnx"
        with np.load(ROOT / "models" / "digits_calib.npz") as data:
            return path, {k: data[k] for k in data.files}
    if model == "minilm":
        rows = C.stsb_rows(C.stsb_split(256, None)[0])
        return shared / "models" / "all_minilm_l6_v2.onnx", C.load_stsb(shared / "data" / "stsb_dev", rows)
    if model == "mobilenet":
        x, _ = C.load_imagenet(shared / "data" / "imagenet_sample1000", 0, 200)
        return shared / "models" / "mobilenet_v1_075.onnx", {"input": x}
    x, _ = C.load_cifar(shared / "data" / "cifar10_test2000", 0, 200)
    return shared / "models" / "resnet20_cifar10.onnx", {"input": x}


def float_pass(path: Path, arrays: dict[str, np.ndarray], batch: int) -> float:
    """Seconds of one pass over `arrays` in a default session (best of two)."""
    session = C.make_session(path)
    names = {i.name for i in session.get_inputs()}
    feeds = [{k: v for k, v in b.items() if k in names} for b in C.batches(arrays, batch)]
    session.run(None, feeds[0])  # warm-up: first-run allocations are not the floor
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for feed in feeds:
            session.run(None, feed)
        best = min(best, time.perf_counter() - start)
    return best


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One (model, recipe): the floor, then the timed quantize call."""
    import onnxq

    path, arrays = calibration_arrays(job["model"], Path(job["shared"]))
    preset, overrides = RECIPES.get(job["recipe"], (job["recipe"], {}))
    config = None if preset == "default" else onnxq.compose_config(preset, None, overrides)
    from onnxq.calibrate.runner import calibration_batch
    from onnxq.graph.load import load_model

    calibration = (config if config is not None else onnxq.compose_config()).calibration
    batch = calibration_batch(load_model(str(path))[0], calibration)
    floor = float_pass(path, arrays, batch)
    profiler = cProfile.Profile() if job["cprofile"] else None
    with tempfile.TemporaryDirectory(prefix="onnxq-profile-") as tmp:
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        result = onnxq.quantize(str(path), str(Path(tmp) / "out.onnx"), config, arrays, progress=False)
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - start
    hot = ""
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(job["cprofile"])
        hot = text.getvalue()
    return {"floor_s": floor, "wall_s": wall, "stages": dict(result.summary.stage_seconds),
            "peak_rss_mb": C.peak_rss_mb(), "batch": batch, "samples": C.num_samples(arrays), "hot": hot}


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", f.name], capture_output=True, text=True,
                              timeout=job["timeout"])
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(model: str, recipe: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{model} / {recipe}: {r['error']}"
    floor, wall = r["floor_s"], r["wall_s"]
    stages = {s: r["stages"].get(s, 0.0) for s in STAGES}
    stages["other"] = max(wall - sum(stages.values()), 0.0)
    lines = [f"{model} / {recipe}: {r['samples']} samples, batch {r['batch']}; float pass {floor:.2f} s; "
             f"quantize {wall:.2f} s = {wall / floor:.2f}x the float pass; peak RSS {r['peak_rss_mb']:.0f} MB",
             f"  {'stage':<10}{'s':>8}{'share':>8}{'x float':>9}"]
    lines += [f"  {s:<10}{v:>8.2f}{100 * v / wall:>7.1f}%{v / floor:>9.2f}" for s, v in stages.items() if v > 0]
    return "\n".join(lines) + ("\n" + r["hot"] if r["hot"] else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--recipes", nargs="+", default=["default"])
    parser.add_argument("--shared-dir", type=Path, default=C.default_shared_dir())
    parser.add_argument("--cprofile", type=int, default=0, metavar="K")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return 0
    print(f"{C.cpu_line()}; load average {C.load_average()[0]:.2f}")
    report: dict[str, Any] = {}
    for model in args.models:
        if model != "digits" and not (args.shared_dir / "models").is_dir():
            print(f"{model}: skipped ({args.shared_dir} not found)")
            continue
        for recipe in args.recipes:
            job = {"model": model, "recipe": recipe, "shared": str(args.shared_dir), "cprofile": args.cprofile,
                   "timeout": args.timeout}
            result = run_child(job)
            report[f"{model}/{recipe}"] = result
            print(table(model, recipe, result), flush=True)
    print(f"load average at end {C.load_average()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
