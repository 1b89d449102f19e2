"""Layer-wise reconstruction (AdaRound, AdaQuant) on the shared models, in one run, against
nearest rounding, CLE + bias correction and onnxruntime's `quantize_static`.

    python benchmarks/adaround.py                        # all settings, ~25 min on 2 cores
    python benchmarks/adaround.py --settings mobilenet_pt8 --rows nearest adaround ort

Settings (calibration: the first 200 images / 256 sentences; evaluation: the rest):
`mobilenet_pt8` (per-tensor int8 weights, uint8 activations), `mobilenet_w4` (int4
per-channel symmetric weights, uint8 activations), `resnet20_w4` (int4 per-channel
symmetric weights, uint8 activations), `mobilenet_w4a` / `resnet20_w4a` (the same with
asymmetric int4 weights; onnxruntime: QUInt4), `mobilenet_w4a8` / `resnet20_w4a8` (the W4A8
preset's protocol: those, with the first and last weighted layer int8; onnxruntime's row
stays all-int4, quantize_static has no such option), `minilm_int8` (the U8S8 default, static int8). Rows: `nearest` (onnxq,
round to nearest), `cle_bc` (CLE + bias correction), `adaround`, `adaquant` (default
options: with per-tensor weights they bring CLE first, see `equalize`), `adaround_bc` /
`adaquant_bc` (bias correction after them), `adaround_raw` /
`adaquant_raw` (equalize: never), `cle_adaround`, `cle_adaquant`, `adaround_block` (AdaRound with `reconstruct: block`), and `ort`
(`quantize_static`, QDQ, MinMax, the setting's weight type and granularity where
onnxruntime has it). Every model is scored in a default onnxruntime session (the fused
int8 kernels users get); quantize time and peak RSS come from each quantizer's own worker
process; ratios compare each row with `ort`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import common as C
import compare_ort as CO
import deployed as D
import numpy as np

INT4_PC = {"dtype": "int4", "qscheme": "per_channel", "symmetric": True}
INT4_PC_ASYM = {**INT4_PC, "symmetric": False}  # the W4A8 preset's weights
INT8_PC = {"dtype": "int8", "qscheme": "per_channel", "symmetric": True}
SETTINGS: dict[str, dict[str, Any]] = {
    "mobilenet_pt8": {"model": "mobilenet", "weight": {"qscheme": "per_tensor"}, "ort": {"per_channel": False}},
    "mobilenet_w4": {"model": "mobilenet", "weight": INT4_PC, "ort": {"per_channel": True, "weight": "QInt4"}},
    "resnet20_w4": {"model": "resnet20", "weight": INT4_PC, "ort": {"per_channel": True, "weight": "QInt4"}},
    "mobilenet_w4a": {"model": "mobilenet", "weight": INT4_PC_ASYM, "ort": {"per_channel": True, "weight": "QUInt4"}},
    "resnet20_w4a": {"model": "resnet20", "weight": INT4_PC_ASYM, "ort": {"per_channel": True, "weight": "QUInt4"}},
    # The W4A8 preset's protocol: first and last weighted layer int8 (edge_weight), and the
    # depthwise convolutions (depthwise_weight); the ort row stays all-int4 (quantize_static
    # has no such option).
    "mobilenet_w4a8": {"model": "mobilenet", "weight": INT4_PC_ASYM,
                       "config": {"edge_weight": INT8_PC, "depthwise_weight": INT8_PC},
                       "ort": {"per_channel": True, "weight": "QUInt4"}},
    "resnet20_w4a8": {"model": "resnet20", "weight": INT4_PC_ASYM,
                      "config": {"edge_weight": INT8_PC, "depthwise_weight": INT8_PC},
                      "ort": {"per_channel": True, "weight": "QUInt4"}},
    "minilm_int8": {"model": "minilm", "weight": {}, "ort": {"per_channel": True}},
}
ROWS: dict[str, dict[str, Any]] = {
    "nearest": {"target_algorithms": False},  # no default bias correction: plain rounding
    "cle_bc": {"pre_quant_opt_config": [{"name": "cle"}], "algo_config": [{"name": "bias_correction"}]},
    "adaround": {"algo_config": [{"name": "adaround"}]},
    "adaround_raw": {"algo_config": [{"name": "adaround", "equalize": "never"}]},
    "adaround_block": {"algo_config": [{"name": "adaround", "reconstruct": "block"}]},
    "cle_adaround": {"pre_quant_opt_config": [{"name": "cle"}], "algo_config": [{"name": "adaround"}]},
    "adaquant": {"algo_config": [{"name": "adaquant"}]},
    "adaquant_raw": {"algo_config": [{"name": "adaquant", "equalize": "never"}]},
    "cle_adaquant": {"pre_quant_opt_config": [{"name": "cle"}], "algo_config": [{"name": "adaquant"}]},
    "adaround_bc": {"algo_config": [{"name": "adaround"}, {"name": "bias_correction"}]},
    "adaquant_bc": {"algo_config": [{"name": "adaquant"}, {"name": "bias_correction"}]},
    "ort": {},
}
CONV_ONLY = ("cle_bc", "adaround_bc", "adaquant_bc", "adaround_raw", "cle_adaround", "adaquant_raw",
             "cle_adaquant")  # no-ops without convs


def quantize_job(job: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Worker side: one row of one setting."""
    setting = SETTINGS[job["setting"]]
    if job["row"] == "ort":
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        ort = setting["ort"]
        quantize_static(job["model"], job["output"], C.FeedReader(arrays), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=getattr(QuantType, ort.get("weight", "QInt8")),
                        per_channel=ort["per_channel"], calibrate_method=CalibrationMethod.MinMax)
        return {}
    import onnxq
    from onnxq.config.compose import compose_config

    overrides = {"global_quant_config": {"weight": setting["weight"]}, **setting.get("config", {}),
                 **ROWS[job["row"]]}
    result = onnxq.quantize(job["model"], job["output"], compose_config("U8S8", None, overrides), arrays,
                            progress=False)
    return {"summary": onnxq.format_summary(result.summary)}


def bench_setting(name: str, task: CO.Task, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    log = lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    rows: dict[str, dict[str, Any]] = {}
    fl, reference = CO.evaluate(task, task.model, None, args)
    rows["float"] = {"metric": fl["metric"]}
    for row in args.rows:
        if row in CONV_ONLY and SETTINGS[name]["model"] == "minilm":
            continue
        log(f"quantize {row}")
        job = {"setting": name, "row": row, "model": str(task.model), "data": task.calib_spec}
        res = C.spawn_worker(__file__, "quantize", job, workdir, f"{name}.{row}", args.timeout)
        if "error" in res:
            rows[row] = {"error": res["error"]}
            log(res["error"])
            continue
        scored, _ = CO.evaluate(task, res["output"], reference, args)
        rows[row] = {"metric": scored["metric"], "agree": scored.get("agree"), "quant_s": res["time_s"],
                     "peak_rss_mb": res["peak_rss_mb"], "summary": res.get("summary")}
        log(f"{row}: {scored['metric']:.2f} in {res['time_s']:.1f} s, peak {res['peak_rss_mb']:.0f} MB")
    return rows


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b else "-"


def format_table(name: str, metric: str, rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"{name} ({metric}, default onnxruntime session)",
             f"{'row':<14} {'metric':>8} {'vs float':>8} {'vs near':>8} {'quant s':>8} {'RSS MB':>7}"
             "  vs ort: time, RSS"]
    fl, near, ort = rows["float"]["metric"], rows.get("nearest", {}).get("metric"), rows.get("ort", {})
    fmt = lambda v, spec: format(v, spec) if isinstance(v, float) else "-"  # noqa: E731
    for row, r in rows.items():
        if "error" in r:
            lines.append(f"{row:<14} error: {r['error']}")
            continue
        m = r["metric"]
        vs_near = m - near if isinstance(near, float) and row != "float" else None
        ratios = f"  {_ratio(r.get('quant_s'), ort.get('quant_s'))}, {_ratio(r.get('peak_rss_mb'), ort.get('peak_rss_mb'))}"
        lines.append(f"{row:<14} {fmt(m, '8.2f')} {fmt(m - fl, '+8.2f')} {fmt(vs_near, '+8.2f')} "
                     f"{fmt(r.get('quant_s'), '8.1f')} {fmt(r.get('peak_rss_mb'), '7.0f')}"
                     + (ratios if row not in ("float", "ort") else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = C.harness_parser(__doc__, (), ())
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    D.add_task_options(p, 1800.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.models = sorted({SETTINGS[s]["model"] for s in args.settings})

    def each_task(task: CO.Task, workdir: Path) -> list[tuple[str, dict[str, Any], str]]:
        task.eval_feeds, task.labels, task.extra = task.load_eval()
        key = next(k for k in ("mobilenet", "resnet20", "minilm") if k in task.name)
        results = []
        for name in [s for s in args.settings if SETTINGS[s]["model"] == key]:
            rows = bench_setting(name, task, args, workdir)
            results.append((name, rows, format_table(name, task.metric_name, rows)))
        return results

    return D.run_shared("adaround", args, quantize_job, each_task)


if __name__ == "__main__":
    sys.exit(main())
