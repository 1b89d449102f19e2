#!/usr/bin/env python
"""A synthetic model past 2 GB (a stack of 4096x4096 MatMuls with external data),
quantized to int4 MatMulNBits from another working directory: onnxq's RTN and HQQ against
onnxruntime's `MatMulNBitsQuantizer` RTN, in one run.

    python benchmarks/big_model.py [--layers 36] [--dim 4096] [--keep DIR] [--json OUT]

The model is written tensor by tensor (never whole in memory) into a temporary folder;
each quantizer runs in its own subprocess whose working directory is another folder and
which names the model by a relative path. Reported: quantize time, peak RSS (and its ratio
to the float model's size), output size, and the output's SQNR against the float model on
random inputs in a default onnxruntime session. Needs about 3x the model size of disk.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common as C
import numpy as np


def build(folder: Path, layers: int, dim: int) -> Path:
    """model.onnx + weights.bin in `folder`; weights streamed to disk one at a time."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    offset = 0
    with open(folder / "weights.bin", "wb") as f:
        for i in range(layers):
            w = (rng.standard_normal((dim, dim), dtype=np.float32) / np.sqrt(dim)).astype(np.float32)
            f.write(w.tobytes())
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[dim, dim],
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "weights.bin"), ("offset", offset), ("length", w.nbytes)):
                t.external_data.add(key=key, value=str(value))
            inits.append(t)
            offset += w.nbytes
            x = "x" if i == 0 else f"h{i - 1}"
            nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
            nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i}"], name=f"act{i}"))
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, dim])],
                              [helper.make_tensor_value_info(f"h{layers - 1}", TensorProto.FLOAT, [1, 8, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def quantize(job: dict[str, Any]) -> dict[str, Any]:
    """Worker: quantize the model named relative to this process's working directory."""
    os.chdir(job["cwd"])
    model, output = job["relative_model"], job["relative_output"]
    if job["row"] == "ort-rtn":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        def run() -> None:
            quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=128, is_symmetric=True)
            quantizer.process()
            quantizer.model.save_model_to_file(output, use_external_data_format=True)
    else:
        import onnxq

        algorithm = [] if job["row"] == "onnxq-rtn" else [{"name": "hqq"}]
        config = onnxq.as_config({"preset": "W4_GROUP128", "algo_config": algorithm})

        def run() -> None:
            onnxq.quantize(model, output, config, None, progress=False)

    _, stats = C.measure_call(run)
    return stats


def sqnr(float_model: Path, quant: Path, dim: int) -> float:
    x = np.random.default_rng(1).standard_normal((1, 8, dim)).astype(np.float32)
    ref = C.make_session(float_model).run(None, {"x": x})[0]
    out = C.make_session(quant).run(None, {"x": x})[0]
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((ref - out) ** 2), 1e-30)))


def main(argv: list[str] | None = None) -> int:
    p = C.harness_parser(__doc__, (), ["quantize"])
    p.add_argument("--layers", type=int, default=36, help="MatMuls (default 36: 2.25 GiB at --dim 4096)")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--rows", nargs="+", default=["onnxq-rtn", "onnxq-hqq", "ort-rtn"])
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    if args.worker:
        return C.answer_job(args.job, quantize)
    t0 = time.perf_counter()
    import compare_ort as CO

    report = C.start_report(args, {**CO.machine_info(), "git_revision": C.git_revision()})
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="big_model_"))
    (root / "model").mkdir(parents=True, exist_ok=True)
    (root / "elsewhere").mkdir(exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    try:
        model = build(root / "model", args.layers, args.dim)
        size_mb = C.file_mb(model) + C.file_mb(root / "model" / "weights.bin")
        print(f"model: {args.layers} MatMuls of {args.dim}x{args.dim}, {size_mb:.0f} MB (external data)")
        for row in args.rows:
            job = {"row": row, "cwd": str(root / "elsewhere"), "relative_model": "../model/model.onnx",
                   "relative_output": f"../{row}.onnx"}
            res = C.spawn_worker(__file__, "quantize", job, root, row, args.timeout)
            if "error" in res:
                rows[row] = res
                print(f"  {row}: FAILED {res['error']}")
                continue
            out = root / f"{row}.onnx"
            data = [q for q in root.glob(f"{row}.onnx*")]
            rows[row] = {**res, "size_mb": sum(C.file_mb(q) for q in data), "sqnr_db": sqnr(model, out, args.dim)}
            print(f"  {row}: {res['time_s']:.1f} s, peak {res['peak_rss_mb']:.0f} MB "
                  f"({res['peak_rss_mb'] / size_mb:.2f}x the model), {rows[row]['size_mb']:.0f} MB, "
                  f"SQNR {rows[row]['sqnr_db']:.1f} dB", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    ort = rows.get("ort-rtn", {})
    for row, r in rows.items():
        if "time_s" in r and "time_s" in ort and row != "ort-rtn":
            print(f"{row}/ort-rtn: time {r['time_s'] / ort['time_s']:.2f}x, peak RSS "
                  f"{r['peak_rss_mb'] / ort['peak_rss_mb']:.2f}x")
    report["rows"] = rows
    return C.finish_report(report, t0, args.json)


if __name__ == "__main__":
    sys.exit(main())
