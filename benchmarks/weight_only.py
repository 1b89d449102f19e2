"""Weight-only int4 MatMul (MatMulNBits) without data: onnxq's RTN and HQQ against
onnxruntime's `MatMulNBitsQuantizer` RTN and HQQ, on the shared MiniLM (STS-B Spearman
in a default session), at blocks of 32 and 128, in one run.

    python benchmarks/weight_only.py                  # ~3 min on 2 cores
    python benchmarks/weight_only.py --blocks 128

Rows per block size: onnxq `rtn-sym` (W4_GROUP128's MatMul spec: int4 symmetric,
full-range scales), `rtn-asym` (uint4 asymmetric min-max), `hqq` (uint4 asymmetric,
half-quadratic zero points, `calib_method: hqq`), `gptq` / `gptq-act` (int4 symmetric,
GPTQ from the calibration sentences, act-order off / on), `awq` (int4 symmetric, AWQ
scales); onnxruntime `ort-rtn` (symmetric
default), `ort-rtn-asym`, `ort-hqq` (`HQQWeightOnlyQuantConfig`). Columns: metric,
change against float, quantize time and peak RSS of the quantizer's worker process, file
size; ratios of onnxq's rows against onnxruntime's row of the same method.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import deployed as D

ROWS = ("rtn-sym", "rtn-asym", "hqq", "gptq", "gptq-act", "awq", "ort-rtn", "ort-rtn-asym", "ort-hqq")
BASELINE = {"rtn-sym": "ort-rtn", "rtn-asym": "ort-rtn-asym", "hqq": "ort-hqq"}


def onnxq_config(row: str, block: int) -> dict[str, Any]:
    symmetric = row in ("rtn-sym", "gptq", "gptq-act", "awq")
    weight = {"dtype": "int4", "symmetric": True} if symmetric else \
        {"dtype": "uint4", "symmetric": False, "calib_method": "hqq" if row == "hqq" else "minmax"}
    algorithms = [{"name": "gptq", "desc_act": row == "gptq-act"}] if row.startswith("gptq") else \
        [{"name": "awq"}] if row == "awq" else []
    return {"preset": "W4_GROUP128", "algo_config": algorithms, "layer_type_quant_config": {
        "MatMul": {"weight": {**weight, "qscheme": "per_group", "group_size": block}},
        "Gemm": {"weight": {"dtype": "float32"}}, "Gather": {"weight": {"dtype": "float32"}}}}


def quantize(job: dict[str, Any], arrays: Any) -> dict[str, Any]:
    """Worker side: one row at one block size."""
    row, block = job["row"], job["block"]
    if not row.startswith("ort"):
        import onnxq

        result = onnxq.quantize(job["model"], job["output"], onnxq.as_config(onnxq_config(row, block)),
                                arrays if row.startswith(("gptq", "awq")) else None, progress=False)
        return {"summary": onnxq.format_summary(result.summary)}
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    algo = HQQWeightOnlyQuantConfig(block_size=block, bits=4) if row == "ort-hqq" else \
        DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=row == "ort-rtn")
    quantizer = MatMulNBitsQuantizer(job["model"], bits=4, block_size=block, is_symmetric=row == "ort-rtn",
                                     algo_config=algo)
    quantizer.process()
    quantizer.model.save_model_to_file(job["output"])
    return {}


def format_table(name: str, metric: str, rows: dict[str, dict[str, Any]]) -> str:
    head = (f"{name} ({metric}, default onnxruntime session; int4 MatMul weights only)\n"
            f"{'row':<18} {'metric':>8} {'vs float':>8} {'quant s':>8} {'RSS MB':>7} {'MB':>7}  "
            "ratios vs ort (time, RSS)")

    def line(row: str, r: dict[str, Any], fl: float) -> str:
        method = row.split(" ")[0]
        base = rows.get(row.replace(method, BASELINE[method]), {}) if method in BASELINE else {}
        ratios = ", ".join(D._ratio(r.get(k), base.get(k)) for k in ("quant_s", "peak_rss_mb"))
        return (f"{row:<18} {C.fmt(r['deployed'], '8.2f')} {C.fmt(r['deployed'] - fl, '+8.2f')} "
                f"{C.fmt(r.get('quant_s'), '8.1f')} {C.fmt(r.get('peak_rss_mb'), '7.0f')} "
                f"{C.fmt(r.get('size_mb'), '7.2f')}" + (f"  {ratios}" if base else ""))

    return D.table(head, rows, line)


def bench(task: CO.Task, args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, Any]]:
    task.eval_feeds, task.labels, task.extra = task.load_eval()
    fl, reference = CO.evaluate(task, task.model, None, args)
    rows: dict[str, dict[str, Any]] = {"float": {"deployed": fl["metric"], "size_mb": C.file_mb(task.model)}}
    for block in args.blocks:
        for row in ROWS:
            label = f"{row} b{block}"
            print(f"[{task.name}] {label}", file=sys.stderr, flush=True)
            job = {"row": row, "block": block, "model": str(task.model), "data": task.calib_spec}
            res = C.spawn_worker(__file__, "quantize", job, workdir, f"{row}.{block}", args.timeout)
            if "error" in res:
                rows[label] = {"error": res["error"]}
                continue
            score, _ = CO.evaluate(task, res["output"], reference, args)
            rows[label] = {"deployed": score["metric"], "quant_s": res["time_s"],
                           "peak_rss_mb": res["peak_rss_mb"], "size_mb": res["size_mb"]}
    return rows


def main(argv: list[str] | None = None) -> int:
    p = C.harness_parser(__doc__, ("minilm",), ())
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 128])
    D.add_task_options(p, 900.0)
    args = p.parse_args(argv)

    def each_task(task: CO.Task, workdir: Path) -> list[tuple[str, dict[str, Any], str]]:
        rows = bench(task, args, workdir)
        return [(task.name, rows, format_table(task.name, task.metric_name, rows))]

    return D.run_shared("weight_only", args, quantize, each_task)


if __name__ == "__main__":
    sys.exit(main())
