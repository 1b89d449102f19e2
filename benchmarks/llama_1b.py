#!/usr/bin/env python
"""A random-weight Llama of TinyLlama-1.1B's shape as an onnxruntime-genai folder (4.4 GB
of fp32 weights in model.onnx.data), quantized by onnxq: time and peak RSS of RTN and GPTQ
against the bound "1.5 GiB plus the largest layer".

    python benchmarks/llama_1b.py --out /work/llm/llama1b                # build if missing, then RTN
    python benchmarks/llama_1b.py --out DIR --rows rtn gptq [--windows 8] [--tokens 256]
    python benchmarks/llama_1b.py --out DIR --rows gptq --max-samples 2 --profile
    python benchmarks/llama_1b.py --out DIR --build-only [--layers 2]    # the folder alone

The folder is TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads,
intermediate 5632, vocabulary 32000, untied embedding and LM head, context 2048), written
by `tests/genai_model.py` as the model builder writes it, seeded, each weight streamed to
model.onnx.data as it is drawn (a few hundred MB). Each quantization runs in its own worker
process (`common.spawn_worker`): wall time and peak RSS of the `onnxq.quantize` call,
the stage times, and the Python stack at the RSS peak (a sampler thread); `--profile` adds
the worker's cProfile top entries. The output folder is then opened in onnxruntime (one
prefill, finite logits) and, where onnxruntime-genai is importable, generates a few tokens.
GPTQ calibrates on random token windows (random weights: time and memory, not accuracy).
Quantized folders go to `<out>.q/<row>/` (`--work` to choose another folder).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import common as C
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the genai folder builder

# TinyLlama-1.1B (untied embedding and LM head, as it has them).
TINYLLAMA = {"layers": 22, "hidden": 2048, "heads": 32, "kv_heads": 4, "vocab": 32000,
             "intermediate": 5632, "context_length": 2048, "tie_embeddings": False}
BOUND_MB = 1536  # "1.5 GB" of the target (MiB, as every RSS here), plus the largest layer
ROWS = {"rtn": [], "gptq": [{"name": "gptq"}], "awq": [{"name": "awq"}]}


def build(folder: Path, layers: int) -> dict[str, Any]:
    """The float folder (seeded); its build time and this process's peak RSS."""
    from genai_model import build_genai_folder

    start = time.perf_counter()
    build_genai_folder(folder, **{**TINYLLAMA, "layers": layers})
    return {"build_s": time.perf_counter() - start, "build_peak_rss_mb": C.peak_rss_mb()}


def weights(folder: Path) -> tuple[int, str, int]:
    """(parameter count, largest weight's name, its bytes in float32) from model.onnx."""
    import onnx

    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in proto.graph.initializer}
    name = max(sizes, key=sizes.get)
    return sum(sizes.values()), name, 4 * sizes[name]


class PeakStack:
    """Samples this process's RSS every `interval` s; keeps a timeline and the main
    thread's onnxq stack when the RSS reached its peak (where the memory went)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak, self.stack, self.timeline = interval, 0.0, [], []
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE") / 2**20

    def _rss(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        start, last = time.perf_counter(), -1.0
        while not self._stop.wait(self.interval):
            rss, now = self._rss(), time.perf_counter() - start
            if now - last >= 1.0:
                self.timeline.append((round(now, 1), round(rss)))
                last = now
            if rss > self.peak + 8:
                self.peak = rss
                frame = sys._current_frames().get(self._main)
                self.stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                              for f in traceback.extract_stack(frame) if "onnxq" in f.filename][-12:]

    def __enter__(self) -> PeakStack:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def quantize(job: dict[str, Any]) -> dict[str, Any]:
    """Worker: quantize the folder with the job's row; time, RSS, stages, peak stack."""
    import onnxq

    overrides: dict[str, Any] = {"algo_config": ROWS[job["row"]]}
    if job.get("max_samples"):
        overrides["calibration"] = {"max_samples": job["max_samples"]}
    config = onnxq.compose_config("W4_GROUP128", None, overrides)
    windows = job.get("windows") if job["row"] != "rtn" else None

    def run() -> Any:
        return onnxq.quantize(job["folder"], job["out"], config, windows, progress=job.get("progress", False))

    profiler = None
    if job.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
    with PeakStack() as sampler:
        result, stats = C.measure_call(run if profiler is None else lambda: profiler.runcall(run))
    if profiler is not None:
        import io
        import pstats

        for sort in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(25)
            stats[f"profile_{sort}"] = text.getvalue()
        profiler.dump_stats(job["profile"])
    summary = result.summary
    return {**stats, "stages_s": dict(summary.stage_seconds), "peak_stack": sampler.stack,
            "sampled_peak_mb": sampler.peak, "timeline": sampler.timeline,
            "notes": [n.text for n in summary.notes]}


def check_output(folder: Path, config: dict[str, Any], new_tokens: int = 8) -> str:
    """One prefill in onnxruntime (finite logits) and, where onnxruntime-genai imports,
    greedy tokens from it; a line saying what ran."""
    import onnxruntime as ort

    decoder = config["model"]["decoder"]
    start = time.perf_counter()
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    tokens = np.arange(10, 26, dtype=np.int64)[None]
    feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens)}
    feeds |= {f"past_key_values.{i}.{kind}": np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]),
                                                      np.float32)
              for i in range(decoder["num_hidden_layers"]) for kind in ("key", "value")}
    logits = session.run(["logits"], feeds)[0]
    del session
    line = (f"onnxruntime: prefill of {tokens.shape[1]} tokens, logits {'finite' if np.isfinite(logits).all() else 'NOT FINITE'}"
            f" ({time.perf_counter() - start:.1f} s with the session)")
    try:
        import onnxruntime_genai as og
    except ImportError as error:
        return f"{line}; onnxruntime-genai not importable ({error})"
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=tokens.shape[1] + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(tokens[0].astype(np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    made = [int(t) for t in generator.get_sequence(0)[tokens.shape[1]:]]
    return f"{line}; onnxruntime-genai generated {made}"


def main(argv: list[str] | None = None) -> int:
    p = C.harness_parser(__doc__, (), ["quantize"])
    p.add_argument("--out", type=Path, help="the float folder (built here when missing)")
    p.add_argument("--rows", nargs="*", default=["rtn"], choices=list(ROWS))
    p.add_argument("--layers", type=int, default=TINYLLAMA["layers"], help="decoder layers (22: 1.1B)")
    p.add_argument("--rebuild", action="store_true", help="build the folder even when it exists")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--windows", type=int, default=8, help="GPTQ/AWQ: random token windows")
    p.add_argument("--tokens", type=int, default=256, help="GPTQ/AWQ: tokens per window")
    p.add_argument("--max-samples", type=int, help="GPTQ/AWQ: calibrate on at most this many windows")
    p.add_argument("--profile", action="store_true", help="cProfile each worker; top entries printed")
    p.add_argument("--progress", action="store_true", help="progress bars in the worker's log (<out>.q/<row>.log)")
    p.add_argument("--work", type=Path, help="where the quantized folders, jobs and logs go (default <out>.q): "
                   "give concurrent runs their own")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    if args.worker:
        return C.answer_job(args.job, quantize)
    if args.out is None:
        p.error("--out FOLDER is required")
    import compare_ort as CO

    t0 = time.perf_counter()
    report = C.start_report(args, {**CO.machine_info(), "cpu_flags": C.cpu_flags(), "git_revision": C.git_revision()})
    folder = args.out
    if args.rebuild or not (folder / "genai_config.json").is_file():
        report["build"] = build(folder, args.layers)
        print(f"built {folder} in {report['build']['build_s']:.0f} s, peak RSS "
              f"{report['build']['build_peak_rss_mb']:.0f} MiB", flush=True)
    params, largest, largest_bytes = weights(folder)
    config = json.loads((folder / "genai_config.json").read_text())
    bound = BOUND_MB + largest_bytes / 2**20
    print(f"{folder}: {params / 1e9:.2f}B parameters, {C.file_mb(folder / 'model.onnx') / 1e3:.2f} GB; largest "
          f"weight {largest} ({largest_bytes / 2**20:.0f} MiB float32); bound 1.5 GiB + it = {bound:.0f} MiB; "
          f"CPU flags: {C.cpu_flags()}; {os.cpu_count()} cores", flush=True)
    report.update(parameters=params, largest_weight=largest, largest_weight_mb=largest_bytes / 2**20, bound_mb=bound)
    if args.build_only:
        return C.finish_report(report, t0, args.json)
    work = args.work or Path(f"{folder}.q")
    work.mkdir(parents=True, exist_ok=True)
    windows = work / f"windows_{args.windows}x{args.tokens}.npz"
    if not windows.exists():
        ids = np.random.default_rng(0).integers(3, config["model"]["vocab_size"], (args.windows, args.tokens))
        np.savez(windows, input_ids=ids.astype(np.int64))
    rows = report.setdefault("rows", {})
    for row in args.rows:
        job = {"row": row, "folder": str(folder), "out": str(work / row), "windows": str(windows),
               "max_samples": args.max_samples, "progress": args.progress,
               "profile": str(work / f"{row}.prof") if args.profile else None}
        res = C.spawn_worker(__file__, "quantize", job, work, row, args.timeout)
        rows[row] = res
        if "error" in res:
            print(f"{row}: FAILED {res['error']}\n{res.get('log_tail', '')[-1500:]}", flush=True)
            continue
        res["size_mb"] = sum(f.stat().st_size for f in (work / row).glob("model.onnx*")) / 2**20
        verdict = "under" if res["peak_rss_mb"] <= bound else "OVER"
        print(f"{row}: {res['time_s']:.1f} s, peak RSS {res['peak_rss_mb']:.0f} MiB ({verdict} the bound "
              f"{bound:.0f} MiB; {res['rss_before_mb']:.0f} MiB before the call), output "
              f"{res['size_mb']:.0f} MiB", flush=True)
        print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in res["stages_s"].items()))
        print("  at the peak: " + " < ".join(reversed(res["peak_stack"][-6:])))
        for sort in ("cumulative", "tottime"):
            if f"profile_{sort}" in res:
                print(res[f"profile_{sort}"])
        res["check"] = check_output(work / row, config)
        print(f"  {res['check']}", flush=True)
    return C.finish_report(report, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
