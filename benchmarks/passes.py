"""Accuracy of the pre-quantization passes on the real models in ../shared.

MobileNet v1 0.75 (ImageNet sample): top-1 of int8 per-tensor and per-channel weights,
plain, with CLE, with bias correction, with both. MiniLM (STS-B dev): Spearman x100 and
embedding cosine to float, with and without SmoothQuant. Calibration and evaluation
samples never overlap. Usage:

    python benchmarks/passes.py [--models mobilenet minilm cost] [--calib 200] [--eval 800]

`cost` times MiniLM quantization plain and with CLE + SmoothQuant + bias correction and
counts the data passes each needs (issue target: at most 1.3x).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import (  # noqa: E402
    load_imagenet,
    load_stsb,
    load_stsb_scores,
    row_cosine,
    spearman,
    stsb_rows,
    stsb_split,
)

import onnxq  # noqa: E402
from onnxq.config import QScheme  # noqa: E402
from onnxq.optimize import bias_correction, cle, smoothquant  # noqa: E402, F401

CLE = {"name": "cle"}
BC = {"name": "bias_correction"}
SQ = {"name": "smoothquant", "alpha": 0.5}

# name -> (weight scheme, pre_quant_opt_config, algo_config)
MOBILENET_RUNS: dict[str, tuple[QScheme, list, list]] = {
    "per-tensor": (QScheme.PER_TENSOR, [], []),
    "per-tensor +BC": (QScheme.PER_TENSOR, [], [BC]),
    "per-tensor +CLE": (QScheme.PER_TENSOR, [CLE], []),
    "per-tensor +CLE+BC": (QScheme.PER_TENSOR, [CLE], [BC]),
    "per-tensor +CLE(relu6_to_relu)+BC": (QScheme.PER_TENSOR, [{**CLE, "relu6_to_relu": True}], [BC]),
    "per-channel": (QScheme.PER_CHANNEL, [], []),
    "per-channel +BC": (QScheme.PER_CHANNEL, [], [BC]),
    "per-channel +CLE": (QScheme.PER_CHANNEL, [CLE], []),
    "per-channel +CLE+BC": (QScheme.PER_CHANNEL, [CLE], [BC]),
}
# name -> (op types kept float besides the preset's, pre_quant_opt_config, exclude)
MINILM_RUNS: dict[str, tuple[list[str], list, list[str]]] = {
    "static int8, all ops": ([], [], []),
    "static int8, all ops +SQ": ([], [SQ], []),
    "static int8, all ops +SQ (inserted Muls float)": ([], [SQ], [".*_smoothquant_Mul"]),
    "static int8, Add float": (["Add"], [], []),
    "static int8, Add float +SQ": (["Add"], [SQ], []),
    "static int8, Add float +SQ (inserted Muls float)": (["Add"], [SQ], [".*_smoothquant_Mul"]),
    "static int8, Add float +SQ alpha 0.7 (Muls float)": (
        ["Add"], [{**SQ, "alpha": 0.7}], [".*_smoothquant_Mul"]),
}


def session(model: str | onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def timed(label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    row = fn()
    row["seconds"] = round(time.perf_counter() - start, 1)
    print(f"  {label:<50} " + "  ".join(f"{k} {v}" for k, v in row.items() if k != "notes"), flush=True)
    for note in row.get("notes", []):
        print(f"      {note}", flush=True)
    return row


def _pass_notes(result: onnxq.QuantizationResult) -> list[str]:
    names = ("cle", "smoothquant", "bias_correction")
    return [n for n in result.summary.note_texts if n.split(":")[0] in names]


def mobilenet(shared: Path, n_calib: int, n_eval: int) -> dict[str, Any]:
    model = str(shared / "models" / "mobilenet_v1_075.onnx")
    x, labels = load_imagenet(shared / "data" / "imagenet_sample1000", 0, n_calib + n_eval)
    calib, evaluation, truth = {"input": x[:n_calib]}, x[n_calib:], labels[n_calib:]

    def top1(quantized: str | onnx.ModelProto) -> float:
        sess = session(quantized)
        preds = np.concatenate([sess.run(None, {"input": evaluation[i : i + 100]})[0].argmax(1)
                                for i in range(0, len(evaluation), 100)])
        return round(float((preds == truth).mean() * 100), 2)

    def run(scheme: QScheme, passes: list, algos: list) -> dict[str, Any]:
        config = onnxq.get_preset("U8S8")
        config.global_quant_config.weight.qscheme = scheme
        config.pre_quant_opt_config, config.algo_config = passes, algos
        result = onnxq.quantize(model, None, config, calib)
        return {"top1": top1(result.model), "notes": _pass_notes(result)}

    print(f"MobileNet v1 0.75: calibrate on {n_calib} images, evaluate on {len(truth)}")
    rows = {"float": timed("float", lambda: {"top1": top1(model)})}
    for name, (scheme, passes, algos) in MOBILENET_RUNS.items():
        rows[name] = timed(name, lambda s=scheme, p=passes, a=algos: run(s, p, a))
    return rows


def minilm(shared: Path, n_calib: int, n_pairs: int) -> dict[str, Any]:
    model = str(shared / "models" / "all_minilm_l6_v2.onnx")
    data = shared / "data" / "stsb_dev"
    calib_pairs, eval_pairs = stsb_split(n_calib, n_pairs)
    calib, evaluation = load_stsb(data, stsb_rows(calib_pairs)), load_stsb(data, stsb_rows(eval_pairs))
    gold = load_stsb_scores(data)[eval_pairs]

    def embed(quantized: str | onnx.ModelProto) -> np.ndarray:
        sess, n = session(quantized), len(evaluation["input_ids"])
        return np.concatenate([sess.run(["sentence_embedding"], {k: v[i : i + 64] for k, v in evaluation.items()})[0]
                               for i in range(0, n, 64)])

    reference = embed(model)

    def scores(emb: np.ndarray) -> dict[str, Any]:
        half = len(emb) // 2
        return {"spearman": round(spearman(row_cosine(emb[:half], emb[half:]), gold) * 100, 2),
                "cosine_to_float": round(float(row_cosine(emb, reference).mean()), 4)}

    def run(float_ops: list[str], passes: list, exclude: list[str]) -> dict[str, Any]:
        config = onnxq.get_preset("U8S8")
        config.float_op_types = config.float_op_types + float_ops
        config.pre_quant_opt_config, config.exclude = passes, exclude
        result = onnxq.quantize(model, None, config, calib)
        return {**scores(embed(result.model)), "notes": _pass_notes(result)}

    print(f"all-MiniLM-L6-v2: calibrate on {2 * len(calib_pairs)} sentences, evaluate on {len(eval_pairs)} pairs")
    rows = {"float": timed("float", lambda: scores(reference))}
    for name, (float_ops, passes, exclude) in MINILM_RUNS.items():
        rows[name] = timed(name, lambda f=float_ops, p=passes, e=exclude: run(f, p, e))
    return rows


def pass_cost(shared: Path, n_calib: int, repeats: int = 3) -> dict[str, Any]:
    """Quantization time of MiniLM plain and with CLE + SmoothQuant + bias correction
    (interleaved runs, the best of `repeats` each), and the data passes each needed."""
    model = str(shared / "models" / "all_minilm_l6_v2.onnx")
    calib = load_stsb(shared / "data" / "stsb_dev", stsb_rows(stsb_split(n_calib, None)[0]))
    recipes = {"plain": ([], []), "cle+smoothquant+bias_correction": ([CLE, SQ], [BC])}
    best: dict[str, float] = {}
    streams: dict[str, int] = {}
    for _ in range(repeats):
        for name, (passes, algos) in recipes.items():
            config = onnxq.get_preset("U8S8")
            config.pre_quant_opt_config, config.algo_config = passes, algos
            counted = _count_streams()
            start = time.perf_counter()
            onnxq.quantize(model, None, config, calib)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
            streams[name] = counted()
    ratio = best["cle+smoothquant+bias_correction"] / best["plain"]
    for name in recipes:
        print(f"  {name:<40} {best[name]:.2f} s  data passes {streams[name]}")
    print(f"  ratio (target <= 1.3): {ratio:.2f}x")
    return {"seconds": {k: round(v, 2) for k, v in best.items()}, "data_passes": streams, "ratio": round(ratio, 2)}


def _count_streams() -> Callable[[], int]:
    """Count the streaming passes over the calibration data from now on."""
    from onnxq.calibrate import runner

    real, calls = runner.stream_tensors, []

    def counting(model: Any, names: Any, data: Any, options: Any, progress: Any = None,
                 purpose: str = "calibrating", *args: Any, **kwargs: Any) -> Any:
        if purpose != "sizing calibration":
            calls.append(purpose)
        return real(model, names, data, options, progress, purpose, *args, **kwargs)

    runner.stream_tensors = counting

    def stop() -> int:
        runner.stream_tensors = real
        return len(calls)

    return stop


def main(argv: list[str] | None = None) -> int:
    parser = C.harness_parser(__doc__, ("mobilenet", "minilm", "cost"))
    parser.add_argument("--calib", type=int, default=200, help="MobileNet calibration images")
    parser.add_argument("--eval", type=int, default=800, help="MobileNet evaluation images")
    parser.add_argument("--calib-sentences", type=int, default=256)
    parser.add_argument("--eval-pairs", type=int, default=600)
    args = parser.parse_args(argv)
    if not (args.shared_dir / "models").is_dir():
        print(f"no models under {args.shared_dir}; pass --shared-dir", file=sys.stderr)
        return 2
    results = {}
    if "mobilenet" in args.models:
        results["mobilenet_v1_075"] = mobilenet(args.shared_dir, args.calib, args.eval)
    if "minilm" in args.models:
        results["all_minilm_l6_v2"] = minilm(args.shared_dir, args.calib_sentences, args.eval_pairs)
    if "cost" in args.models:
        print(f"pass cost, all-MiniLM-L6-v2, {args.calib_sentences} calibration sentences")
        results["pass_cost"] = pass_cost(args.shared_dir, args.calib_sentences)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
