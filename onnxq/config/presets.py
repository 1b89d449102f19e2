"""Named ready-made configs, as in AMD Quark (`U8S8`, `S8S8`, `A8W8`, ...).

Each preset is a plain function returning a fresh `Config`. To add one, write the
function and add a `Preset` line to `_PRESET_LIST`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnxq.config.io import closest_name
from onnxq.config.spec import (
    CalibMethod,
    Config,
    DType,
    QScheme,
    QuantizationConfig,
    QuantizationSpec,
)
from onnxq.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """A named config recipe; `build()` returns a new `Config` each call."""

    name: str
    description: str
    build: Callable[[], Config]


def _activation_spec(dtype: DType, symmetric: bool) -> QuantizationSpec:
    return QuantizationSpec(
        dtype=dtype,
        symmetric=symmetric,
        qscheme=QScheme.PER_TENSOR,
        calib_method=CalibMethod.MINMAX,
    )


def _int8_per_channel_weight() -> QuantizationSpec:
    """Symmetric int8 per output channel; the axis is inferred from the op type."""
    return QuantizationSpec(
        dtype=DType.INT8,
        symmetric=True,
        qscheme=QScheme.PER_CHANNEL,
        calib_method=CalibMethod.MINMAX,
    )


def _int32_bias() -> QuantizationSpec:
    return QuantizationSpec(dtype=DType.INT32, symmetric=True)


def _activations_over_int8_weights(dtype: DType, symmetric: bool) -> Config:
    """Per-tensor activations of `dtype`, int8 per-channel weights, int32 bias."""
    return Config(
        global_quant_config=QuantizationConfig(
            input_tensors=_activation_spec(dtype, symmetric),
            output_tensors=_activation_spec(dtype, symmetric),
            weight=_int8_per_channel_weight(),
            bias=_int32_bias(),
        )
    )


def u8s8() -> Config:
    """uint8 asymmetric activations, int8 symmetric per-channel weights, int32 bias."""
    return _activations_over_int8_weights(DType.UINT8, symmetric=False)


def s8s8() -> Config:
    """int8 symmetric activations, int8 symmetric per-channel weights, int32 bias."""
    return _activations_over_int8_weights(DType.INT8, symmetric=True)


def a8w8() -> Config:
    """Quark's A8W8: the same numerics as S8S8."""
    return _activations_over_int8_weights(DType.INT8, symmetric=True)


_PRESET_LIST: tuple[Preset, ...] = (
    Preset(
        "U8S8",
        "uint8 asymmetric activations, int8 symmetric per-channel weights, int32 bias; "
        "the CPU default",
        u8s8,
    ),
    Preset(
        "S8S8",
        "int8 symmetric activations, int8 symmetric per-channel weights, int32 bias",
        s8s8,
    ),
    Preset(
        "A8W8",
        "int8 symmetric activations and per-channel weights, int32 bias; for accelerators "
        "with symmetric int8 (same numerics as S8S8, Quark's name)",
        a8w8,
    ),
)

PRESETS: dict[str, Preset] = {preset.name: preset for preset in _PRESET_LIST}


def get_preset(name: str) -> Config:
    """A fresh `Config` for the preset `name` (case-insensitive)."""
    by_upper = {key.upper(): preset for key, preset in PRESETS.items()}
    preset = by_upper.get(name.upper())
    if preset is None:
        hint = closest_name(name, list(PRESETS))
        did_you_mean = f"did you mean '{hint}'? " if hint else ""
        raise ConfigError(f"unknown preset {name!r}; {did_you_mean}available: {', '.join(PRESETS)}")
    return preset.build()
