"""Mixed precision to an accuracy target, on the real models in ../shared.

For each model: the accuracy-size-latency curve from all-int8 to float along onnxq's
sensitivity order (the top k layers raised to float), the point the search picks for
targets of 0.5 and 1 point below float with the default ladder (algorithm rungs first,
then precision) and with precision alone (`int16 float`): the rungs it kept, the layers it
raised, the share of Conv/MatMul weights left int8, the models it scored and the time it
took; and onnxruntime's `quantize_static` of the same granularity beside it.

Data never overlaps: calibration (the first 200 images / 256 sentences), the search set
(what the target is checked on: every other remaining sample) and the held-out set (the
rest; the accuracy printed first, the search set's in brackets).
All accuracy in a default onnxruntime session on this CPU. Usage:

    python benchmarks/mixed_precision.py [--models mobilenet resnet20 minilm]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from onnxq.config.compose import compose_config  # noqa: E402
from onnxq.config.spec import DEFAULT_LADDER  # noqa: E402
from onnxq.evaluate import deployed_session  # noqa: E402
from onnxq.graph.save import save_model, weight_bytes  # noqa: E402
from onnxq.quantize import quantize, run_pipeline  # noqa: E402
from onnxq.search.driver import sensitivity_order  # noqa: E402
from onnxq.search.ladder import with_promotions  # noqa: E402
from onnxq.search.target import EvalSet  # noqa: E402

TARGETS = (0.5, 1.0)
# The default ladder (algorithm rungs, then precision) against precision alone.
LADDERS = {"precision only": ("int16", "float"), "default ladder": DEFAULT_LADDER}


@dataclass
class Task:
    model: str
    overrides: dict[str, Any]  # over the U8S8 preset
    calib: dict[str, np.ndarray]
    search: Any  # data for the search's evaluate
    held_out: Any
    score: Callable[[ort.InferenceSession, Any], float]  # (session, data) -> metric
    metric: str
    ort_per_channel: bool


def _top1(session: ort.InferenceSession, data: tuple[np.ndarray, np.ndarray]) -> float:
    x, y = data
    out = np.concatenate([session.run(None, {"input": x[i:i + 50]})[0] for i in range(0, len(x), 50)])
    return 100.0 * float(np.mean(out.argmax(1) == y))


def _spearman(session: ort.InferenceSession, data: tuple[dict[str, np.ndarray], np.ndarray]) -> float:
    feeds, scores = data
    n = len(next(iter(feeds.values())))
    emb = np.concatenate([session.run(["sentence_embedding"], {k: v[i:i + 64] for k, v in feeds.items()})[0]
                          for i in range(0, n, 64)])
    half = n // 2
    return 100.0 * C.spearman(C.row_cosine(emb[:half], emb[half:]), scores)


def _tasks(shared: Path, names: list[str]) -> dict[str, Task]:
    tasks = {}
    data = shared / "data"
    # After the calibration samples, even samples form the search set and odd ones the
    # held-out set (the image sets are ordered by class: halves would split the classes).
    per_tensor = {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}}
    if "mobilenet" in names:
        calib, _ = C.load_imagenet(data / "imagenet_sample1000", 0, 200)
        x, y = C.load_imagenet(data / "imagenet_sample1000", 200, None)
        tasks["mobilenet"] = Task("mobilenet_v1_075.onnx", per_tensor, {"input": calib}, (x[::2], y[::2]),
                                  (x[1::2], y[1::2]), _top1, "top-1 %", False)
    if "resnet20" in names:
        calib, _ = C.load_cifar(data / "cifar10_test2000", 0, 200)
        x, y = C.load_cifar(data / "cifar10_test2000", 200, None)
        tasks["resnet20"] = Task("resnet20_cifar10.onnx", per_tensor, {"input": calib}, (x[::2], y[::2]),
                                 (x[1::2], y[1::2]), _top1, "top-1 %", False)
    if "minilm" in names:
        stsb = data / "stsb_dev"
        calib_pairs, rest = C.stsb_split(256, None)
        search, held = rest[::2], rest[1::2]
        scores = C.load_stsb_scores(stsb)
        tasks["minilm"] = Task(
            "all_minilm_l6_v2.onnx", {}, C.load_stsb(stsb, C.stsb_rows(calib_pairs)),
            (C.load_stsb(stsb, C.stsb_rows(search)), scores[search]),
            (C.load_stsb(stsb, C.stsb_rows(held)), scores[held]), _spearman, "Spearman x100", True)
    return tasks


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _latency_ms(session: ort.InferenceSession, data: Any) -> float:
    feed = {"input": data[0][:1]} if isinstance(data[0], np.ndarray) else {k: v[:1] for k, v in data[0].items()}
    session.run(None, feed)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def _curve_points(n: int) -> list[int]:
    points, k = [0], 1
    while k < n:
        points.append(k)
        k *= 2
    return [*points, n]


def _search_data(task: Task) -> dict[str, np.ndarray]:
    data = task.search[0]
    return {"input": data[:64]} if isinstance(data, np.ndarray) else {k: v[:64] for k, v in data.items()}


def bench(name: str, task: Task, shared: Path, work: Path) -> dict[str, Any]:
    model = shared / "models" / task.model
    config = compose_config("U8S8", None, task.overrides)
    rows: dict[str, Any] = {"float": _score_row(_session(model), task, model.stat().st_size)}
    base = run_pipeline(model, None, config, task.calib, progress=False, keep_state=True)
    search = EvalSet(_search_data(task), None, None)
    float_session = deployed_session(base.state.float_model, config.calibration.providers)
    order = [n for n, _ in sensitivity_order(base, config, search, float_session, "float", progress=False)]
    curve = []
    for k in _curve_points(len(order)):
        path = work / f"{name}_top{k}.onnx"
        emitted = base.state.emit(with_promotions(config, {n: "float" for n in order[:k]}))
        save_model(emitted, path)
        curve.append({"float_layers": k, **_score_row(_session(path), task, weight_bytes(emitted))})
    rows["curve"] = curve
    targets = {}
    for drop in TARGETS:
        for ladder_name, ladder in LADDERS.items():
            path = work / f"{name}_target{drop}_{ladder_name.replace(' ', '_')}.onnx"
            cfg = dataclasses.replace(config, mixed_precision=dataclasses.replace(
                config.mixed_precision, target=f"custom>=float-{drop}", ladder=list(ladder)))
            start = time.perf_counter()
            result = quantize(model, path, cfg, task.calib, progress=False,
                              evaluate=lambda s: task.score(s, task.search))
            seconds = time.perf_counter() - start
            mp = result.summary.mixed_precision
            targets[f"{drop} {ladder_name}"] = {
                "drop": drop, "ladder": ladder_name, "seconds": seconds, "evaluations": mp.evaluations,
                "ranked_layers": mp.ranked_layers, "promotions": len(mp.promotions), "search_met": mp.met,
                "rungs_kept": [t["rung"] for t in mp.rungs if t["kept"]],
                "matmul_int8_share": _int8_share(result, "MatMul"), "conv_int8_share": _int8_share(result, "Conv"),
                **_score_row(_session(path), task, path.stat().st_size)}
    rows["targets"] = targets
    rows["ort"] = _ort_row(model, task, work / f"{name}_ort.onnx")
    return rows


def _int8_share(result: Any, op: str) -> float | None:
    """The share of `op` nodes with a constant weight whose weight is stored quantized."""
    graph = result.ir_model.graph
    quantized = total = 0
    for node in graph:
        if node.op_type != op or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        w = node.inputs[1]
        producer = w.producer()
        if producer is not None and producer.op_type == "DequantizeLinear" and producer.inputs[0].is_initializer():
            quantized += 1
            total += 1
        elif w.is_initializer():
            total += 1
    return quantized / total if total else None


def _score_row(session: ort.InferenceSession, task: Task, size: int) -> dict[str, float]:
    return {"metric": task.score(session, task.held_out), "search_metric": task.score(session, task.search),
            "size_mb": size / 1e6, "latency_ms": _latency_ms(session, task.held_out)}


def _ort_row(model: Path, task: Task, out: Path) -> dict[str, Any]:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            n = len(next(iter(task.calib.values())))
            self.rows = iter([{k: v[i:i + 1] for k, v in task.calib.items()} for i in range(n)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.rows, None)

    start = time.perf_counter()
    quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    per_channel=task.ort_per_channel)
    return {"seconds": time.perf_counter() - start, **_score_row(_session(out), task, out.stat().st_size)}


def report(name: str, task: Task, rows: dict[str, Any]) -> str:
    f = rows["float"]
    lines = [f"== {name} ({task.metric}, held-out; search set in brackets) ==",
             f"  float                    {f['metric']:7.2f} [{f['search_metric']:6.2f}]  "
             f"{f['size_mb']:6.2f} MB  {f['latency_ms']:6.2f} ms"]
    for p in rows["curve"]:
        lines.append(f"  top {p['float_layers']:3d} layers float     {p['metric']:7.2f} [{p['search_metric']:6.2f}]  "
                     f"{p['size_mb']:6.2f} MB  {p['latency_ms']:6.2f} ms")
    o = rows["ort"]
    lines.append(f"  onnxruntime quantize_static {o['metric']:6.2f} [{o['search_metric']:6.2f}]  "
                 f"{o['size_mb']:6.2f} MB  {o['latency_ms']:6.2f} ms  ({o['seconds']:.1f} s)")
    for t in rows["targets"].values():
        drop = t["drop"]
        delta = t["metric"] - f["metric"]
        share = "".join(f", {op} int8 {t[key]:.0%}" for op, key in (("MatMul", "matmul_int8_share"),
                                                                    ("Conv", "conv_int8_share"))
                        if t[key] is not None)
        kept = ", ".join(t["rungs_kept"]) or "none"
        lines.append(
            f"  target float-{drop}, {t['ladder']} (algorithm rungs kept: {kept}): "
            f"{t['promotions']} of {t['ranked_layers']} layers raised, "
            f"{t['evaluations']} models scored, {t['seconds']:.1f} s ({t['seconds'] / o['seconds']:.1f}x "
            f"onnxruntime's quantize time): held-out {t['metric']:.2f} ({delta:+.2f} vs float: "
            f"{'met' if delta >= -drop else 'MISSED'}){share}, {t['size_mb']:.2f} MB, {t['latency_ms']:.2f} ms "
            f"({t['latency_ms'] / o['latency_ms']:.2f}x onnxruntime's int8)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = C.harness_parser(__doc__, models=("mobilenet", "resnet20", "minilm"))
    args = parser.parse_args(argv)
    if not (args.shared_dir / "models").is_dir():
        print(f"no shared models under {args.shared_dir}; nothing to measure")
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, task in _tasks(args.shared_dir, args.models).items():
            results[name] = bench(name, task, args.shared_dir, work)
            print(report(name, task, results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(C.jsonable(results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
