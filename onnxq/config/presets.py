"""Named ready-made configs, as in AMD Quark (`U8S8`, `S8S8`, `A8W8`, ...).

Each preset is a plain function returning a fresh `Config`. To add one, write the
function and add a `Preset` line to `_PRESET_LIST`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnxq.config.spec import (
    CalibMethod,
    Config,
    DType,
    QScheme,
    QuantizationConfig,
    QuantizationSpec,
    ScaleType,
)
from onnxq.errors import ConfigError, closest_name


@dataclass(frozen=True)
class Preset:
    """A named config recipe; `build()` returns a new `Config` each call."""

    name: str
    description: str
    build: Callable[[], Config]


def _activation_spec(
    dtype: DType, symmetric: bool, method: CalibMethod = CalibMethod.MINMAX, **extra: object
) -> QuantizationSpec:
    return QuantizationSpec(
        dtype=dtype, symmetric=symmetric, qscheme=QScheme.PER_TENSOR, calib_method=method, **extra
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


def a16w8() -> Config:
    """int16 symmetric activations (opset 21 Q/DQ), int8 per-channel weights."""
    return _activations_over_int8_weights(DType.INT16, symmetric=True)


def u16s8() -> Config:
    return _activations_over_int8_weights(DType.UINT16, symmetric=False)


def s16s8() -> Config:
    return _activations_over_int8_weights(DType.INT16, symmetric=True)


def w8_dynamic() -> Config:
    """Dynamic: uint8 activations quantized at run time, int8 per-channel weights.

    For transformers and RNNs (MatMul, Gemm, LSTM, embedding tables). Convolutions stay
    float: onnxruntime's dynamic ConvInteger path runs slower than float Conv; quantize
    CNNs statically (U8S8) instead.
    """
    keep_float = QuantizationConfig(
        input_tensors=QuantizationSpec(dtype=DType.FLOAT32), weight=QuantizationSpec(dtype=DType.FLOAT32)
    )
    return Config(
        global_quant_config=QuantizationConfig(
            input_tensors=QuantizationSpec(dtype=DType.UINT8, symmetric=False, is_dynamic=True),
            weight=_int8_per_channel_weight(),
        ),
        layer_type_quant_config={"Conv": keep_float, "ConvTranspose": keep_float},
    )


# MatMulNBits' accuracy_level in the weight-only presets: 4, int8 activations in the
# kernel, as onnxruntime-genai's model builder writes for CPU. SmolLM2-135M genai folder,
# W4 RTN blocks of 128, 2 cores with AVX512-VNNI: decode 67.9 -> 147.8 tokens/s (float
# 26.9) for perplexity 26.01 -> 26.29 (float 17.53), `benchmarks/genai.py`.
ACCURACY_LEVEL = 4


def w4_group128() -> Config:
    """Weight-only int4 in blocks of 128 for MatMul, Gemm and embedding tables (MatMul as
    MatMulNBits); convolution weights int8 per channel, since int4 convolutions lose too
    much accuracy without rounding optimisation. Asymmetric: a block's range need not
    straddle zero evenly, and the 4-bit zero points cost 1% of the file (SmolLM2-135M:
    perplexity 25.1 -> 23.5 with round-to-nearest, 18.6 -> 18.5 with GPTQ; float 17.5)."""
    int4 = QuantizationConfig(
        weight=QuantizationSpec(dtype=DType.INT4, symmetric=False, qscheme=QScheme.PER_GROUP, group_size=128)
    )
    return Config(
        global_quant_config=QuantizationConfig(weight=_int8_per_channel_weight()),
        layer_type_quant_config={"MatMul": int4, "Gemm": int4, "Gather": int4},
        matmul_nbits=True,
        accuracy_level=ACCURACY_LEVEL,
    )


def w8_group128() -> Config:
    """Weight-only int8 in blocks of 128 for MatMul and Gemm (MatMulNBits with 8 bits):
    half the file of float16 for an LLM whose int4 loses too much, with no activation
    quantization and no calibration data (a 2-layer decoder block: 41 dB output SQNR,
    where int4 blocks of 128 give 20-25 dB). Embedding tables take blocks of 128 too
    (GatherBlockQuantized, 8 bits), so a tied embedding and LM head store one table, the LM
    head's (`plan/tied.py`; SmolLM2-135M 182.0 -> 151.1 MB, perplexity 17.77 / 28.00 ->
    17.67 / 28.08); an untied table's blocks are asymmetric, which keeps the per-row int8
    table's accuracy (all-MiniLM-L6: 25.24 against 25.23 dB) for 1.5% more file. Convolutions
    take int8 per-channel weights."""
    int8 = QuantizationConfig(
        weight=QuantizationSpec(dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_GROUP, group_size=128)
    )
    return Config(
        global_quant_config=QuantizationConfig(weight=_int8_per_channel_weight()),
        layer_type_quant_config={"MatMul": int8, "Gemm": int8, "Gather": QuantizationConfig(
            weight=QuantizationSpec(dtype=DType.INT8, symmetric=False, qscheme=QScheme.PER_GROUP, group_size=128))},
        matmul_nbits=True,
        accuracy_level=ACCURACY_LEVEL,
    )


def w4a8() -> Config:
    """int4 per-channel weights whose rounding AdaRound learns, uint8 activations, int32
    bias: 4-bit convolution/matrix weights (files about 7x smaller than float) for
    hardware with int4 arithmetic. Asymmetric weights: a batch-norm-folded channel is
    rarely centred on 0, and a zero point per channel spends all 16 codes on its range
    (with AdaRound, logit SQNR +1.1 dB on MobileNet-v1, +1.6 dB on ResNet-20 over
    symmetric int4). The first and the last weighted layer keep int8 weights
    (`edge_weight`), the protocol of AdaRound's and BRECQ's int4 results: MobileNet-v1
    logit SQNR 11.65 -> 12.06 dB for a file 1.26x larger. The depthwise convolutions keep
    int8 weights too (`depthwise_weight`): 9 weights a channel fit 4-bit codes poorly, and
    they are 1.3% of MobileNet-v1's weights (top-1 82.75 -> 83.75, logit SQNR 11.99 ->
    12.68 dB, for a file 1% larger: 1.88 -> 1.90 MB). onnxruntime's CPU has no int4 convolution kernel:
    there the weights are dequantized at run time, slower than float."""
    return Config(
        global_quant_config=QuantizationConfig(
            input_tensors=_activation_spec(DType.UINT8, symmetric=False),
            output_tensors=_activation_spec(DType.UINT8, symmetric=False),
            weight=QuantizationSpec(dtype=DType.INT4, symmetric=False, qscheme=QScheme.PER_CHANNEL,
                                    calib_method=CalibMethod.MINMAX),
            bias=_int32_bias(),
        ),
        edge_weight=QuantizationSpec(dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_CHANNEL),
        depthwise_weight=QuantizationSpec(dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_CHANNEL),
        algo_config=[{"name": "adaround"}],
    )


def _float_target(dtype: DType) -> Config:
    spec = QuantizationSpec(dtype=dtype)
    return Config(
        global_quant_config=QuantizationConfig(input_tensors=spec, output_tensors=spec, weight=spec)
    )


def fp16() -> Config:
    return _float_target(DType.FLOAT16)


def bf16() -> Config:
    return _float_target(DType.BFLOAT16)


def fp8_e4m3() -> Config:
    """float8 e4m3fn activations and weights through QuantizeLinear/DequantizeLinear (opset 19).

    MobileNet-v1 0.75 (logit SQNR, top-1 of 800 images, float 85.5), each step on the last:
    nearest rounding 4.8 dB (60.5); bias correction of the weights' per-channel mean error
    6.5 dB (70.9); activations centred per channel at emission (`emit/float8_center.py`)
    13.1 dB (84.0); AdaRound on the float8 grid, each layer fitted to the quantized
    model's own inputs (bias correction after it, for layers it leaves) 14.6 dB; the first
    and last weighted layers reading their inputs in float (`edge_input`: a model input
    from 8-bit pixels loses its low bits in a 3-bit mantissa) 15.6 dB (85.1). ResNet-20:
    17.7 -> 24.9 dB."""
    act = _activation_spec(DType.FLOAT8_E4M3FN, symmetric=True)
    weight = QuantizationSpec(dtype=DType.FLOAT8_E4M3FN, symmetric=True, qscheme=QScheme.PER_CHANNEL)
    return Config(global_quant_config=QuantizationConfig(act, act, weight),
                  edge_input=QuantizationSpec(dtype=DType.FLOAT32),
                  algo_config=[{"name": "adaround", "op_types": ["Conv", "Gemm"]}, {"name": "bias_correction"}])


def xint8() -> Config:
    """Integer-only NPUs: int8 symmetric, power-of-two scales, MinMSE activations,
    per-tensor weights made viable by cross-layer equalization and bias correction."""
    act = _activation_spec(DType.INT8, True, CalibMethod.MINMSE, scale_type=ScaleType.POWER_OF_TWO)
    weight = QuantizationSpec(
        dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_TENSOR,
        calib_method=CalibMethod.MINMAX, scale_type=ScaleType.POWER_OF_TWO,
    )
    bias = QuantizationSpec(dtype=DType.INT32, symmetric=True, scale_type=ScaleType.POWER_OF_TWO)
    return Config(
        global_quant_config=QuantizationConfig(act, act, weight, bias),
        pre_quant_opt_config=[{"name": "cle"}],
        algo_config=[{"name": "bias_correction"}],
    )


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
    Preset("A16W8", "int16 symmetric activations, int8 per-channel weights (opset 21)", a16w8),
    Preset("U16S8", "uint16 asymmetric activations, int8 per-channel weights (opset 21)", u16s8),
    Preset("S16S8", "int16 symmetric activations, int8 per-channel weights (opset 21)", s16s8),
    Preset(
        "W8_DYNAMIC",
        "dynamic: activations quantized at run time (uint8), int8 per-channel weights, for "
        "transformers and RNNs (convolutions stay float); no calibration data",
        w8_dynamic,
    ),
    Preset(
        "W4_GROUP128",
        "weight-only int4 in blocks of 128 for MatMul/Gemm/embeddings (MatMulNBits, int8 compute), int8 "
        "convolutions; no calibration data",
        w4_group128,
    ),
    Preset(
        "W8_GROUP128",
        "weight-only int8 in blocks of 128 for MatMul/Gemm (MatMulNBits, 8 bits) and embeddings (one table "
        "where tied), int8 convolutions; for LLMs where int4 loses too much; no calibration data",
        w8_group128,
    ),
    Preset(
        "W4A8",
        "int4 asymmetric per-channel weights rounded by AdaRound (first and last layer and depthwise "
        "convolutions int8), uint8 "
        "activations, int32 bias; for int4 hardware (onnxruntime's CPU runs int4 convolutions slower "
        "than float)",
        w4a8,
    ),
    Preset("FP16", "float16 weights and compute; sensitive ops stay float32", fp16),
    Preset("BF16", "bfloat16 weights and compute; sensitive ops stay float32", bf16),
    Preset("FP8_E4M3", "float8 e4m3fn activations and per-channel weights, AdaRound (Conv/Gemm) and bias "
           "correction, first/last weighted layers' inputs float (opset 19)", fp8_e4m3),
    Preset(
        "XINT8",
        "int8 symmetric, power-of-two scales, per-tensor weights with CLE and bias "
        "correction, MinMSE activations; integer-only NPUs",
        xint8,
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
