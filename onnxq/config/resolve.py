"""Resolve the effective quantization config of one node: node > op type > global.

Field by field: a field left `None` at one level falls back to the next level, then to
`SPEC_DEFAULTS`. A tensor class with no spec at any level, or resolved to dtype
`float32`, is not quantized (its resolved spec is `None`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from onnxq.config.spec import (
    SPEC_DEFAULTS,
    TENSOR_CLASSES,
    Config,
    DType,
    QuantizationConfig,
    QuantizationSpec,
)
from onnxq.errors import ConfigError
from onnxq.numerics.qmath import FLOAT_BY_BITS

BIAS_DEFAULTS = {**SPEC_DEFAULTS, "dtype": DType.INT32, "symmetric": True}


@dataclass(frozen=True)
class ResolvedSpec:
    """A spec with every field decided; what the calibrator and emitter consume."""

    dtype: DType
    symmetric: bool
    qscheme: str
    ch_axis: int | None
    group_size: int | None
    calib_method: str
    percentile: float
    num_bins: int
    calib_options: tuple[tuple[str, object], ...]
    exponent_bits: int | None
    mantissa_bits: int | None
    scale_type: str
    round_method: str
    is_dynamic: bool
    bits: int | None = None
    # Int8 weights kept pair-safe for saturating x86 kernels: the weight's reduction axes,
    # major to minor, in the kernel's K order (`onnxq.target.pairs`). Set by the target.
    pairs: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ResolvedConfig:
    """Resolved specs of one node; `None` means that tensor class stays float."""

    input_tensors: ResolvedSpec | None
    output_tensors: ResolvedSpec | None
    weight: ResolvedSpec | None
    bias: ResolvedSpec | None
    target_device: str | None = None


def merge_specs(
    levels: list[QuantizationSpec | None], tensor_class: str = "input_tensors"
) -> ResolvedSpec | None:
    """Merge specs field by field, highest priority first; `None` if no level has one.

    Fields no level sets take the defaults of the tensor class (bias: int32 symmetric).
    """
    defaults = BIAS_DEFAULTS if tensor_class == "bias" else SPEC_DEFAULTS
    present = [s for s in levels if s is not None]
    if not present:
        return None
    values = {}
    for f in fields(QuantizationSpec):
        chosen = next((getattr(s, f.name) for s in present if getattr(s, f.name) is not None), None)
        values[f.name] = defaults[f.name] if chosen is None else chosen
    if values["exponent_bits"] is not None or values["mantissa_bits"] is not None:
        values["dtype"] = _dtype_from_bits(values["exponent_bits"], values["mantissa_bits"])
    values["bits"] = _bits_of(present, DType(values["dtype"]), DType(defaults["dtype"]))
    if DType(values["dtype"]) is DType.FLOAT32:
        return None
    values["dtype"] = DType(values["dtype"])
    for name in ("qscheme", "calib_method", "scale_type", "round_method"):
        values[name] = str(values[name])
    values["calib_options"] = tuple(sorted((values["calib_options"] or {}).items()))
    return ResolvedSpec(**values)


def _bits_of(present: list[QuantizationSpec], dtype: DType, default: DType) -> int | None:
    """The narrowed width of `dtype`: `bits` from the highest level that sets it for that
    dtype (its own, or the one it inherits). `bits` narrows the type it was given with: W4A8's
    int8 edge layers under a global `--weight-bits 3` (int4 narrowed) came out 3-bit, and
    the docs promise a global flag leaves them alone."""
    for i, spec in enumerate(present):
        if spec.bits is None:
            continue
        own = next((DType(s.dtype) for s in present[i:] if s.dtype is not None), default)
        if own is dtype:
            return spec.bits
    return None


def written_dtype(spec: QuantizationSpec) -> DType | None:
    """The type a spec names: by its exponent and mantissa bits, which win over `dtype` as
    in `merge_specs`, else by `dtype`; None for neither."""
    if spec.exponent_bits is not None or spec.mantissa_bits is not None:
        return _dtype_from_bits(spec.exponent_bits, spec.mantissa_bits)
    return DType(spec.dtype) if spec.dtype is not None else None


def _dtype_from_bits(exponent_bits: int | None, mantissa_bits: int | None) -> DType:
    """The standard float type a Brevitas-style (exponent, mantissa) description names."""
    match = FLOAT_BY_BITS.get((exponent_bits, mantissa_bits))
    if match is None:
        known = ", ".join(f"e{e}m{m} ({d})" for (e, m), d in FLOAT_BY_BITS.items())
        raise ConfigError(
            f"no standard float type has exponent_bits={exponent_bits}, mantissa_bits={mantissa_bits}; "
            f"supported: {known}"
        )
    return match


def is_excluded(config: Config, node_name: str) -> bool:
    """True if `node_name` equals an exclude entry or fully matches it as a regex."""
    return _exclusion(config, node_name) is not None


def _exclusion(config: Config, node_name: str) -> str | None:
    """The exclude entry `node_name` equals or fully matches as a regex, else None."""
    for pattern in config.exclude:
        if pattern == node_name:
            return pattern
        try:
            if re.fullmatch(pattern, node_name):
                return pattern
        except re.error:
            continue
    return None


def float_reason(config: Config, node_name: str, op_type: str) -> str:
    """Why `resolve_node_config` keeps the node float, naming the config level that does."""
    pattern = _exclusion(config, node_name)
    if pattern is not None:
        return "excluded by the config (exclude: " + (node_name if pattern == node_name else f"pattern '{pattern}'") + ")"
    return f"kept float by the config's float_op_types ({op_type})"


def resolve_node_config(config: Config, node_name: str, op_type: str) -> ResolvedConfig | None:
    """Effective config of a node, or `None` if the node is excluded or kept in float."""
    if is_excluded(config, node_name):
        return None
    node_level = config.layer_quant_config.get(node_name)
    type_level = config.layer_type_quant_config.get(op_type)
    if node_level is None and type_level is None and op_type in config.float_op_types:
        return None
    levels: list[QuantizationConfig | None] = [node_level, type_level, config.global_quant_config]
    present = [lv for lv in levels if lv is not None]
    specs = {tc: merge_specs([getattr(lv, tc) for lv in present], tc) for tc in TENSOR_CLASSES}
    return ResolvedConfig(
        **specs,
        target_device=next((lv.target_device for lv in present if lv.target_device), None),
    )
