#!/usr/bin/env python
"""LLM weight-only int4: perplexity of SmolLM2-135M, onnxq's RTN / HQQ / GPTQ / AWQ
against onnxruntime's `MatMulNBitsQuantizer` (RTN, HQQ, optionally GPTQ), in one run.

    python benchmarks/llm.py [LLM_DIR] [--blocks 128 32] [--windows 24] [--calib-windows 16]
                             [--ort-python PY] [--ort-gptq] [--only ROW...] [--json OUT]

LLM_DIR (default: $ONNXQ_LLM_DIR, else ../shared/llm) holds what
../shared/tools/llm/export_smollm2.py writes: `smollm2_fp32_s{SEQ}.onnx` and
`ppl_stsb_s{SEQ}.npz` (its `calib` windows, then `eval`). Without them the script says
so and exits 0.

Rows per block size (every MatMul with a constant weight, LM head included, becomes
MatMulNBits; the embedding stays float):
  onnxq-rtn       int4 symmetric, round to nearest with the per-block clipping search (default)
  onnxq-rtn-asym  uint4 asymmetric min-max
  onnxq-hqq       `--algorithm hqq`: half-quadratic float zero points, no data
  onnxq-gptq      `--algorithm gptq` (true-sequential, int4 symmetric)
  onnxq-awq       `--algorithm awq` (int4 symmetric)
  onnxq-awq-hqq   `--algorithm awq` on uint4 asymmetric weights with `calib_method: hqq`
                  (AWQ's scaling, then half-quadratic float zero points)
  ort-rtn         onnxruntime's default RTN (`DefaultWeightOnlyQuantConfig`, symmetric)
  ort-hqq         `HQQWeightOnlyQuantConfig` (imports torch: give `--ort-python` an
                  interpreter that has torch and onnxruntime, else the row says so)
  ort-gptq        `GPTQWeightOnlyQuantConfig` with the same calibration windows, only with
                  `--ort-gptq` (its numpy path took 24 minutes here and diverged)
GPTQ and AWQ calibrate on `--calib-windows` windows: the export's `calib` split, then
windows from the end of `eval`, never ones that are scored. Each quantizer runs in its own
subprocess; time and peak RSS are the quantize call's (peak/file: peak RSS over the float
model file). Every model is scored in a default onnxruntime session on the first
`--windows` eval windows: perplexity = exp(mean -log softmax(logits)[next token]),
log-softmax in float64; s/window is that session's latency per 256-token window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Runs as a script: benchmarks/ is sys.path[0], so the helpers import as top-level modules.
import common as C
import numpy as np

FLOAT = "float32"
ENV_DIR = "ONNXQ_LLM_DIR"
ONNXQ_ROWS = ("rtn", "rtn-asym", "hqq", "gptq", "awq", "awq-hqq")


def default_llm_dir(shared_dir: Path) -> Path:
    """$ONNXQ_LLM_DIR, else ../shared/llm next to the repository."""
    return Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else shared_dir / "llm"


def model_files(llm_dir: Path, seq: int) -> tuple[Path, Path]:
    return llm_dir / f"smollm2_fp32_s{seq}.onnx", llm_dir / f"ppl_stsb_s{seq}.npz"


def calibration_windows(data: str, count: int, scored: int) -> np.ndarray:
    """`count` calibration windows: the export's calib split, then the last eval windows
    (disjoint from the first `scored` eval windows, which are scored)."""
    with np.load(data) as npz:
        calib, evaluation = npz["calib"], npz["eval"]
    extra = max(0, count - len(calib))
    if extra > len(evaluation) - scored:
        raise SystemExit(f"--calib-windows {count} would overlap the {scored} scored windows")
    return np.concatenate([calib[:count], evaluation[len(evaluation) - extra:]]) if extra else calib[:count]


# =========================================================================== worker side


def onnxq_config(row: str, block: int) -> dict[str, Any]:
    """W4_GROUP128's MatMul coverage at `block`, the embedding kept float, and the row's
    algorithm (what `--algorithm ROW --per-group BLOCK` gives on the CLI)."""
    weight = {"dtype": "int4", "symmetric": True}
    if row == "rtn-asym":
        weight = {"dtype": "uint4", "symmetric": False}
    elif row == "awq-hqq":
        weight = {"dtype": "uint4", "symmetric": False, "calib_method": "hqq"}
    algorithm = [] if row.startswith("rtn") else [{"name": row.split("-")[0]}]
    return {"preset": "W4_GROUP128", "algo_config": algorithm, "layer_type_quant_config": {
        "MatMul": {"weight": {**weight, "qscheme": "per_group", "group_size": block}},
        "Gather": {"weight": {"dtype": "float32"}}}}


def quantize_onnxq(job: dict[str, Any]) -> dict[str, Any]:
    import onnxq

    data = None
    if job["row"] in ("gptq", "awq", "awq-hqq"):
        data = {"input_ids": calibration_windows(job["data"], job["calib_windows"], job["scored"])}
    config = onnxq.as_config(onnxq_config(job["row"], job["block"]))
    result, stats = C.measure_call(lambda: onnxq.quantize(job["model"], job["output"], config, data,
                                                          progress=False))
    return {**stats, "notes": [n for n in result.summary.note_texts if job["row"].split("-")[0] in n.lower()]}


def quantize_ort(job: dict[str, Any]) -> dict[str, Any]:
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    block, row = job["block"], job["row"]

    def run() -> None:
        if row == "hqq":
            algo = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
        elif row == "gptq":
            windows = calibration_windows(job["data"], job["calib_windows"], job["scored"])

            class Reader:
                def __init__(self) -> None:
                    self.rows = iter(windows)

                def get_next(self) -> dict[str, np.ndarray] | None:
                    row_ = next(self.rows, None)
                    return None if row_ is None else {"input_ids": row_[None]}

                def rewind(self) -> None:
                    self.rows = iter(windows)

            algo = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(), block_size=block)
        else:
            algo = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True)
        quantizer = mnq.MatMulNBitsQuantizer(job["model"], bits=4, block_size=block, is_symmetric=True,
                                             algo_config=algo)
        quantizer.process()
        quantizer.model.save_model_to_file(job["output"])

    _, stats = C.measure_call(run)
    return stats


def worker_main(role: str, job_path: str) -> int:
    import logging

    logging.disable(logging.INFO)  # onnxruntime's quantizer logs a line per node
    job = json.loads(Path(job_path).read_text())
    result = quantize_onnxq(job) if role == "onnxq" else quantize_ort(job)
    Path(job["result"]).write_text(json.dumps(C.jsonable(result), indent=2))
    return 0


# =========================================================================== parent side


def perplexity(path: Path, windows: np.ndarray, threads: int) -> tuple[float, float]:
    """(perplexity over `windows`, seconds per window) of the model at `path`."""
    sess = C.make_session(path, threads=threads)
    nll, count, t0 = 0.0, 0, time.perf_counter()
    for row in windows:
        logits = sess.run(None, {"input_ids": row[None]})[0][0, :-1].astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll += float(np.sum(log_z - logits[np.arange(len(logits)), row[1:]]))
        count += len(row) - 1
    return float(np.exp(nll / count)), (time.perf_counter() - t0) / len(windows)


def variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Quantized variants to build: tag, role (onnxq / ort), row, block."""
    rows = []
    for block in args.blocks:
        ort = ["rtn", "hqq"] + (["gptq"] if args.ort_gptq else [])
        rows += [{"tag": f"ort-{row}-b{block}", "role": "ort", "row": row, "block": block} for row in ort]
        rows += [{"tag": f"onnxq-{row}-b{block}", "role": "onnxq", "row": row, "block": block} for row in ONNXQ_ROWS]
    return [r for r in rows if not args.only or r["row"] in args.only]


def print_table(rows: list[dict[str, Any]], file_mb: float) -> None:
    """One line per model, with ratios to float32 and to onnxruntime's RTN of the block size."""
    base = next(r["ppl"] for r in rows if r["tag"] == FLOAT)
    ort = {r["block"]: r for r in rows if r.get("role") == "ort" and r.get("row") == "rtn" and "ppl" in r}
    print(f"{'model':<20} {'quant s':>8} {'/ort':>6} {'peak MB':>8} {'/file':>6} {'size MB':>8} {'ppl':>9} "
          f"{'/float':>7} {'/ort':>7} {'s/window':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['tag']:<20}  FAILED: {r['error']}")
            continue
        ref = ort.get(r.get("block"), {})
        quant = f"{r['time_s']:8.1f}" if "time_s" in r else f"{'-':>8}"
        t_ratio = f"{r['time_s'] / ref['time_s']:6.2f}" if "time_s" in r and ref else f"{'-':>6}"
        peak = f"{r['peak_rss_mb']:8.0f} {r['peak_rss_mb'] / file_mb:6.2f}" if "peak_rss_mb" in r else f"{'-':>15}"
        vs_ort = f"{r['ppl'] / ref['ppl']:7.3f}" if ref else f"{'-':>7}"
        print(f"{r['tag']:<20} {quant} {t_ratio} {peak} {r['size_mb']:8.1f} {r['ppl']:9.4f} "
              f"{r['ppl'] / base:7.3f} {vs_ort} {r['s_per_window']:8.2f}")
    print("/ort: against onnxruntime's RTN at the same block size (time, perplexity)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = C.harness_parser(__doc__, (), ["onnxq", "ort"])
    p.add_argument("llm_dir", nargs="?", type=Path, default=None,
                   help=f"export folder (default ${ENV_DIR}, else ../shared/llm)")
    p.add_argument("--seq", type=int, default=256, help="window length of the export (default 256)")
    p.add_argument("--windows", type=int, default=24, help="evaluation windows scored (default 24)")
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 32], help="block sizes (default 128 32)")
    p.add_argument("--calib-windows", type=int, default=16, help="calibration windows for GPTQ/AWQ (default 16)")
    p.add_argument("--ort-python", default=sys.executable,
                   help="interpreter for onnxruntime's quantizer (one with torch runs its HQQ)")
    p.add_argument("--ort-gptq", action="store_true", help="also onnxruntime's GPTQ (slow)")
    p.add_argument("--only", nargs="+", default=[], metavar="ROW",
                   help="only these rows of both quantizers (rtn rtn-asym hqq gptq awq awq-hqq)")
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads for scoring")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per quantizer run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.job)
    args.llm_dir = args.llm_dir or default_llm_dir(args.shared_dir)
    model, data = model_files(args.llm_dir, args.seq)
    if not model.exists() or not data.exists():
        print(f"llm: no {model.name} / {data.name} in {args.llm_dir}; export them with "
              f"../shared/tools/llm/export_smollm2.py --out DIR --seq {args.seq} (see its docstring). Skipped.")
        return 0
    import compare_ort as CO

    t0 = time.perf_counter()
    report = C.start_report(args, {**CO.machine_info(), "git_revision": C.git_revision()})
    with np.load(data) as npz:
        windows = npz["eval"][: args.windows]
    calibration_windows(str(data), args.calib_windows, args.windows)  # checked before any run
    print(f"{model.name}: {len(windows)} eval windows x {args.seq} tokens; blocks {args.blocks}; "
          f"{args.calib_windows} calibration windows for GPTQ/AWQ")
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="llm_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        ppl, per_window = perplexity(model, windows, args.threads)
        rows.append({"tag": FLOAT, "ppl": ppl, "s_per_window": per_window, "size_mb": C.file_mb(model)})
        for variant in variants(args):
            job = {**variant, "model": str(model), "data": str(data), "calib_windows": args.calib_windows,
                   "scored": args.windows}
            python = args.ort_python if variant["role"] == "ort" else sys.executable
            result = C.spawn_worker(__file__, variant["role"], job, workdir, variant["tag"], args.timeout,
                                    python=python)
            row = {**variant, **result}
            if "error" not in row:
                try:
                    row["size_mb"] = C.file_mb(row["output"])
                    row["ppl"], row["s_per_window"] = perplexity(Path(row["output"]), windows, args.threads)
                except Exception as exc:  # a model onnxruntime refuses is a row, not a crash
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    traceback.print_exc()
                if not args.keep:
                    Path(row["output"]).unlink(missing_ok=True)
            rows.append(row)
            print(f"  {variant['tag']}: " + (row.get("error") or f"ppl {row['ppl']:.4f} "
                                              f"{row.get('time_s', 0):.1f}s {row.get('peak_rss_mb', 0):.0f}MB"),
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows, C.file_mb(model))
    report["models"] = {"smollm2_135m": rows}
    return C.finish_report(report, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
