"""Commands on one model: `onnxq convert` (another format), `onnxq run` (on data) and
`onnxq inspect` (what it holds and what would be quantized)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from onnxq.calibrate.decoder import PAST, PRESENT
from onnxq.cli.arguments import check_model_files
from onnxq.config.compose import OVERRIDES_SOURCE, compose_config
from onnxq.config.defaults import default_preset
from onnxq.emit.format_convert import convert_model
from onnxq.evaluate import run_model
from onnxq.graph.load import load_model
from onnxq.graph.quantized import describe, quantized_ops
from onnxq.graph.save import check_apart, check_output_paths, write_npz_atomic
from onnxq.graph.wire import read_structure
from onnxq.optimize import RunSettings, parse_passes, run_passes
from onnxq.plan import plan_quantization
from onnxq.target import resolve_target


def add_convert(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="rewrite a quantized model in another format")
    conv.add_argument("input", help="quantized ONNX model")
    conv.add_argument("output", help="where to write the converted model")
    conv.add_argument("--to", "--format", dest="to", required=True, choices=("qdq", "qoperator", "float"),
                      help="qdq: Q/DQ around float ops; qoperator: integer kernels; float: every Q/DQ "
                           "stripped (weights dequantized, activations clipped to their range), for debugging "
                           "(--format, as quantize calls it, is the same)")
    conv.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    conv.set_defaults(func=_cmd_convert)


def add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run a model (extended qdq-ext ops included) on data")
    r.add_argument("model")
    r.add_argument("--data", required=True, help="inputs: .npz, .npy or a folder of them")
    r.add_argument("--out", metavar="FILE.npz", help="write every output, concatenated over the data")
    r.add_argument("--max-samples", type=int)
    r.add_argument("--providers", nargs="+", help="onnxruntime execution providers")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_run)


def add_inspect(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("inspect", help="describe a model and what would be quantized")
    i.add_argument("model")
    i.add_argument("--preset")
    i.add_argument("--config")
    i.add_argument("--target", help="deployment target (default auto)")
    i.add_argument("--nodes", action="store_true",
                   help="list every node's name and op type (the names exclude and layer_quant_config take)")
    i.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    i.set_defaults(func=_cmd_inspect)


def _cmd_convert(args: argparse.Namespace) -> int:
    print(convert_model(args.input, args.output, args.to))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    check_model_files(args, "model")
    if args.out:  # before the run, not after it
        check_output_paths(args.model, args.out)
        check_apart({"--out": args.out}, {"the model": args.model, "the data": args.data})
    outputs = run_model(args.model, args.data, args.max_samples, args.providers)
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)} min {array.min():.6g} max {array.max():.6g} "
              f"mean {array.mean():.6g}")
    if args.out:
        write_npz_atomic(args.out, outputs)
        print(f"  outputs written to {args.out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    given = args.model  # a model folder picks the default preset as quantize's does (a genai folder: a decoder's)
    check_model_files(args, "model")
    model, report = load_model(args.model)
    graph = model.graph
    print(f"model: {report.source}")
    print(f"opset: {report.original_opset}" + (f" (normalised to {report.opset})" if report.opset != report.original_opset else ""))
    for label, values in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        print(f"{label}:")
        cache = [v for v in values if PAST.match(v.name) or PRESENT.match(v.name)]
        for v in values:
            if v not in cache:
                print(f"  {v.name}: {_typed(v)}")
        if cache:  # an LLM's KV cache: a line per shape, not one per layer and kind (Gemma2's sliding layers differ)
            shapes: dict[str, list[str]] = {}
            for v in cache:
                shapes.setdefault(_typed(v), []).append(v.name)
            for typed, named in shapes.items():
                span = f"{named[0]} ... {named[-1]}" if len(named) > 1 else named[0]
                print(f"  {span}: {len(named)} KV-cache {label}, {typed}")
    ops = Counter(n.op_type for n in graph)
    # the file as it is first (encoder trial: a quantized model's Sum nodes were listed as the Add onnxq reads)
    in_file = Counter(n.op_type for n in read_structure(report.source).graph.node) \
        if Path(report.source).is_file() else ops
    print(f"nodes: {in_file.total()} (" + ", ".join(f"{op} {n}" for op, n in in_file.most_common()) + ")")
    if in_file != ops:
        changed = sorted(set(in_file) | set(ops), key=lambda op: (-abs(ops[op] - in_file[op]), op))
        delta = ", ".join(f"{op} {in_file[op]} -> {ops[op]}" for op in changed if ops[op] != in_file[op])
        print(f"  as onnxq reads the graph: {ops.total()} nodes ({delta})")
    already = quantized_ops(model)
    if already:
        print(f"already quantized: {describe(already, limit=8)}; onnxq quantize takes the float model")
        if args.nodes:
            _print_nodes(graph, None)
        return 0
    picked: list[str] = []

    def pick() -> str:  # called only where no source names a preset
        picked.append(default_preset(given))
        return picked[0]

    config = compose_config(args.preset, args.config, {"target": args.target} if args.target else None, pick,
                            label=OVERRIDES_SOURCE)
    if picked:
        print(f"preset: {picked[0]} (this model's default; --preset NAME for another)")
    passes = run_passes(model, parse_passes(config.pre_quant_opt_config), RunSettings.of(None, config.calibration))
    for note in passes.notes:
        print(f"pass {note}")
    target = resolve_target(config)
    print(target.describe())
    plan = plan_quantization(model, config, passes.keep_float, target)
    node_ops = {n.name: n.op_type for n in graph}
    quantized = Counter(plan.integer_nodes().values())
    print(f"would quantize: {sum(quantized.values())} nodes (" + ", ".join(f"{op} {n}" for op, n in sorted(quantized.items())) + ")")
    lowered = Counter((node_ops.get(n, "?"), low.strategy, _spec_text(low.spec)) for n, low in plan.lowered.items())
    for (op, strategy, spec), n in sorted(lowered.items()):
        print(f"  {op} x{n}: {strategy} ({spec})")
    for gather, tie in sorted(plan.tied.items()):
        print(f"  tied: {gather} and {tie.head}: " + (f"one copy, blocks of {tie.block_size}"
                                                     if tie.block_size else "two copies") +
              (f" ({tie.reason})" if tie.reason else ""))
    weights = Counter(plan.float_weight_nodes().values())
    for (op, why), n in sorted(weights.items()):
        print(f"  float weight, quantized activations: {op} x{n}: {why}")
    for why, n in sorted(Counter(plan.float_inputs.values()).items()):
        print(f"  float inputs, quantized weight: MatMul x{n}: {why}")
    reasons = Counter(plan.float_nodes.values())
    for (op, why), n in sorted(reasons.items()):
        print(f"  float: {op} x{n}: {why}")
    if args.nodes:
        _print_nodes(graph, plan)
    return 0


def _typed(value) -> str:
    dims = "?" if value.shape is None else "[" + ",".join(str(d) for d in value.shape) + "]"
    return f"{value.dtype.name if value.dtype else '?'} {dims}"


def _spec_text(spec) -> str:
    """A lowering's weight type and blocks, as the summary would name them."""
    if not hasattr(spec, "dtype"):  # a bare type (a float-type lowering)
        return str(getattr(spec, "value", spec))
    dtype = getattr(spec.dtype, "value", spec.dtype)
    return f"{dtype}" + (f", blocks of {spec.group_size}" if spec.group_size else "")


def _print_nodes(graph, plan) -> None:
    """Every node's name (what `exclude` and `layer_quant_config` take), op type and, with
    a plan, whether it would be quantized."""
    print("node names (for exclude / layer_quant_config):")
    for node in graph:
        status = ""
        if plan is not None:
            status = (f"float weight: {plan.float_weights[node.name]}" if node.name in plan.float_weights
                      else f"float inputs: {plan.float_inputs[node.name]}" if node.name in plan.float_inputs
                      else "quantized" if node.name in plan.quantized_nodes
                      else f"float: {plan.float_nodes[node.name][1]}" if node.name in plan.float_nodes else "")
        print(f"  {node.name}  {node.op_type}" + (f"  ({status})" if status else ""))
