#!/usr/bin/env python
"""Weight-only int4 on a real LLM: perplexity of SmolLM2-135M, onnxq against onnxruntime.

    python benchmarks/llm_int4.py [LLM_DIR] [--seq 256] [--windows 24] [--blocks 128 32] [--json OUT]

LLM_DIR (default: $ONNXQ_LLM_DIR, else ../shared/llm) holds what
../shared/tools/llm/export_smollm2.py writes: `smollm2_fp32_s{SEQ}.onnx` and
`ppl_stsb_s{SEQ}.npz`. Without them the script says so and exits 0.

For each block size, the MatMul weights (every linear layer and the LM head) become int4
symmetric MatMulNBits:
  ort-rtn     onnxruntime's `MatMulNBitsQuantizer` default RTN path
              (`DefaultWeightOnlyQuantConfig`, `is_symmetric=True`)
  onnxq       `onnxq.quantize`, int4 per-group on MatMul (W4_GROUP128's MatMul spec), data-free
              default: full-range RTN, the same arithmetic as onnxruntime's
  onnxq-mse   the same with the data-free per-block clipping search forced on (weight MSE)
  onnxq-act   the clipping search weighted by activation importance: mean x^2 of each input
              channel over the export's `calib` windows (disjoint from the scored ones),
              through onnxq's emitter API (`emit_matmul_nbits(importance=...)`)
`--with-embedding` adds onnxq with W4_GROUP128's coverage (the embedding Gather as int4
GatherBlockQuantized too). Each quantizer runs in its own subprocess
(`--worker onnxq|ort --job JOB`); time and peak RSS are those of the quantize call
(onnxq-act's includes its calibration). Every model, float32 included, is then scored on
the same first `--windows` evaluation windows: perplexity = exp(mean over predicted
tokens of -log softmax(logits)[next token]), log-softmax in float64. See benchmarks/README.md.
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


def default_llm_dir(shared_dir: Path) -> Path:
    """$ONNXQ_LLM_DIR, else ../shared/llm next to the repository."""
    return Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else shared_dir / "llm"


def model_files(llm_dir: Path, seq: int) -> tuple[Path, Path]:
    return llm_dir / f"smollm2_fp32_s{seq}.onnx", llm_dir / f"ppl_stsb_s{seq}.npz"


# =========================================================================== worker side


def onnxq_config(block: int, embedding: bool) -> Any:
    """int4 symmetric MatMulNBits in blocks of `block` for MatMul (and Gather), nothing else."""
    from onnxq.config import config_from_dict

    int4 = {"weight": {"dtype": "int4", "symmetric": True, "qscheme": "per_group", "group_size": block}}
    types = {"MatMul": int4, **({"Gather": int4} if embedding else {})}
    return config_from_dict({
        "global_quant_config": {"input_tensors": None, "output_tensors": None, "weight": None, "bias": None},
        "layer_type_quant_config": types,
        "matmul_nbits": True,
    })


def force_clip_search(on: bool) -> None:
    """Turn onnxq's data-free 4-bit clipping search on or off (until the config carries it)."""
    import onnxq.emit.gather_block_quantized as gbq
    import onnxq.emit.matmul_nbits as nbits

    blockwise, weight = nbits.quantize_blockwise, gbq.quantize_weight
    nbits.quantize_blockwise = lambda w, spec, scale_dtype=np.float32, clip_search=None, importance=None: (
        blockwise(w, spec, scale_dtype, on, importance))
    gbq.quantize_weight = lambda *a, **k: weight(*a, **{**k, "clip_search": on})


def activation_importance(model: str, windows: np.ndarray) -> dict[str, np.ndarray]:
    """Mean x^2 of each channel of every MatMul's input A over `windows` (float model)."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(model)
    weights = {i.name for i in proto.graph.initializer}
    acts = sorted({n.input[0] for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in weights})
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(a, onnx.TensorProto.FLOAT, None) for a in acts)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del proto
    sums = {a: 0.0 for a in acts}
    for row in windows:
        for a, out in zip(acts, sess.run(acts, {"input_ids": row[None]})):
            sums[a] = sums[a] + np.square(out.reshape(-1, out.shape[-1]), dtype=np.float64).mean(axis=0)
    return {a: v / len(windows) for a, v in sums.items()}


def quantize_onnxq_importance(job: dict[str, Any]) -> None:
    """onnxq's emitter with the search weighted by activation importance (calibration
    windows of the export): load_model + emit_matmul_nbits(importance=...) + save_model."""
    from onnxq.config.resolve import merge_specs
    from onnxq.config.spec import QuantizationSpec
    from onnxq.emit.matmul_nbits import can_use_matmul_nbits, emit_matmul_nbits
    from onnxq.graph.load import load_model
    from onnxq.graph.save import save_model

    with np.load(job["data"]) as npz:
        calib = npz["calib"][: job["calib_windows"]]
    by_input = activation_importance(job["model"], calib)
    model, _ = load_model(job["model"])
    spec = merge_specs([QuantizationSpec(dtype="int4", symmetric=True, qscheme="per_group",
                                         group_size=job["block"])], "weight")
    nodes = {n.name: spec for n in model.graph if can_use_matmul_nbits(n, spec) is None}
    importance = {n.name: by_input[n.inputs[0].name] for n in model.graph if n.name in nodes}
    emit_matmul_nbits(model, nodes, importance=importance)
    save_model(model, job["output"])


def quantize_onnxq(job: dict[str, Any]) -> dict[str, Any]:
    import onnxq

    if job["search"] == "importance":
        _, stats = C.measure_call(lambda: quantize_onnxq_importance(job))
        return stats
    force_clip_search(job["search"] == "mse")
    config = onnxq_config(job["block"], job["embedding"])
    result, stats = C.measure_call(lambda: onnxq.quantize(job["model"], job["output"], config))
    return {**stats, "quantized_by_op": dict(result.summary.quantized_by_op)}


def quantize_ort(job: dict[str, Any]) -> dict[str, Any]:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    def run() -> None:
        quantizer = MatMulNBitsQuantizer(job["model"], bits=4, block_size=job["block"], is_symmetric=True)
        quantizer.process()
        quantizer.model.save_model_to_file(job["output"])

    _, stats = C.measure_call(run)
    return stats


def worker_main(role: str, job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401  both sides import both

    import onnxq  # noqa: F401

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
    """Quantized variants to build: tag, role, block, search (plain, mse, importance)."""
    rows = []
    for block in args.blocks:
        rows.append({"tag": f"ort-rtn-b{block}", "role": "ort", "block": block})
        for search, tag in (("plain", "onnxq"), ("mse", "onnxq-mse"), ("importance", "onnxq-act")):
            rows.append({"tag": f"{tag}-b{block}", "role": "onnxq", "block": block, "search": search,
                         "embedding": False, "calib_windows": args.calib_windows})
        if args.with_embedding:
            rows.append({"tag": f"onnxq+emb-b{block}", "role": "onnxq", "block": block, "search": "plain",
                         "embedding": True})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per model, then the ratios to float32 and to onnxruntime's RTN."""
    base = next(r["ppl"] for r in rows if r["tag"] == FLOAT)
    ort = {r["block"]: r["ppl"] for r in rows if r.get("role") == "ort" and "ppl" in r}
    print(f"{'model':<18} {'block':>5} {'quant s':>8} {'peak MB':>8} {'size MB':>8} {'ppl':>9} "
          f"{'/float':>7} {'/ort':>7} {'+ppl/ort+ppl':>12} {'s/window':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['tag']:<18} {r.get('block', '-'):>5}  FAILED: {r['error']}")
            continue
        ref = ort.get(r.get("block"))
        vs_ort = f"{r['ppl'] / ref:7.3f}" if ref else f"{'-':>7}"
        gap = f"{(r['ppl'] - base) / (ref - base):12.2f}" if ref and ref != base else f"{'-':>12}"
        quant = f"{r['time_s']:8.1f}" if "time_s" in r else f"{'-':>8}"
        peak = f"{r['peak_rss_mb']:8.0f}" if "peak_rss_mb" in r else f"{'-':>8}"
        print(f"{r['tag']:<18} {r.get('block', '-'):>5} {quant} {peak} {r['size_mb']:8.1f} "
              f"{r['ppl']:9.4f} {r['ppl'] / base:7.3f} {vs_ort} {gap} {r['s_per_window']:8.2f}")
    print("+ppl/ort+ppl: perplexity increase over float32 relative to onnxruntime RTN's at the "
          "same block size (below 1: onnxq loses less)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = C.harness_parser(__doc__, (), ["onnxq", "ort"])
    p.add_argument("llm_dir", nargs="?", type=Path, default=None,
                   help=f"export folder (default ${ENV_DIR}, else ../shared/llm)")
    p.add_argument("--seq", type=int, default=256, help="window length of the export (default 256)")
    p.add_argument("--windows", type=int, default=24, help="evaluation windows scored (default 24)")
    p.add_argument("--blocks", type=int, nargs="+", default=[128, 32], help="block sizes (default 128 32)")
    p.add_argument("--calib-windows", type=int, default=8,
                   help="calibration windows (the export's `calib`) for onnxq-act's importance (default 8)")
    p.add_argument("--with-embedding", action="store_true",
                   help="also onnxq with the embedding table as int4 (W4_GROUP128's coverage)")
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
        print(f"llm_int4: no {model.name} / {data.name} in {args.llm_dir}; export them with "
              f"../shared/tools/llm/export_smollm2.py --out DIR --seq {args.seq} (see its docstring). Skipped.")
        return 0
    import compare_ort as CO

    t0 = time.perf_counter()
    report = C.start_report(args, {**CO.machine_info(), "git_revision": C.git_revision()})
    with np.load(data) as npz:
        windows = npz["eval"][: args.windows]
    print(f"{model.name}: {len(windows)} eval windows x {args.seq} tokens; blocks {args.blocks}")
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="llm_int4_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        ppl, per_window = perplexity(model, windows, args.threads)
        rows.append({"tag": FLOAT, "ppl": ppl, "s_per_window": per_window, "size_mb": C.file_mb(model)})
        for variant in variants(args):
            job = {**variant, "model": str(model), "data": str(data)}
            result = C.spawn_worker(__file__, variant["role"], job, workdir, variant["tag"], args.timeout)
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
            print(f"  {variant['tag']}: " + (row.get("error") or f"ppl {row['ppl']:.4f}"), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows)
    report["models"] = {"smollm2_135m": rows}
    return C.finish_report(report, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
