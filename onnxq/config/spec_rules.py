"""The rules one quantization spec must meet (`SPEC_RULES`), checked by `check_spec` on a
spec's values as plain data, at its own level (`None`: inherited, not judged) or resolved.

Each rule reads the fields it judges and returns None or (problem, fix); the error is
"{problem} in {where}; {fix}".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onnxq.calibrate.observers import OBSERVERS  # an open registry: read when a rule runs
from onnxq.calibrate.observers.options import parse_options
from onnxq.calibrate.observers.percentile import PERCENTILE_FIX, PERCENTILE_RANGE
from onnxq.config.spec import SPEC_DEFAULTS
from onnxq.errors import ConfigError, closest_name
from onnxq.numerics.hqq import HqqOptions
from onnxq.numerics.qmath import BLOCK_DTYPES

ACTIVATIONS = ("input_tensors", "output_tensors")
INTEGER_DTYPES = {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "int32": 32, "uint32": 32}
# Rules read this key of a spec's values: True when the config's format is qdq-ext, whose
# extended ops lift the limits of stock QuantizeLinear/DequantizeLinear for activations.
EXTENDED = "_extended"

# Rules read this key of a spec's values as written at its level: the calibration methods
# it may inherit where it names none (the levels below it; a node's op type is known only
# with the model), so a field no such method reads is refused at the level that sets it.
INHERITED = "_inherited_methods"

# A rule gets (spec values as plain data, tensor class, resolved?) and returns None or
# (problem, fix). When `resolved` is False a `None` value means "inherited": not judged.
Rule = Callable[[dict[str, Any], str, bool], tuple[str, str] | None]


def check_spec(
    values: dict[str, Any], tensor_class: str, path: str, resolved: bool = False
) -> None:
    """Raise `ConfigError` for the first rule that one spec's `values` break."""
    for rule in SPEC_RULES:
        found = rule(values, tensor_class, resolved)
        if found is not None:
            problem, fix = found
            raise ConfigError(f"{problem} in {path}; {fix}")


def _group_size_positive(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if v["group_size"] is not None and v["group_size"] <= 0:
        return f"invalid group_size {v['group_size']}", "use a positive integer such as 128"
    return None


def _group_size_needs_per_group(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if v["group_size"] is not None and v["qscheme"] in ("per_tensor", "per_channel"):
        return (
            f"group_size {v['group_size']} with qscheme {v['qscheme']}",
            "group_size only applies to per_group: set qscheme: per_group or remove group_size",
        )
    return None


def _per_group_needs_group_size(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if resolved and v["qscheme"] == "per_group" and v["group_size"] is None:
        return "qscheme per_group without group_size", "set group_size, e.g. 128"
    return None


def _activations_per_tensor(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """Activations are calibrated and quantized per tensor (the block formats, per block by
    their own rule); a per-channel or per-group activation spec would be ignored."""
    if tc not in ACTIVATIONS or v["qscheme"] not in ("per_channel", "per_group") \
            or v["dtype"] in {d.value for d in BLOCK_DTYPES}:
        return None
    return (f"qscheme {v['qscheme']} for {tc}",
            "activations are calibrated per tensor (one scale each, as onnxruntime's integer kernels take "
            "them): remove qscheme or set per_tensor; per-channel scales are for weights")


def _bias_per_tensor_or_channel(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc == "bias" and v["qscheme"] == "per_group":
        return "bias qscheme per_group", "a bias takes its input's and weight's scales: per_tensor or per_channel"
    return None


def _activation_rounds_half_even(
    v: dict[str, Any], tc: str, resolved: bool
) -> tuple[str, str] | None:
    if tc in ACTIVATIONS and v["round_method"] not in (None, "half_even") and not v[EXTENDED]:
        return (
            f"round_method {v['round_method']}",
            "QuantizeLinear rounds activations half to even at run time: "
            "use round_method: half_even, or quant_format: qdq-ext (extended ops)",
        )
    return None


def _int32_only_for_bias(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc != "bias" and v["dtype"] in ("int32", "uint32") and not (v[EXTENDED] and tc in ACTIVATIONS):
        extended = ", or quant_format: qdq-ext (onnxq's extended ops)" if tc in ACTIVATIONS else ""
        return f"dtype {v['dtype']}", (
            "32-bit integers are only for bias (activations and weights have no stock onnxruntime "
            f"kernel): use int8/uint8 or int16/uint16{extended}"
        )
    return None


def _no_4bit_activations(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """4-bit activations: no onnxruntime kernel computes on them (its integer Conv, MatMul
    and Gemm take 8- or 16-bit inputs), so every Conv stayed float and the model came out
    larger than float, exit 0 (new-user trial)."""
    if tc in ACTIVATIONS and v["dtype"] in ("int4", "uint4"):
        return f"dtype {v['dtype']}", ("4-bit integers are a weight type (onnxruntime's integer kernels take 8- or "
                                       "16-bit activations): use int8/uint8 or int16/uint16 activations, with int4 "
                                       "weights (the W4A8 preset)")
    return None


def _bias_dtype(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc == "bias" and v["dtype"] not in (None, "int32", "float32"):
        return (
            f"bias dtype {v['dtype']}",
            "set dtype: int32 (or float32 to keep bias in float)",
        )
    return None


def _percentile_range(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    p = v["percentile"]
    if p is not None and not PERCENTILE_RANGE[0] <= p <= PERCENTILE_RANGE[1]:
        return f"invalid percentile {p}", PERCENTILE_FIX
    return None


def _num_bins_min(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if v["num_bins"] is not None and v["num_bins"] < 2:
        return f"invalid num_bins {v['num_bins']}", "use 2 or more, e.g. 2048"
    return None


def _weight_static(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if tc == "weight" and v["is_dynamic"] is True:
        return "is_dynamic true", "weights are always quantized statically: remove is_dynamic"
    return None


def _dynamic_activations(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """Dynamic activations are uint8 with their range from each input at run time
    (onnxruntime's DynamicQuantizeLinear): another type (as resolved) or a calibration
    setting given beside is_dynamic at the same level would be ignored without a word
    (`--dynamic --activation-type int16` gave uint8). A calibration method inherited from
    a static level stays allowed: the static layers use it."""
    if tc not in ACTIVATIONS or v["is_dynamic"] is not True:
        return None
    if resolved and v["dtype"] not in (None, "uint8"):
        return (f"dtype {v['dtype']} with dynamic activations",
                "onnxruntime quantizes them to uint8 at run time: use dtype uint8 (a U8 preset), or static "
                f"activations for {v['dtype']} (remove --dynamic / is_dynamic)")
    if resolved:
        return None
    ignored = [f"{key} {v[key]}" for key in ("percentile", "num_bins") if v[key] not in (None, SPEC_DEFAULTS[key])]
    if v["calib_method"] not in (None, "minmax"):
        ignored.insert(0, f"calib_method {v['calib_method']}")
    if ignored:
        return (f"{', '.join(ignored)} with dynamic activations",
                "their range comes from each input at run time, not from calibration: remove it, or remove "
                "--dynamic / is_dynamic")
    return None


def _bits_range(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    bits = v["bits"]
    if bits is None:
        return None
    if tc != "weight" and not (v[EXTENDED] and tc in ACTIVATIONS):
        return f"bits {bits}", ("bits narrows weights only (activations too with quant_format: qdq-ext): "
                                "remove it from activations and bias")
    top = 8 if tc == "weight" else 32
    if not 2 <= bits <= top:
        return f"invalid bits {bits}", f"use a bit width from 2 to {top}"
    if resolved and v["dtype"] not in INTEGER_DTYPES:
        integer = "int8" if bits <= 8 else "int16"
        return f"bits {bits} with dtype {v['dtype']}", f"bits narrows integer dtypes only: use dtype {integer}, or remove bits"
    if resolved and bits > INTEGER_DTYPES[v["dtype"]]:
        wider = "int8/uint8" if bits <= 8 else "int16/uint16 or int32/uint32"
        return (f"bits {bits} with dtype {v['dtype']}",
                f"bits must not exceed the dtype's width: use dtype {wider} for {bits} bits")
    return None


WEIGHT_METHODS = ("minmax", "hqq")


def _weight_method(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """Weights are quantized offline: min-max (with the 4-bit clipping search), or HQQ's
    optimised zero points for asymmetric per-group weights."""
    method = v["calib_method"]
    if tc != "weight" or method is None:
        return None
    if method not in WEIGHT_METHODS:
        return (f"weight calib_method {method!r}",
                f"weights are quantized with {' or '.join(WEIGHT_METHODS)} (calibration methods are for activations)")
    if method == "hqq" and resolved and (v["symmetric"] or v["qscheme"] != "per_group"):
        return ("weight calib_method hqq with " + ("symmetric weights" if v["symmetric"] else f"qscheme {v['qscheme']}"),
                "hqq optimises each block's zero point: set symmetric: false and qscheme: per_group")
    return None


def _calib_method_registered(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    method = v["calib_method"]
    if method is None or tc == "weight":
        return None
    if method in OBSERVERS:
        return None
    hint = closest_name(str(method), sorted(OBSERVERS), cutoff=0.8)
    did_you_mean = f"did you mean '{hint}'? " if hint else ""
    return (f"invalid calib_method {method!r}",
            f"{did_you_mean}valid values: {', '.join(sorted(OBSERVERS))} "
            "(or register your own with onnxq.calibrate.observers.register_observer; on the command line, "
            "load its file with --plugin FILE.py)")


def _method_reads_its_fields(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """percentile or num_bins set at a level whose method, its own or every one it may
    inherit, ignores it (judged where it is written: a preset's value under a user's
    method is the preset's business, and `config.compose` drops it)."""
    own = v["calib_method"]
    if resolved:
        return None
    methods = [m for m in ((own,) if own is not None else v.get(INHERITED, ())) if m in OBSERVERS]
    for key in ("percentile", "num_bins"):
        if v[key] is not None and methods and not any(key in OBSERVERS[m].spec_fields for m in methods):
            users = sorted(name for name, cls in OBSERVERS.items() if key in cls.spec_fields)
            inherited = "" if own is not None else " (inherited: the level sets none)"
            there = "" if own is not None else " there"
            return (f"{key} {v[key]} with calib_method {methods[0]}{inherited}, which does not use it",
                    f"use calib_method {' or '.join(users)}{there}, or remove {key}")
    return None


def _calib_options_known(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    """calib_options name options of the resolved method, with valid values (checked here,
    not first at calibration: `config show`/`convert` and `load_config` accept nothing that
    `quantize` would refuse)."""
    method, options = v["calib_method"], v["calib_options"]
    if not resolved or method is None or not options:
        return None
    if tc == "weight":
        if method != "hqq":
            return None
        cls = HqqOptions
    elif method in OBSERVERS:
        cls = OBSERVERS[method].options_class
    else:
        return None
    try:
        parse_options(cls, method, options)
    except ConfigError as exc:
        problem, _, fix = str(exc).partition("; ")
        return problem, fix or "check the calib_options of this method"
    return None


def _block_formats_where_they_run(v: dict[str, Any], tc: str, resolved: bool) -> tuple[str, str] | None:
    if v["dtype"] not in {d.value for d in BLOCK_DTYPES}:
        return None
    if not v[EXTENDED]:
        return f"dtype {v['dtype']}", "block formats run through onnxq's extended ops: set quant_format: qdq-ext"
    if tc not in ("input_tensors", "weight"):
        return (f"dtype {v['dtype']} for {tc}",
                "block formats quantize the inputs and weights of Conv/Gemm/MatMul: use them there")
    return None


# Spec fields that shape an integer quantization grid: a tensor cast to a float type has none
# (the accuracy search's float rungs clear them with `bits`, `search/ladder.py`).
GRID_FIELDS = ("qscheme", "scale_type", "ch_axis", "group_size", "round_method")


SPEC_RULES: tuple[Rule, ...] = (
    _block_formats_where_they_run,
    _weight_method,
    _calib_method_registered,
    _method_reads_its_fields,
    _calib_options_known,
    _int32_only_for_bias,
    _no_4bit_activations,
    _bias_dtype,
    _group_size_positive,
    _group_size_needs_per_group,
    _per_group_needs_group_size,
    _activations_per_tensor,
    _bias_per_tensor_or_channel,
    _activation_rounds_half_even,
    _percentile_range,
    _num_bins_min,
    _weight_static,
    _dynamic_activations,
    _bits_range,
)
