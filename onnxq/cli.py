"""Command line: `onnxq quantize`, `analyze`, `compare`, `presets`, `inspect`.

Flags override the config file, which overrides the preset. A user mistake prints one
line on stderr and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections import Counter
from typing import Any, NoReturn

from onnxq.config import PRESETS, config_to_yaml, get_preset
from onnxq.config.compose import compose_config
from onnxq.config.spec import EDGE_FIELDS
from onnxq.errors import OnnxqError
from onnxq.graph.save import check_output_paths
from onnxq.plugins import load_plugins

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped


def _version() -> str:
    from onnxq import __version__

    return __version__


def _key_values(items: list[str], flag: str = "--calib-option") -> dict[str, Any]:
    """Parse KEY=VALUE flags; values are YAML scalars (numbers, true/false, strings)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise OnnxqError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


# Flag -> where its value goes in the config-file shape. "act" stands for both
# input_tensors and output_tensors; a flag set to None (not given) is skipped.
FLAG_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("calib_method", ("act", "calib_method")),
    ("percentile", ("act", "percentile")),
    ("num_bins", ("act", "num_bins")),
    ("activation_type", ("act", "dtype")),
    ("scale_type", ("act", "scale_type")),
    ("weight_type", ("weight", "dtype")),
    ("weight_bits", ("weight", "bits")),
    ("scale_type", ("weight", "scale_type")),
    ("exclude", ("exclude",)),
    ("qdq_domain", ("qdq_domain",)),
    ("format", ("quant_format",)),
    ("target", ("target",)),
    ("reduce_range", ("reduce_range",)),
    ("target_algorithms", ("target_algorithms",)),
    ("accuracy_level", ("accuracy_level",)),
    ("max_samples", ("calibration", "max_samples")),
    ("batch_size", ("calibration", "batch_size")),
    ("providers", ("calibration", "providers")),
    ("max_calib_memory", ("calibration", "max_memory_mb")),
    ("check_samples", ("calibration", "check_samples")),
    ("save_ranges", ("calibration", "save_ranges")),
    ("load_ranges", ("calibration", "load_ranges")),
    ("stats", ("calibration", "stats")),
    ("eval_data", ("mixed_precision", "eval_data")),
    ("labels", ("mixed_precision", "labels")),
    ("ladder", ("mixed_precision", "ladder")),
)


def _flag_values(args: argparse.Namespace) -> list[tuple[tuple[str, ...], Any]]:
    """(config path, value) of every flag given, including the derived ones."""
    values = [(path, getattr(args, flag)) for flag, path in FLAG_PATHS if getattr(args, flag) is not None]
    if args.calib_option:
        values.append((("act", "calib_options"), _key_values(args.calib_option)))
    if args.dynamic:
        values.append((("act", "is_dynamic"), True))
    for flag, scheme in (("per_tensor", "per_tensor"), ("per_channel", "per_channel")):
        if getattr(args, flag):
            values.append((("weight", "qscheme"), scheme))
    if args.per_group is not None:
        values += [(("weight", "qscheme"), "per_group"), (("weight", "group_size"), args.per_group)]
    if args.matmul_nbits:
        values.append((("matmul_nbits",), True))
    for key in EDGE_FIELDS:  # a bare dtype or none, as in a config file (`config.io.bare_edge_dtypes`)
        if getattr(args, f"{key}_type") is not None:
            values.append(((key,), getattr(args, f"{key}_type")))
    passes = [{"name": "cle"}] if args.cle else []
    if args.smoothquant is not None:
        passes.append({"name": "smoothquant", "alpha": args.smoothquant})
    if passes:
        values.append((("pre_quant_opt_config",), passes))
    algorithms = [name for name in ALGORITHM_FLAGS if getattr(args, name)]
    if args.algorithm is not None:
        others = [name for name in algorithms if name in WEIGHT_ONLY_ALGORITHMS]
        if others:
            raise OnnxqError(f"--algorithm {args.algorithm} and --{others[0]} both pick the weight-only algorithm; "
                             "give one")
        if args.algorithm != "rtn":  # before bias correction, which runs last
            at = algorithms.index("bias_correction") if "bias_correction" in algorithms else len(algorithms)
            algorithms.insert(at, args.algorithm)
    entries = _algorithm_options(algorithms, args.algo_option or [])
    if entries:
        values.append((("algo_config",), entries))
    if args.accuracy_target is not None or args.metric is not None:
        values.append((("mixed_precision", "target"), _target_text(args.accuracy_target, args.metric)))
    return values


# Flags that switch an algorithm on (`algo_config` entries, in this order: bias correction
# last, where it runs anyway, `quantize._correction_last`).
ALGORITHM_FLAGS = ("adaround", "adaquant", "gptq", "awq", "bias_correction")
# `--algorithm`: how MatMulNBits weights are rounded (rtn: round to nearest with the clipping search).
WEIGHT_ONLY_ALGORITHMS = ("rtn", "gptq", "awq", "hqq")


def _algorithm_options(flagged: list[str], options: list[str]) -> list[dict[str, Any]]:
    """`algo_config` entries for the algorithm flags, with `--algo-option [ALGO.]KEY=VALUE`
    merged in (a bare KEY goes to the one algorithm a flag switched on)."""
    entries = {name: {"name": name} for name in flagged}
    for key, value in _key_values(options, "--algo-option").items():
        name, dot, option = key.rpartition(".")
        if not dot:
            if len(flagged) != 1:
                owner = _algorithm_with_option(key)
                raise OnnxqError(f"--algo-option {key}: name its algorithm, e.g. {owner}.{key}=..., "
                                 f"since {'no' if not flagged else 'more than one'} algorithm flag is given")
            name = flagged[0]
        entries.setdefault(name, {"name": name})[option] = value
    return list(entries.values())


def _algorithm_with_option(key: str) -> str:
    """The first registered algorithm with an option `key` (for an example), else adaround."""
    import dataclasses

    from onnxq.optimize import CONTRACTS

    for name, contract in sorted(CONTRACTS.items()):
        if dataclasses.is_dataclass(contract.options) and key in {f.name for f in dataclasses.fields(contract.options)}:
            return name
    return "adaround"


def _target_text(expression: str | None, metric: str | None) -> str:
    """`--accuracy-target` with `--metric` folded in (`float-0.5` + top1 -> `top1>=float-0.5`)."""
    from onnxq.search.target import parse_target

    if expression is None:
        raise OnnxqError("--metric names what --accuracy-target measures; add e.g. --accuracy-target float-0.5")
    target = parse_target(expression, metric)
    if metric is not None and target.metric != metric:
        raise OnnxqError(f"--metric {metric} conflicts with the metric in --accuracy-target {expression!r}; "
                         "give the metric once")
    return target.describe()


def _spec_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Translate quantize flags into a dict of the config-file shape (`FLAG_PATHS`)."""
    out: dict[str, Any] = {}
    for path, value in _flag_values(args):
        if path[0] in ("act", "weight"):
            targets = ("input_tensors", "output_tensors") if path[0] == "act" else ("weight",)
            for tensor_class in targets:
                spec = out.setdefault("global_quant_config", {}).setdefault(tensor_class, {})
                spec[path[1]] = value
        elif len(path) == 2:
            out.setdefault(path[0], {})[path[1]] = value
        else:
            out[path[0]] = list(value) if isinstance(value, tuple) else value
    return out


def _cmd_quantize(args: argparse.Namespace) -> int:
    from onnxq.quantize import quantize
    from onnxq.report import format_summary

    config = compose_config(args.preset, args.config, _spec_overrides(args))
    progress = False if args.quiet else None
    check_output_paths(args.input, args.save_config)
    result = quantize(args.input, args.output, config, args.calib_data, progress=progress, report=args.report)
    if args.save_config:
        from onnxq.config import save_config

        mp = result.summary.mixed_precision
        save_config(mp.config if mp is not None else config, args.save_config)
    if not args.quiet:
        print(format_summary(result.summary))
        if args.save_config:
            print(f"  config written to {args.save_config}")
        if args.report:
            print(f"  report written to {args.report}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from onnxq.quantize import calibrate_shard, calibrate_sharded

    output = args.stats
    args.stats = None  # the file written, not statistics to read (FLAG_PATHS)
    check_output_paths(args.input, output)
    ignored = [flag for flag, value in (("--save-ranges", args.save_ranges), ("--format", args.format),
                                        ("--ladder", args.ladder)) if value is not None]
    if ignored:
        raise OnnxqError(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect on calibrate, "
                         "which writes statistics only: give it to onnxq quantize --stats FILE")
    _check_counts(args, "--shards")
    config = compose_config(args.preset, args.config, _spec_overrides(args))
    progress = False if args.quiet else None
    if args.shard is not None and args.shards is not None:
        raise OnnxqError("--shard i/n calibrates one shard here, --shards N runs all N on --executor; give one")
    if args.shard is None and (args.executor is not None or args.ray_address is not None) and args.shards is None:
        raise OnnxqError("--executor and --ray-address run shards: add --shards N")
    if args.shard is not None:
        result = calibrate_shard(args.input, output, config, args.calib_data, args.shard, progress=progress)
    else:
        result = calibrate_sharded(args.input, output, config, args.calib_data, args.shards or 1,
                                   args.executor or "process", args.ray_address, progress=progress)
    if not args.quiet:
        first, end = result.window
        print(f"onnxq: statistics of batches {first}..{end - 1} of {result.total_batches} "
              f"({result.num_samples} samples) written to {result.path}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    if args.show:
        print(config_to_yaml(get_preset(args.show)), end="")
        return 0
    width = max(len(name) for name in PRESETS)
    for name, preset in PRESETS.items():
        print(f"{name:<{width}}  {preset.description}")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    print(config_to_yaml(compose_config(args.preset, args.config, _spec_overrides(args))), end="")
    return 0


def _cmd_config_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from onnxq.config import save_config

    if Path(args.output).resolve() == Path(args.input).resolve():
        raise OnnxqError(f"convert would overwrite its input {args.input}; give another output path")
    save_config(compose_config(args.preset, args.input), args.output)
    print(f"onnxq: wrote {args.output}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from onnxq.emit.format_convert import convert_model

    print(convert_model(args.input, args.output, args.to))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from onnxq.evaluate import run_model

    _check_model_files(args.model)
    outputs = run_model(args.model, args.data, args.max_samples, args.providers)
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)} min {array.min():.6g} max {array.max():.6g} "
              f"mean {array.mean():.6g}")
    if args.out:
        from onnxq.graph.save import write_npz_atomic

        write_npz_atomic(args.out, outputs)
        print(f"  outputs written to {args.out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from onnxq.graph.load import load_model
    from onnxq.optimize import PassContext, run_passes
    from onnxq.plan import plan_quantization

    model, report = load_model(args.model)
    graph = model.graph
    print(f"model: {report.source}")
    print(f"opset: {report.original_opset}" + (f" (normalised to {report.opset})" if report.opset != report.original_opset else ""))
    for label, values in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        print(f"{label}:")
        for v in values:
            dims = "?" if v.shape is None else "[" + ",".join(str(d) for d in v.shape) + "]"
            print(f"  {v.name}: {v.dtype.name if v.dtype else '?'} {dims}")
    ops = Counter(n.op_type for n in graph)
    print(f"nodes: {sum(ops.values())} (" + ", ".join(f"{op} {n}" for op, n in ops.most_common()) + ")")
    from onnxq.graph.quantized import describe, quantized_ops

    already = quantized_ops(model)
    if already:
        print(f"already quantized: {describe(already, limit=8)}; onnxq quantize takes the float model")
        if args.nodes:
            _print_nodes(graph, None)
        return 0
    config = compose_config(args.preset, args.config, {"target": args.target} if args.target else None)
    for note in run_passes(model, config.pre_quant_opt_config, PassContext(None, config.calibration)):
        print(f"pass {note}")
    from onnxq.target import resolve_target

    target = resolve_target(config)
    print(target.describe())
    plan = plan_quantization(model, config, target=target)
    quantized = Counter(plan.quantized_nodes.values())
    print(f"would quantize: {sum(quantized.values())} nodes (" + ", ".join(f"{op} {n}" for op, n in sorted(quantized.items())) + ")")
    reasons = Counter(plan.float_nodes.values())
    for (op, why), n in sorted(reasons.items()):
        print(f"  float: {op} x{n}: {why}")
    if args.nodes:
        _print_nodes(graph, plan)
    return 0


def _print_nodes(graph, plan) -> None:
    """Every node's name (what `exclude` and `layer_quant_config` take), op type and, with
    a plan, whether it would be quantized."""
    print("node names (for exclude / layer_quant_config):")
    for node in graph:
        status = ""
        if plan is not None:
            status = ("quantized" if node.name in plan.quantized_nodes
                      else f"float: {plan.float_nodes[node.name][1]}" if node.name in plan.float_nodes else "")
        print(f"  {node.name}  {node.op_type}" + (f"  ({status})" if status else ""))


def _data_and_labels(data: str, key: str | None) -> tuple[object, object]:
    """`--data` and the labels array `--labels KEY` names in it (split off the inputs)."""
    from pathlib import Path

    import numpy as np

    from onnxq.errors import CalibrationDataError

    if key is None:
        return data, None
    path = Path(data)
    if path.suffix != ".npz" or not path.is_file():
        raise CalibrationDataError("--labels KEY needs --data to be one .npz file holding that key")
    with np.load(path) as npz:
        if key not in npz.files:
            raise CalibrationDataError(f"{path} has no array {key!r}; keys: {', '.join(npz.files)}")
        arrays = {k: npz[k] for k in npz.files}
    return arrays, arrays.pop(key)


def _check_model_files(*models: str) -> None:
    from onnxq.graph.load import check_readable

    for model in models:
        check_readable(model)


def _check_counts(args: argparse.Namespace, *flags: str) -> None:
    """Each count flag given (`--max-samples`, `--batch-size`, `--shards`) is at least 1."""
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value < 1:
            raise OnnxqError(f"invalid {flag} {value}; use 1 or more, or leave it out")


def _cmd_analyze(args: argparse.Namespace) -> int:
    from onnxq.analyze import analyze_models, format_analysis

    _check_model_files(args.float_model, args.quant_model)
    _check_counts(args, "--max-samples", "--batch-size")
    check_output_paths(args.quant_model, args.json, args.report)
    data, _ = _data_and_labels(args.data, args.labels)
    analysis = analyze_models(args.float_model, args.quant_model, data, max_samples=args.max_samples,
                              providers=args.providers, progress=False if args.quiet else None,
                              **_batch_size(args))
    if args.json:
        analysis.to_json(args.json)
    if args.report:
        from onnxq.analyze.html import write_html_report

        write_html_report(args.report, analysis=analysis, title=f"onnxq analysis of {args.quant_model}")
    print(format_analysis(analysis, args.top))
    return 0


def _batch_size(args: argparse.Namespace) -> dict[str, int]:
    """`--batch-size` as a keyword (absent: the command's own default)."""
    return {} if args.batch_size is None else {"batch_size": args.batch_size}


def _cmd_compare(args: argparse.Namespace) -> int:
    data, labels = _data_and_labels(args.data, args.labels)
    _check_model_files(args.float_model, args.quant_model)
    _check_counts(args, "--max-samples", "--batch-size")
    from onnxq.evaluate import compare_models, format_comparison

    result = compare_models(args.float_model, args.quant_model, data, labels, args.max_samples,
                            providers=args.providers, kernels=args.kernels,
                            progress=False if args.quiet else None, **_batch_size(args))
    print(format_comparison(result))
    return 0


def _model_pair_parser(sub: Any, name: str, help_text: str, labels_help: str) -> argparse.ArgumentParser:
    """A subcommand reading a float model, its quantized model and data (compare, analyze)."""
    c = sub.add_parser(name, help=help_text)
    c.add_argument("float_model")
    c.add_argument("quant_model")
    c.add_argument("--data", required=True, help="inputs: .npz, .npy or a folder of them")
    c.add_argument("--labels", metavar="KEY", help=labels_help)
    c.add_argument("--max-samples", type=int)
    c.add_argument("--batch-size", type=int, help="samples per run (dynamically quantized models compute "
                   "their activation scales per run, so their figures depend on it)")
    c.add_argument("--providers", nargs="+", help="onnxruntime execution providers")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return c


def add_config_flags(q: argparse.ArgumentParser, stats: bool = True) -> None:
    """The flags that set the config (`quantize`, `calibrate` and `config show` share them;
    `calibrate` has its own --stats, the file it writes)."""
    q.add_argument("--preset", help=f"starting recipe ({', '.join(PRESETS)}; default U8S8)")
    q.add_argument("--config", help="config file applied over the preset: YAML, JSON or an AMCT "
                   "simplified config (.cfg); its `preset:` key picks the preset when --preset is not given")
    q.add_argument("--calib-method", help="activation calibration method (minmax, percentile, ...)")
    q.add_argument("--percentile", type=float, help="percentile for --calib-method percentile")
    q.add_argument("--num-bins", type=int, help="histogram bins for histogram-based methods")
    q.add_argument("--calib-option", action="append", metavar="KEY=VALUE",
                   help="method-specific option, e.g. search_step=0.02 for ifmr (repeatable)")
    q.add_argument("--cle", action="store_true", help="cross-layer equalization of Conv/Gemm chains")
    q.add_argument("--smoothquant", type=float, metavar="ALPHA",
                   help="SmoothQuant with migration strength ALPHA in [0, 1] (MatMul/Gemm outliers)")
    q.add_argument("--bias-correction", action="store_true",
                   help="correct the mean output error that weight quantization adds to each bias")
    q.add_argument("--adaround", action="store_true",
                   help="learn each weight's rounding, layer by layer, against the float model (AdaRound)")
    q.add_argument("--adaquant", action="store_true",
                   help="optimise weights and biases layer by layer through the rounding (AdaQuant)")
    q.add_argument("--gptq", action="store_true",
                   help="GPTQ for int4 MatMul weights lowered to MatMulNBits (e.g. --preset W4_GROUP128): "
                        "rounding errors compensated through the calibration inputs' Hessian")
    q.add_argument("--awq", action="store_true",
                   help="AWQ for int4 MatMul weights lowered to MatMulNBits: input channels with large "
                        "activations get finer steps (per-layer alpha search on the calibration data)")
    q.add_argument("--algorithm", choices=WEIGHT_ONLY_ALGORITHMS,
                   help="how int4 MatMul weights lowered to MatMulNBits are rounded: rtn (round to nearest, "
                        "per-block clipping search; default), gptq, awq, or hqq (half-quadratic zero points, "
                        "no data)")
    q.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4),
                   help="MatMulNBits' accuracy_level: the type its kernel computes the activations in "
                        "(0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8)")
    q.add_argument("--algo-option", action="append", metavar="[ALGO.]KEY=VALUE",
                   help="option of an algorithm, e.g. num_iteration=500 or adaround.reg_param=0.02 "
                        "(repeatable; a bare KEY goes to the one algorithm flag given)")
    q.add_argument("--max-calib-memory", type=int, metavar="MIB",
                   help="bound on activations held per batch; calibrates in groups above it")
    q.add_argument("--save-ranges", metavar="FILE.json", help="write calibrated ranges to a file")
    q.add_argument("--load-ranges", metavar="FILE.json", help="use saved ranges, skip calibration")
    if stats:
        q.add_argument("--stats", nargs="+", metavar="FILE.npz",
                       help="merge these statistics files (onnxq calibrate --shard i/n --stats FILE) instead "
                            "of calibrating; byte-identical to calibrating on all the data")
    granularity = q.add_mutually_exclusive_group()
    granularity.add_argument("--per-tensor", action="store_true", help="one weight scale per tensor")
    granularity.add_argument("--per-channel", action="store_true", help="one weight scale per output channel")
    granularity.add_argument("--per-group", type=int, metavar="SIZE",
                             help="weight scales per block of SIZE along the input axis")
    q.add_argument("--scale-type", help="float32, float16 or power_of_two")
    q.add_argument("--dynamic", action="store_true",
                   help="quantize activations at run time (MatMul/Gemm/Conv/LSTM); no calibration")
    q.add_argument("--format", choices=("qdq", "qoperator", "qdq-ext"),
                   help="qdq: QuantizeLinear/DequantizeLinear around float ops (default); qoperator: "
                        "onnxruntime's integer kernels (QLinearConv, QLinearMatMul, QGemm, QLinearAdd, ...); "
                        "qdq-ext: QDQ plus onnxq's extended ops where stock Q/DQ cannot express an activation "
                        "(any bit width, int32, rounding modes; run with onnxq.runtime or onnxq run)")
    q.add_argument("--qdq-domain", help="ai.onnx (upgrade opset when a type needs it) or com.microsoft")
    q.add_argument("--matmul-nbits", action="store_true",
                   help="weight-only int4/uint4 per-group MatMul as onnxruntime MatMulNBits")
    q.add_argument("--activation-type",
                   help="activation dtype: uint8, int8, uint16, int16 (opset 21), float8_e4m3fn, float8_e5m2 "
                        "(opset 19), float16 or bfloat16 (float compute), float32 (not quantized)")
    q.add_argument("--weight-type",
                   help="weight dtype: int8, uint8, int4, uint4 (opset 21), int16, uint16, float8_e4m3fn, "
                        "float8_e5m2, float16, bfloat16 or float32 (not quantized)")
    q.add_argument("--edge-weight-type", metavar="DTYPE",
                   help="weight dtype of the first and last weighted layers (edge_weight; W4A8 keeps them "
                        "int8), or none: like every other layer")
    q.add_argument("--edge-input-type", metavar="DTYPE",
                   help="input-activation dtype of the same two layers (edge_input; FP8_E4M3 keeps them "
                        "float32, unquantized), or none: like every other layer")
    q.add_argument("--weight-bits", type=int, metavar="N",
                   help="weight bit width 2..8 inside the weight dtype (e.g. 7 or 6, AMCT ARQ)")
    q.add_argument("--target", help="where the model runs: auto (default: probe this onnxruntime), "
                   "x86-vnni, x86-avx2, arm64, gpu or generic (any CPU)")
    q.add_argument("--reduce-range", action=argparse.BooleanOptionalAction, default=None,
                   help="7-bit weights for Conv/MatMul/Gemm, as onnxruntime's reduce_range; "
                        "--no-reduce-range: full 8 bits even where kernels saturate (default: "
                        "pair-safe 8-bit scales where the target's int8 kernels saturate, uint8 "
                        "per-tensor weights there)")
    q.add_argument("--target-algorithms", action=argparse.BooleanOptionalAction, default=None,
                   help="let the target add bias correction where it narrows weights (default on)")
    q.add_argument("--exclude", nargs="+", metavar="NAME", help="node names or regexes to keep in float")
    q.add_argument("--max-samples", type=int, help="use at most N calibration samples")
    q.add_argument("--batch-size", type=int, help="calibration batch size (dynamic-batch models)")
    q.add_argument("--providers", nargs="+", help="onnxruntime execution providers for calibration")
    q.add_argument("--check-samples", type=int, metavar="N",
                   help="run the quantized model on N calibration samples against the float model "
                        "(default session) and report the output SQNR and cosine (default 8 for models up "
                        "to 256 MB; 0: no check)")
    q.add_argument("--accuracy-target", metavar="EXPR",
                   help="raise the most sensitive layers up --ladder until the model meets EXPR, e.g. "
                        "'top1>=float-0.5', 'cosine>=0.999', 'sqnr>=30' (scored in a default session)")
    q.add_argument("--metric", choices=("top1", "cosine", "sqnr"),
                   help="what --accuracy-target measures when EXPR names no metric (e.g. float-0.5)")
    q.add_argument("--eval-data", metavar="PATH",
                   help="labelled evaluation set for --accuracy-target (.npz with a 'labels' array for "
                        "top1; default: the calibration data)")
    q.add_argument("--labels", metavar="KEY", help="the labels array in --eval-data (default: labels)")
    q.add_argument("--ladder", nargs="+", metavar="RUNG",
                   help="what a sensitive layer may be raised to, cheapest first: int16, fp16, bf16, "
                        "float (default: int16 float)")


class _Parser(argparse.ArgumentParser):
    """Usage mistakes (a bad flag value, a missing argument) as one line and exit 2, like
    every other user mistake, instead of the whole usage block; subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        print(f"onnxq: error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's signature)
        """As argparse's, but an unknown option points to the help of the command it was given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            print(f"onnxq: error: unrecognized arguments: {' '.join(extras)}; see {where} --help", file=sys.stderr)
            raise SystemExit(EXIT_USAGE)
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onnxq", description="Post-training quantization for ONNX models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                        help="import code that registers observers, passes or algorithms first "
                             "(repeatable; also $ONNXQ_PLUGINS)")
    parser.add_argument("--version", action="version", version=f"onnxq {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model with calibration data")
    q.add_argument("input", help="float ONNX model")
    q.add_argument("output", help="where to write the quantized model")
    q.add_argument("--calib-data", help="calibration data: .npz, .npy or a folder of them")
    add_config_flags(q)
    q.add_argument("--save-config", metavar="FILE.yaml",
                   help="write the config used (with the layers an accuracy target promoted) to reuse")
    q.add_argument("--report", metavar="FILE.html",
                   help="write an HTML report: settings, summary, per-layer error, ranges, promotions")
    q.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    q.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    q.set_defaults(func=_cmd_quantize)

    cal = sub.add_parser("calibrate", help="calibrate (one shard of) the data and save mergeable statistics "
                         "for quantize --stats")
    cal.add_argument("input", help="float ONNX model")
    cal.add_argument("--calib-data", required=True, help="calibration data: .npz, .npy or a folder of them")
    cal.add_argument("--stats", required=True, metavar="FILE.npz", help="where to write the statistics")
    cal.add_argument("--shard", metavar="I/N", help="calibrate only shard I of N (1-based): a contiguous "
                     "stretch of the batches; run every shard (on any machines), then quantize --stats with all files")
    cal.add_argument("--shards", type=int, metavar="N", help="run all N shards in parallel on --executor and "
                     "write their merged statistics")
    cal.add_argument("--executor", choices=("process", "ray"),
                     help="where --shards run: local processes (default) or Ray tasks (pip install 'onnxq[ray]')")
    cal.add_argument("--ray-address", metavar="ADDR", help="an existing Ray cluster (default: a local instance)")
    add_config_flags(cal, stats=False)
    cal.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    cal.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    cal.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("presets", help="list the named presets")
    p.add_argument("--show", metavar="NAME", help="print one preset as YAML")
    p.set_defaults(func=_cmd_presets)

    c = _model_pair_parser(sub, "compare", "compare a quantized model with its float original",
                           "array in the --data .npz holding class labels")
    c.add_argument("--kernels", choices=("deployed", "reference", "both"), default="deployed",
                   help="deployed: a default onnxruntime session, as users run it (default); "
                        "reference: Q/DQ unfused, float arithmetic; both: report both")
    c.set_defaults(func=_cmd_compare)

    a = _model_pair_parser(sub, "analyze", "per-layer and per-tensor error of a quantized model",
                           "an array in the --data .npz to leave out (labels)")
    a.add_argument("--json", metavar="FILE.json", help="write every figure as JSON")
    a.add_argument("--report", metavar="FILE.html", help="write an HTML report")
    a.add_argument("--top", type=int, default=15, help="rows of each table on the terminal (default 15)")
    a.set_defaults(func=_cmd_analyze)

    cfg = sub.add_parser("config", help="show the config a set of flags resolves to, or convert a config file")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved config (preset < --config < flags) as YAML")
    add_config_flags(show)
    show.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    show.set_defaults(func=_cmd_config_show)
    convert = cfg_sub.add_parser("convert", help="write a config file (YAML, JSON or AMCT .cfg) as a "
                                 "complete onnxq YAML/JSON config")
    convert.add_argument("input", help="config file to read")
    convert.add_argument("output", help="where to write it (.yaml, .yml or .json)")
    convert.add_argument("--preset", help="preset under the input (default: its preset: key, else U8S8)")
    convert.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    convert.set_defaults(func=_cmd_config_convert)

    conv = sub.add_parser("convert", help="rewrite a quantized model in another format")
    conv.add_argument("input", help="quantized ONNX model")
    conv.add_argument("output", help="where to write the converted model")
    conv.add_argument("--to", required=True, choices=("qdq", "qoperator", "float"),
                      help="qdq: Q/DQ around float ops; qoperator: integer kernels; float: every Q/DQ "
                           "stripped (weights dequantized, activations clipped to their range), for debugging")
    conv.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    conv.set_defaults(func=_cmd_convert)

    r = sub.add_parser("run", help="run a model (extended qdq-ext ops included) on data")
    r.add_argument("model")
    r.add_argument("--data", required=True, help="inputs: .npz, .npy or a folder of them")
    r.add_argument("--out", metavar="FILE.npz", help="write every output, concatenated over the data")
    r.add_argument("--max-samples", type=int)
    r.add_argument("--providers", nargs="+", help="onnxruntime execution providers")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_run)

    i = sub.add_parser("inspect", help="describe a model and what would be quantized")
    i.add_argument("model")
    i.add_argument("--preset")
    i.add_argument("--config")
    i.add_argument("--target", help="deployment target (default auto)")
    i.add_argument("--nodes", action="store_true",
                   help="list every node's name and op type (the names exclude and layer_quant_config take)")
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    i.set_defaults(func=_cmd_inspect)
    for command in _leaves(sub):  # --plugin after the command too
        command.add_argument("--plugin", action="append", dest="command_plugins", default=[],
                             metavar="FILE.py|MODULE", help="import code that registers observers, "
                             "passes or algorithms first (repeatable; also $ONNXQ_PLUGINS)")
    return parser


def _leaves(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Every command's parser (`config show` and `config convert`, not `config`)."""
    leaves = []
    for parser in dict.fromkeys(sub.choices.values()):
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += _leaves(nested[0]) if nested else [parser]
    return leaves


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status is 0, 2 for a user mistake (one line on
    stderr, or its traceback with --debug: the status does not change), 130 when
    interrupted, 143 when terminated (SIGTERM; temporary files removed), 141 when the reader of stdout went away (`onnxq presets | head -1`)."""
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM (kill, a scheduler's timeout) unwinds like Ctrl-C: temporary files go
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        load_plugins(args.plugin + getattr(args, "command_plugins", []))
        return args.func(args)
    except OnnxqError as exc:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"onnxq: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("onnxq: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would report the closed pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
