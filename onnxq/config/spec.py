"""Configuration dataclasses, in the shape AMD Quark users know.

A `Config` holds a global `QuantizationConfig`, per-op-type and per-node overrides and
an exclude list. Every field of a `QuantizationSpec` may be left `None`, meaning
"inherit from the next level" (node > op type > global > built-in default); see
`onnxq.config.resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from onnxq.errors import named_fields_only


def enum_text(value: str) -> str:
    """An enum-like value (a format, a type, a method, a target) as onnxq names it: any
    case, blanks around it ignored (`QDQ`, `Accuracy`). The one rule every source reads
    such values by: config files, Python and the command line's flags."""
    return value.strip().lower()


class _StrEnum(str, Enum):
    """An enum of strings that prints as its value (what config files hold)."""

    def __str__(self) -> str:
        return self.value


class DType(_StrEnum):
    """Target data type of a tensor. `float32` means: leave in float.

    Integer types are quantized with a scale and zero point; `float16`/`bfloat16` convert
    the tensor (and the op computing it) to that float type; the float8 types quantize
    through QuantizeLinear/DequantizeLinear with a scale and a float8 zero point. The
    block formats (OCP Microscaling MX*, BFP16: one shared power-of-two exponent per block,
    no calibration) need the qdq-ext format (`onnxq.numerics.extended`).
    """

    INT4 = "int4"
    UINT4 = "uint4"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    UINT16 = "uint16"
    INT32 = "int32"
    UINT32 = "uint32"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    MXINT8 = "mxint8"
    MXFP8_E4M3 = "mxfp8_e4m3"
    MXFP8_E5M2 = "mxfp8_e5m2"
    MXFP6_E3M2 = "mxfp6_e3m2"
    MXFP6_E2M3 = "mxfp6_e2m3"
    MXFP4_E2M1 = "mxfp4_e2m1"
    BFP16 = "bfp16"

    @classmethod
    def _missing_(cls, value: object) -> DType | None:
        """The short names other tools use (`fp16`, `bf16`, `fp32`, `e4m3`): `DType("fp16")`
        is FLOAT16. Bare `fp8` is not one: which of the two formats is the user's choice."""
        name = DTYPE_ALIASES.get(enum_text(value)) if isinstance(value, str) else None
        return cls(name) if name is not None else None


# The array of an evaluation .npz that holds its labels, unless `labels` names another.
DEFAULT_LABELS = "labels"

# Other tools' names of the float types (PyTorch, Quark, TensorRT), as `DType` takes them.
DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
                 "fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                 "float8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2"}
# Names of more than one type: the error lists the candidates.
DTYPE_AMBIGUOUS = {"fp8": "float8_e4m3fn' or 'float8_e5m2", "float8": "float8_e4m3fn' or 'float8_e5m2",
                   "int": "int8' or 'int16"}


class QScheme(_StrEnum):
    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    PER_GROUP = "per_group"


class CalibMethod(_StrEnum):
    """The built-in observers (`onnxq.calibrate.observers`). `calib_method` also takes the
    name of any observer registered with `register_observer`, built in or not."""

    MINMAX = "minmax"
    PERCENTILE = "percentile"
    MINMSE = "minmse"
    ENTROPY = "entropy"
    NONOVERFLOW = "nonoverflow"
    IFMR = "ifmr"
    HFMG = "hfmg"


class ScaleType(_StrEnum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    POWER_OF_TWO = "power_of_two"


class RoundMethod(_StrEnum):
    """How offline-quantized tensors (weights, bias) are rounded.

    QuantizeLinear in onnxruntime always rounds half to even, so activations only
    accept `half_even`, except in the qdq-ext format (onnxq's extended op rounds any way).
    `half_up` rounds ties away from zero.
    """

    HALF_EVEN = "half_even"
    HALF_UP = "half_up"
    FLOOR = "floor"
    CEIL = "ceil"


class OptimizeFor(_StrEnum):
    """What a run optimises after accuracy.

    `accuracy`: the plan as configured, no timing (fast and byte-reproducible anywhere).
    `latency`: the plan is then measured on this CPU (or the GPU provider listed first) and changed where that makes the
    deployed model faster without losing accuracy (`onnxq.search.latency`).
    """

    ACCURACY = "accuracy"
    LATENCY = "latency"


class Target(_StrEnum):
    """Where the quantized model will run; decides what its int8 kernels can hold.

    `auto` probes the onnxruntime at hand (see `onnxq.target`); `generic` means any CPU, so
    it avoids what any supported CPU's kernels would saturate.
    """

    AUTO = "auto"
    X86_VNNI = "x86-vnni"
    X86_AVX2 = "x86-avx2"
    ARM64 = "arm64"
    GPU = "gpu"
    GENERIC = "generic"


class QuantFormat(_StrEnum):
    """How quantized ops are written: QuantizeLinear/DequantizeLinear around float ops
    (`qdq`), onnxruntime's integer kernels (`qoperator`: QLinearConv, QGemm, ...), or QDQ
    with onnxq's extended ops where stock Q/DQ cannot express a tensor's quantization
    (`qdq-ext`: activations of any bit width up to 32 and any rounding mode; run with
    `onnxq.runtime`)."""

    QDQ = "qdq"
    QOPERATOR = "qoperator"
    QDQ_EXT = "qdq-ext"


@named_fields_only
@dataclass
class QuantizationSpec:
    """How one class of tensor (input, output, weight or bias) is quantized.

    `None` in any field means "inherit from the next level of configuration".
    """

    dtype: DType | None = None
    symmetric: bool | None = None
    qscheme: QScheme | None = None
    ch_axis: int | None = None
    group_size: int | None = None
    calib_method: CalibMethod | str | None = None  # a built-in or registered observer
    percentile: float | None = None
    num_bins: int | None = None
    # Method-specific options, checked by the observer's own options dataclass.
    calib_options: dict[str, Any] | None = None
    # Brevitas-style float description; maps onto a standard float dtype (see qmath).
    exponent_bits: int | None = None
    mantissa_bits: int | None = None
    scale_type: ScaleType | None = None
    round_method: RoundMethod | None = None
    is_dynamic: bool | None = None
    # Weight bit width below the dtype's (2..8 in an int8 container): AMCT's 6/7-bit
    # weights, or onnxruntime's reduce_range (7 bits).
    bits: int | None = None


@named_fields_only
@dataclass
class QuantizationConfig:
    """Specs for the four tensor classes of a node. A `None` spec inherits."""

    input_tensors: QuantizationSpec | None = None
    output_tensors: QuantizationSpec | None = None
    weight: QuantizationSpec | None = None
    bias: QuantizationSpec | None = None
    target_device: str | None = None


@named_fields_only
@dataclass
class CalibrationConfig:
    """How calibration data is fed: sample cap, batch size, onnxruntime providers."""

    max_samples: int | None = None
    # Samples per calibration run, at most: fewer where a sample's largest activation is big
    # (`calibrate.runner.calibration_batch`).
    batch_size: int = 8
    # At most this many batches (AMCT's batch_num); with max_samples, whichever ends first.
    max_batches: int | None = None
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    # Bound on the exposed activations held per batch (MiB); above it, tensors are
    # calibrated in groups over several passes of the data.
    max_memory_mb: int | None = None
    # Write calibrated ranges to this JSON file / take ranges from it and skip calibration.
    save_ranges: str | None = None
    load_ranges: str | None = None
    # Merge these statistics files (`onnxq calibrate --shard i/n --stats FILE`) instead of
    # calibrating: the result is byte-identical to calibrating on all the data here.
    stats: list[str] | None = None
    # The quantized model is run on this many calibration samples against the float model
    # (default session): SQNR and cosine in the summary, a warning when far off; 0: no check;
    # None: 8 for models up to 256 MB of weights (the check opens the float model once more).
    check_samples: int | None = None
    # Time the float and the quantized model in default sessions at batch 1 and 8 on this
    # CPU and print the speed-up; where the quantized model is not faster, say why from
    # onnxruntime's per-op profile (`emit/latency.py`). Off by default: it costs seconds.
    measure_latency: bool = False
    # A plain text file calibrating an LLM decoder instead of calibration data: tokenized with
    # the model folder's tokenizer and cut into max_samples windows (default 64) of
    # sequence_length tokens (default 256, or the model's context length if shorter), used
    # as an .npz of input_ids windows is (`calibrate/text.py`).
    text: str | None = None
    sequence_length: int | None = None


# Rungs of the mixed-precision ladder (`onnxq.search`). Precision rungs: what a sensitive
# layer is raised to. Algorithm rungs (`search/rungs.py`): recipe changes for every layer,
# tried first since they cost the deployed model nothing.
PRECISION_RUNGS = ("int8", "int16", "fp16", "bf16", "float")
ALGORITHM_RUNGS = ("bias_correction", "cle", "smoothquant", "per_channel", "adaround", "adaquant")
LADDER_RUNGS = ALGORITHM_RUNGS + PRECISION_RUNGS
# Cheapest first: what the deployed model pays (nothing for the algorithm rungs; 4 more bits
# of a layer's weights for int8, which only recipes with 4-bit weights try), then what
# quantizing pays (AdaRound re-quantizes layer by layer: seconds to minutes).
DEFAULT_LADDER = ("bias_correction", "cle", "smoothquant", "per_channel", "int8", "int16", "float")


@named_fields_only
@dataclass
class MixedPrecisionConfig:
    """Raise the most sensitive layers up `ladder` until the model meets `target`.

    target: `METRIC>=VALUE` (or `<=`); METRIC top1 (needs labels), cosine or sqnr (against
      the float model's first output), or `custom` with `quantize(..., evaluate=fn)`;
      VALUE a number or `float-X` / `float+X` (relative to the float model's score).
    ladder: the rungs tried, cheapest first: algorithm rungs (bias_correction, cle,
      smoothquant, per_channel, adaround, adaquant: the whole recipe changes, kept where the
      score improves), then precision rungs (int8 weights where they are 4-bit, int16
      activations, fp16, bf16, float: the most sensitive layers raised).
    eval_data: the labelled evaluation set (.npz, .npy or a folder; default: the
      calibration data); labels: its array of class labels (top1).
    rung_min_gain: the least gain (in the metric's units) that keeps an algorithm rung, and
      that makes a costlier model better where none meets the target (`search/unmet.py`);
      None: a gain beyond its standard error over the eval samples (`search/gain.py`).
    """

    target: str | None = None
    ladder: list[str] = field(default_factory=lambda: list(DEFAULT_LADDER))
    eval_data: str | None = None
    labels: str = DEFAULT_LABELS
    max_samples: int | None = None
    rung_min_gain: float | None = None


# Config key -> the tensor class of QuantizationConfig it sets for the first and last
# weighted layers (`plan/edges.py`).
EDGE_FIELDS = {"edge_weight": "weight", "edge_input": "input_tensors"}
# The config keys that give a class of layers its own spec (`plan/edges.py`) -> the tensor
# class it sets; each also written as a bare dtype or `none` (`config.io.bare_layer_class_dtypes`,
# the --KEY-type flags).
LAYER_CLASS_FIELDS = {**EDGE_FIELDS, "depthwise_weight": "weight"}


@named_fields_only
@dataclass
class Config:
    """The whole recipe: what to quantize, how, and which passes run first."""

    global_quant_config: QuantizationConfig = field(default_factory=QuantizationConfig)
    layer_type_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    layer_quant_config: dict[str, QuantizationConfig] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    quant_format: QuantFormat = QuantFormat.QDQ
    # Deployment target (`onnxq.target`): `auto` probes this machine's onnxruntime kernels.
    target: Target = Target.AUTO
    # 7-bit weights for every int8-activation op (onnxruntime's reduce_range): true; false:
    # full 8-bit weights even where kernels saturate; None: the target decides (pair-safe
    # 8-bit scales where its int8 kernels saturate, onnxq.target.pairs).
    reduce_range: bool | None = None
    # Weight spec of the first and the last weighted layer (Conv/ConvTranspose/Gemm/MatMul
    # with a constant weight, in graph order), between node-level and op-type overrides;
    # None: as every other layer. Low-bit recipes keep them at 8 bits, as AdaRound's and
    # BRECQ's int4 results do: the first sees the raw input through few channels, the
    # last writes the outputs (`plan/edges.py`).
    edge_weight: QuantizationSpec | None = None
    # Input-activation spec of the same two layers (dtype float32: they read their inputs
    # unquantized). Float8 recipes keep them float: a model input from 8-bit data (image
    # pixels) loses its low bits in float8's 3-bit mantissa, and every later layer
    # inherits that loss (MobileNet-v1 FP8_E4M3 logit SQNR +0.9 dB, ResNet-20 +5.8 dB).
    edge_input: QuantizationSpec | None = None
    # Weight spec of the depthwise convolutions (a Conv whose every group reads one input
    # channel), beneath the edge layers' and node-level specs; None: as every other layer.
    # W4A8 keeps them at 8 bits: 9 weights a channel leave 4-bit codes little to fit, and
    # they hold 1.3% of MobileNet-v1's weights (W4A8 top-1 82.75 -> 83.75, a file 1% larger).
    depthwise_weight: QuantizationSpec | None = None
    # Let the target add its default algorithms (bias correction of Conv/Gemm in static
    # plans: the rounded weights' mean error per channel, larger where it narrows weights).
    target_algorithms: bool = True
    # Absorb Relu/Clip that follow a quantized op into the op's output quantization.
    fuse_activations: bool = True
    # Where Q/DQ of types newer than the model's opset go: "ai.onnx" upgrades the opset
    # (int16/int4 and blocks need 21, float8 19); "com.microsoft" keeps the opset and uses
    # onnxruntime's contrib QuantizeLinear/DequantizeLinear.
    qdq_domain: str = "ai.onnx"
    # Weight-only int4/uint4 per-group MatMul as onnxruntime's MatMulNBits kernel.
    matmul_nbits: bool = False
    # MatMulNBits' accuracy_level: the type its kernel computes activations in (0 unset,
    # 1 fp32, 2 fp16, 3 bf16, 4 int8).
    accuracy_level: int = 0
    # Op types kept in float unless a layer or op-type override says otherwise.
    float_op_types: list[str] = field(
        default_factory=lambda: [
            "Softmax",
            "LayerNormalization",
            "BatchNormalization",
            "InstanceNormalization",
            "GroupNormalization",
        ]
    )
    pre_quant_opt_config: list[dict[str, Any]] = field(default_factory=list)
    algo_config: list[dict[str, Any]] = field(default_factory=list)
    # What the run optimises after accuracy: `latency` measures the plan on this CPU (or GPU provider) and
    # keeps in float, or quantizes dynamically, what int8 does not speed up here.
    optimize_for: OptimizeFor = OptimizeFor.ACCURACY
    # Search which layers to raise in precision until an accuracy target is met.
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    # Lowest ai.onnx opset of the output (default: the lowest the configured types need).
    opset: int | None = None


# Values a fully resolved spec takes where no level of the config set a field.
SPEC_DEFAULTS: dict[str, Any] = {
    "dtype": DType.INT8,
    "symmetric": True,
    "qscheme": QScheme.PER_TENSOR,
    "ch_axis": None,
    "group_size": None,
    "calib_method": CalibMethod.MINMAX,
    "percentile": 99.999,
    "num_bins": 2048,
    "calib_options": None,
    "exponent_bits": None,
    "mantissa_bits": None,
    "scale_type": ScaleType.FLOAT32,
    "round_method": RoundMethod.HALF_EVEN,
    "is_dynamic": False,
    "bits": None,
}

TENSOR_CLASSES: tuple[str, ...] = ("input_tensors", "output_tensors", "weight", "bias")
ACTIVATION_CLASSES: tuple[str, ...] = TENSOR_CLASSES[:2]  # the classes calibrated on data
