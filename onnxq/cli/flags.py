"""The flags that set the config (`quantize`, `calibrate`, `config show`): their declaration
and their translation into the config-file shape, which `compose_config` lays over the
config file and the preset."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from onnxq.cli.algorithms import algorithm_entries, weight_only_choices
from onnxq.cli.arguments import key_values
from onnxq.config import PRESETS
from onnxq.config.accuracy import parse_target
from onnxq.config.amct import AMCT_SUFFIXES
from onnxq.config.compose import OVERRIDES_SOURCE
from onnxq.config.spec import DEFAULT_LADDER, LAYER_CLASS_FIELDS, enum_text
from onnxq.errors import OnnxqError
from onnxq.optimize.registry import CONTRACTS, PASSES, flagged_algorithms

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
    ("float_op_types", ("float_op_types",)),
    ("qdq_domain", ("qdq_domain",)),
    ("format", ("quant_format",)),
    ("target", ("target",)),
    ("reduce_range", ("reduce_range",)),
    ("target_algorithms", ("target_algorithms",)),
    ("accuracy_level", ("accuracy_level",)),
    ("matmul_nbits", ("matmul_nbits",)),
    ("opset", ("opset",)),
    ("max_samples", ("calibration", "max_samples")),
    ("batch_size", ("calibration", "batch_size")),
    ("providers", ("calibration", "providers")),
    ("max_calib_memory", ("calibration", "max_memory_mb")),
    ("check_samples", ("calibration", "check_samples")),
    ("latency", ("calibration", "measure_latency")),
    ("optimize_for", ("optimize_for",)),
    ("calib_text", ("calibration", "text")),
    ("sequence_length", ("calibration", "sequence_length")),
    ("save_ranges", ("calibration", "save_ranges")),
    ("load_ranges", ("calibration", "load_ranges")),
    ("stats", ("calibration", "stats")),
    ("eval_data", ("mixed_precision", "eval_data")),
    ("labels", ("mixed_precision", "labels")),
    ("ladder", ("mixed_precision", "ladder")),
    ("rung_min_gain", ("mixed_precision", "rung_min_gain")),
)


# A Python argument an error names ("pass calibration_data (...)") -> the flag that gives it.
ARGUMENT_FLAGS: tuple[tuple[str, str], ...] = (("calibration_data", "--calib-data PATH"),
                                               ("calibration.text", "--calib-text FILE"),
                                               ("mixed_precision.eval_data", "--eval-data PATH"))


def spec_overrides(args: argparse.Namespace) -> dict[str, Any]:
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


DYNAMIC_PATH = ("act", "is_dynamic")  # what --dynamic sets


def _flag_values(args: argparse.Namespace) -> list[tuple[tuple[str, ...], Any]]:
    """(config path, value) of every flag given, including the derived ones."""
    values = [(path, getattr(args, flag)) for flag, path in FLAG_PATHS if getattr(args, flag) is not None]
    if args.calib_option:
        values.append((("act", "calib_options"), key_values(args.calib_option)))
    if args.dynamic:
        values.append((DYNAMIC_PATH, True))
    for flag, scheme in (("per_tensor", "per_tensor"), ("per_channel", "per_channel")):
        if getattr(args, flag):
            values.append((("weight", "qscheme"), scheme))
    if args.per_group is not None:
        values += [(("weight", "qscheme"), "per_group"), (("weight", "group_size"), args.per_group)]
    for key in LAYER_CLASS_FIELDS:  # a bare dtype or none, as in a config file (`config.io.bare_layer_class_dtypes`)
        if getattr(args, f"{key}_type") is not None:
            values.append(((key,), getattr(args, f"{key}_type")))
    passes = [{"name": "cle"}] if args.cle else []
    if args.smoothquant is not None:
        passes.append({"name": "smoothquant", "alpha": args.smoothquant})
    passes, rest = pass_options(args, passes)
    if passes:
        values.append((("pre_quant_opt_config",), passes))
    entries = algorithm_entries(argparse.Namespace(**{**vars(args), "algo_option": rest}))
    if entries:
        values.append((("algo_config",), entries))
    if args.accuracy_target is not None or args.metric is not None:
        values.append((("mixed_precision", "target"), _target_text(args.accuracy_target, args.metric)))
    return values


def pass_options(args: argparse.Namespace, passes: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """`passes` (the pass flags' `pre_quant_opt_config` entries) with the `--algo-option`s
    that name a pass (`cle.steps=5`; a bare KEY where a pass flag is the only flag given,
    `--cle --algo-option steps=5`) merged in, and the options left for the algorithms."""
    entries = {e["name"]: dict(e) for e in passes}
    algorithms = any(getattr(args, name) for name in flagged_algorithms()) or args.algorithm is not None \
        or getattr(args, "reconstruct", None) is not None
    rest = []
    for item in args.algo_option or []:
        key, sep, value = item.partition("=")
        name, dot, option = key.rpartition(".")
        if not dot and len(entries) == 1 and not algorithms:
            name, option = next(iter(entries)), key
        elif not dot or name not in PASSES:
            rest.append(item)
            continue
        entry = entries.setdefault(name, {"name": name})
        entry.pop(_SAME_SETTING.get(option, ""), None)  # the option replaces the flag's value of its setting
        entry.update(key_values([f"{option}{sep}{value}"], "--algo-option"))
    return list(entries.values()), rest


# A pass option's other name: `--smoothquant ALPHA` writes alpha, algorithms.md's YAML says
# migration_strength (AMCT's word); either from --algo-option replaces the flag's.
_SAME_SETTING = {"migration_strength": "alpha", "alpha": "migration_strength"}


def _where(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where a config error locates a field the flag at `path` sets (`... in WHERE; fix`)."""
    if path[0] == "act":
        return ("global_quant_config.input_tensors", "global_quant_config.output_tensors")
    if path[0] == "weight":
        return ("global_quant_config.weight",)
    return (path[0],) if len(path) == 2 else ("config",)


def _option(flag: str) -> str:
    """A flag's `dest` as typed on the command line."""
    return "--" + flag.replace("_", "-")


# The flags `FLAG_PATHS` leaves to `_flag_values`, by the field they set.
_DERIVED_PATHS = (("per_group", ("weight", "group_size")),
                  *((f"{key}_type", (key, "dtype")) for key in LAYER_CLASS_FIELDS))


def _given(args: argparse.Namespace) -> list[tuple[str, str, tuple[str, ...], Any]]:
    """(flag, field, where, value) of each single-valued flag given that sets a config field."""
    given = []
    for flag, path in (*FLAG_PATHS, *_DERIVED_PATHS):
        value = getattr(args, flag, None)
        if value is not None and not isinstance(value, list | tuple | bool):
            given.append((_option(flag), path[-1], _where(path), value))
    if getattr(args, "dynamic", False):  # a switch: its field reads "is_dynamic True" in an error
        given.append(("--dynamic", DYNAMIC_PATH[-1], _where(DYNAMIC_PATH), True))
    return given


def _flags_at(where: str) -> list[tuple[str, str]]:
    """(flag, field) of every flag that writes a field where an error locates it."""
    return [(_option(flag), path[-1]) for flag, path in FLAG_PATHS if where in _where(path)]


def in_cli_words(text: str) -> str:
    """The Python API's words for its arguments, in an error or a summary note ("pass
    calibration_data (...)"), as the flags that give them ("pass --calib-data PATH"): the
    library says what a Python caller passes, the command line what its user types."""
    for python, flag in ARGUMENT_FLAGS:
        text = re.sub(rf"\b(pass|or) {re.escape(python)}(?: \((?!or )[^)]*\))?", rf"\1 {flag}", text)
    return re.sub(r"\bcalibration\.check_samples (\d+)", r"--check-samples \1", text)


# An AMCT file's settings in the words of the errors onnxq raises once the model is read
# (after the file's translation): onnxq's field -> the AMCT field it came from.
AMCT_WORDS = ((r"^exclude entry", "skip_layers entry"),
              (r"^layer_quant_config names ('[^']*'), which is", r"layer_name \1 is"))


def in_amct_words(message: str, args: argparse.Namespace) -> str:
    """An error about a setting an AMCT `--config` file made, in the file's words
    (`skip_layers "conv9"` had read back as "exclude entry 'conv9' matches no node")."""
    config = getattr(args, "config", None)
    if not config or Path(str(config)).suffix.lower() not in AMCT_SUFFIXES:
        return message
    named = re.search(r"'([^']*)'", message)
    try:  # a name the file does not hold came from a flag (--exclude): onnxq's words stand
        name = re.sub(r"\\(.)", r"\1", named.group(1)) if named else None  # skip_layers are escaped to patterns
        if name is None or name not in Path(str(config)).read_text(encoding="utf-8", errors="replace"):
            return message
    except OSError:
        return message
    for ours, theirs in AMCT_WORDS:
        if re.search(ours, message):
            return f"{config}: {re.sub(ours, theirs, message)}"
    return message


def in_flag_terms(message: str, args: argparse.Namespace) -> str:
    """A config error the flags caused, in the flags' words: `invalid batch_size 0 in
    calibration` for `--batch-size 0` reads `invalid --batch-size 0 in calibration`. In the
    problem (before the first "; "), a field is renamed where it stands before the value a
    flag gave it and the error locates it where that flag writes (nowhere: at the top
    level, as `invalid accuracy_level 7`); in the fix after it,
    "remove FIELD" of a renamed field and "use FIELD VALUE" of a field a flag sets there.
    The layer's "options: " prefix goes (on the command line the overrides are the flags);
    an error of another source passes unchanged."""
    message = in_amct_words(in_cli_words(message), args)
    prefix = OVERRIDES_SOURCE + ": "
    if not message.startswith(prefix):
        return message
    problem, sep, fix = message[len(prefix):].partition("; ")
    where = problem.rsplit(" in ", 1)[1] if " in " in problem else "config"  # no place: a top-level field
    candidates = [(flag, field, value) for flag, field, wheres, value in _given(args) if where in wheres]
    renamed = []
    for flag, field, value in candidates:
        if sum(f == field and str(v) == str(value) for _, f, v in candidates) > 1:
            continue  # two flags gave this field this value: which one is meant cannot be told
        shown = "|".join(re.escape(v) for v in (repr(value), str(value)))
        if value is True:  # a switch stands alone: "is_dynamic True" reads "--dynamic"
            new = re.sub(rf"(?<![\w.-]){re.escape(field)} True(?![\w.])", flag, problem)
        else:
            new = re.sub(rf"(?<![\w.-]){re.escape(field)} (?=(?:{shown})(?![\w.]))", flag + " ", problem)
        if new != problem:
            problem = new
            renamed.append((flag, field))
    for flag, field in renamed:
        fix = re.sub(rf"(?<=remove ){re.escape(field)}(?![\w-])", flag, fix)
    for flag, field in _flags_at(where):  # a fix's "use FIELD VALUE" names the flag that sets it there
        fix = re.sub(rf"(?<=use ){re.escape(field)} (?=\w)", flag + " ", fix)
    for flag, path in FLAG_PATHS:  # a field the error names by its dotted path, where a flag set it
        if len(path) == 2 and path[0] not in ("act", "weight") and getattr(args, flag, None) is not None:
            problem = re.sub(_word(".".join(path)), _option(flag), problem)
    problem, fix = _in_algorithm_flags(problem, fix, args)
    return problem + sep + fix  # without the prefix: on the command line every override is a flag


def _in_algorithm_flags(problem: str, fix: str, args: argparse.Namespace) -> tuple[str, str]:
    """An `algo_config` error in the words of the algorithm flags that made its entries:
    `gptq and awq in algo_config both pick ...; give one (remove the other entry, ...)` for
    `--gptq --awq` reads `--gptq and --awq both pick ...; give one`."""
    if "algo_config" not in problem + fix:
        return problem, fix
    flags = {name: _option(name) for name in flagged_algorithms() if getattr(args, name, False)}
    if getattr(args, "algorithm", None) is not None:
        flags.setdefault(args.algorithm, f"--algorithm {args.algorithm}")
    named = [name for name in CONTRACTS if re.search(_word(name), problem)]
    if not named or any(name not in flags for name in named):
        return problem, fix  # an entry of the file or the preset: its config words hold
    for name in named:
        problem, fix = (re.sub(_word(name), flags[name], text) for text in (problem, fix))
    fix = re.sub(r" (?:from algo_config|\(remove the other entry[^)]*\))", "", fix)
    return problem.replace(" in algo_config", ""), fix


def _word(name: str) -> str:
    """`name` as a whole word (not inside another name, a flag or a path)."""
    return rf"(?<![\w.-]){re.escape(name)}(?![\w-])"


def _target_text(expression: str | None, metric: str | None) -> str:
    """`--accuracy-target` with `--metric` folded in (`float-0.5` + top1 -> `top1>=float-0.5`)."""
    if expression is None:
        raise OnnxqError("--metric names what --accuracy-target measures; add e.g. --accuracy-target float-0.5")
    target = parse_target(expression, metric)
    if metric is not None and target.metric != metric:
        raise OnnxqError(f"--metric {metric} conflicts with the metric in --accuracy-target {expression!r}; "
                         "give the metric once")
    return target.describe() if target.metric is not None else expression  # no metric: not 'custom' either


def add_config_flags(q: argparse.ArgumentParser, stats: bool = True) -> None:
    """The flags that set the config (`quantize`, `calibrate` and `config show` share them;
    `calibrate` has its own --stats, the file it writes)."""
    q.add_argument("--preset", help=f"starting recipe ({', '.join(PRESETS)}; default U8S8, W8_GROUP128 for an "
                   "LLM decoder: an onnxruntime-genai folder or a model with past_key_values inputs)")
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
    for name in flagged_algorithms():  # each algorithm's contract gives its flag and help
        q.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=CONTRACTS[name].flag_help)
    rounding = [name + (" (no data)" if CONTRACTS[name].data == "none" else "") for name in weight_only_choices()[1:]]
    q.add_argument("--algorithm", choices=weight_only_choices(),
                   help="how int4 MatMul weights lowered to MatMulNBits are rounded: rtn (round to nearest, "
                        f"per-block clipping search; default), or {', '.join(rounding)}")
    q.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4),
                   help="MatMulNBits' accuracy_level: the type its kernel computes the activations in "
                        "(0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8)")
    q.add_argument("--reconstruct", type=enum_text, choices=("layer", "block"),
                   help="what the learned rounding fits: each layer's output (layer, the default) or each "
                        "block's, through its activations (block: BRECQ's objective, AdaRound only; slower); "
                        "switches AdaRound on where no rounding learner is")
    q.add_argument("--algo-option", action="append", metavar="[ALGO.]KEY=VALUE",
                   help="option of an algorithm or pass, e.g. num_iteration=500, adaround.reg_param=0.02 or "
                        "cle.steps=5 (repeatable; a bare KEY goes to the one algorithm or pass flag given, "
                        "else to the preset's or config file's one algorithm with that option)")
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
    q.add_argument("--format", type=enum_text, choices=("qdq", "qoperator", "qdq-ext"),
                   help="qdq: QuantizeLinear/DequantizeLinear around float ops (default); qoperator: "
                        "onnxruntime's integer kernels (QLinearConv, QLinearMatMul, QGemm, QLinearAdd, ...); "
                        "qdq-ext: QDQ plus onnxq's extended ops where stock Q/DQ cannot express an activation "
                        "(any bit width, int32, rounding modes; run with onnxq.runtime or onnxq run)")
    q.add_argument("--qdq-domain", help="ai.onnx (upgrade opset when a type needs it) or com.microsoft")
    q.add_argument("--matmul-nbits", action=argparse.BooleanOptionalAction, default=None,
                   help="weight-only int4/uint4 per-group MatMul as onnxruntime MatMulNBits; --no-matmul-nbits: "
                        "as DequantizeLinear + MatMul (the W4/W8_GROUP128 presets' default is on)")
    q.add_argument("--opset", type=int, metavar="N",
                   help="lowest ai.onnx opset of the output model, 13..23 (default: the model's, raised where a type or "
                        "op needs it)")
    q.add_argument("--activation-type",
                   help="activation dtype: uint8, int8, uint16, int16 (opset 21), float8_e4m3fn, float8_e5m2 "
                        "(opset 19), float16 or bfloat16 (float compute), float32 (not quantized)")
    q.add_argument("--weight-type",
                   help="weight dtype: int8, uint8, int4, uint4 (opset 21), int16, uint16, float8_e4m3fn, "
                        "float8_e5m2, float16, bfloat16 or float32 (not quantized)")
    q.add_argument("--edge-weight-type", metavar="DTYPE",
                   help="weight dtype of the first and last weighted layers (edge_weight; W4A8 keeps them "
                        "int8), or none: like every other layer")
    q.add_argument("--depthwise-weight-type", metavar="DTYPE",
                   help="weight dtype of the depthwise convolutions (depthwise_weight; W4A8 keeps them int8), "
                        "or none: like every other layer")
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
                   help="let the target add bias correction to Conv/Gemm, static or weight-only with data (every "
                        "CPU target does: it removes the rounded weights' mean error per channel; default on)")
    q.add_argument("--exclude", nargs="+", metavar="NAME", help="node names or regexes to keep in float")
    q.add_argument("--float-op-types", nargs="+", metavar="OP",
                   help="op types to keep in float, besides the preset's (float_op_types: Softmax and the "
                        "normalizations)")
    q.add_argument("--max-samples", type=int, help="use at most N calibration samples")
    q.add_argument("--calib-text", metavar="FILE.txt",
                   help="calibrate an LLM folder on plain text instead of --calib-data: tokenized with the folder's "
                        "tokenizer and cut into --max-samples windows (default 64) of --sequence-length tokens")
    q.add_argument("--sequence-length", type=int, metavar="N",
                   help="tokens per --calib-text window (default 256, or the model's context length if shorter)")
    q.add_argument("--batch-size", type=int, help="calibration batch size, at most (dynamic-batch models; "
                   "fewer where a sample's activations are large)")
    q.add_argument("--providers", nargs="+", help="onnxruntime execution providers for calibration")
    q.add_argument("--check-samples", type=int, metavar="N",
                   help="run the quantized model on N calibration samples against the float model "
                        "(default session) and report the output SQNR and cosine (default 8 for models up "
                        "to 256 MB; 0: no check)")
    q.add_argument("--latency", action="store_true", default=None,
                   help="time the float and the quantized model at batch 1 and 8 in default sessions on "
                        "this CPU, print the speed-up, and say why where the quantized model is not faster")
    q.add_argument("--optimize-for", type=enum_text, choices=("accuracy", "latency"),
                   help="accuracy (default): the plan as configured; latency: time the plan on this CPU and keep "
                        "in float, or quantize dynamically, what int8 does not speed up here, while the output "
                        "stays as close to float (slower to quantize; cached per model, CPU and onnxruntime)")
    q.add_argument("--accuracy-target", metavar="EXPR",
                   help="raise the most sensitive layers up --ladder until the model meets EXPR, e.g. "
                        "'top1>=float-0.5', 'cosine>=0.999', 'sqnr>=30' (scored in a default session)")
    q.add_argument("--metric", type=enum_text, choices=("top1", "cosine", "sqnr"),
                   help="what --accuracy-target measures when EXPR names no metric (e.g. float-0.5)")
    q.add_argument("--eval-data", metavar="PATH",
                   help="labelled evaluation set for --accuracy-target (.npz with a 'labels' array for "
                        "top1; default: the calibration data)")
    q.add_argument("--labels", metavar="KEY", help="the labels array in --eval-data (default: labels)")
    q.add_argument("--ladder", nargs="+", metavar="RUNG",
                   help="what the search tries, cheapest first: algorithm rungs for every layer "
                        "(bias_correction, cle, smoothquant, per_channel, adaround, adaquant), then what a "
                        "sensitive layer may be raised to (int8 for 4-bit weights, int16, fp16, bf16, float); default: "
                        + " ".join(DEFAULT_LADDER))
    q.add_argument("--rung-min-gain", type=float, metavar="X",
                   help="the least score gain that keeps an algorithm rung, in the metric's units (0: any gain), "
                        "and that makes a costlier model better where no model meets the target; "
                        "default: a gain beyond its standard error over the eval samples")
