"""Options every layer-wise algorithm takes (AdaRound and AdaQuant extend them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from onnxq.errors import ConfigError
from onnxq.optimize.layerwise.layers import OP_TYPES

INPUTS = ("quantized", "weights", "float")
RECONSTRUCT = ("layer", "block")


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class LayerwiseConfig:
    """num_iteration: Adam steps per layer. learning_rate: Adam's step size.
    damping: share of the input statistics' mean diagonal added as a pull toward the
      float weights (keeps layers that saw little data near nearest rounding).
    inputs: where each layer's input comes from: "quantized" (the model as emitted, with
      the layers before it already optimised: errors do not compound), "weights" (the
      float model with the optimised quantized weights, activations float) or "float".
    op_types / layers / skip_layers: which layers: those of op_types and those named in
      layers (empty op_types and a list of layers: only those), less skip_layers.
    max_positions: positions (rows) per layer its statistics keep, evenly strided.
    cache_budget_mb: tensors kept between layers stay in memory up to this, on disk beyond.
    validation_every: on every n-th calibration batch the whole model must come out at
      least as close to float as with nearest rounding, else everything is undone (0: no
      check). hold_out: keep those batches out of the statistics, so the check reads data
      the fit never saw; off, they are fitted too (a third more data to fit, and a check
      on the fit's own data). 2026-11-29, 200 images, one run each, logit SQNR held out ->
      fitted: MobileNet-v1 W4A8 12.82 -> 12.97 dB (on other images 12.62 -> 12.81, top-1
      84.12 -> 82.62), all-int4 ResNet-20 20.55 -> 20.93, W4A8 22.12 -> 22.32, per-tensor
      int8 MobileNet AdaRound 18.62 -> 18.80 and AdaQuant 17.49 -> 17.95 (17.18 -> 17.19),
      FP8_E4M3 15.64 -> 15.75, all-MiniLM-L6 int8 AdaRound 15.36 -> 15.27; on the tests'
      small CNN with 64 images worse in 7 of 10 draws (by up to 3.9 dB). A few tenths of a
      decibel, no top-1, and not on small data: held out stays the default.
    equalize: run cross-layer equalization (`cle`) before calibration: "auto" when some
      Conv/Gemm weight is quantized per tensor (no rounding rescues a depthwise layer
      whose small channels a per-tensor scale wipes out), "always" or "never"; a `cle`
      entry in pre_quant_opt_config, enabled or not, takes precedence.
    bias: re-solve the layer's bias (Conv/Gemm) with its weights, as the least-squares
      mean correction of its output on the quantized inputs (sequential bias correction:
      MobileNet-v1 int4 per-channel AdaRound 75.4 -> 79.5 top-1).
    search_scale: before learning, shrink each output channel's weight scale (the tensor's
      one, per tensor) to the factor of least output error (`layerwise/clip.py`).
    activation: minimise the error after the activation that alone reads the layer's
      output (Relu, Clip, LeakyRelu, PRelu, Sigmoid, Tanh, Gelu), as AdaRound's paper and
      AMCT do, on up to sample_positions positions, batch_positions per step
      (`layerwise/sampled.py`); else the error of the output before it (exact statistics).
    reconstruct: "layer" (each layer's own output error) or "block" (AdaRound only: then
      the rounding of each block, `block_layers` layers or more between tensors every
      path passes through, is learned again against the block's output error,
      `layerwise/block_fit.py`), block_iterations Adam steps of block_positions output
      positions each, on the samples whose block start and end fit block_budget_mb.
    min_rows: a layer whose statistics saw fewer than min_rows x (inputs per output + 1)
      rows keeps nearest rounding (it would fit the calibration samples, not the data).
    """

    ALGORITHM: ClassVar[str] = ""
    EQUALIZE: ClassVar[tuple[str, ...]] = ("auto", "always", "never")

    num_iteration: int = 300
    learning_rate: float = 0.01
    damping: float = 0.01
    inputs: str = "quantized"
    op_types: tuple[str, ...] = OP_TYPES
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    layers: tuple[str, ...] = field(default_factory=tuple)
    max_positions: int = 65536
    # 768 MB: MobileNet-v1's first layers on 200 calibration images keep 2 x 241 MB (float
    # and quantized inputs); past 256 MB they went to disk, 8 of per-tensor AdaRound's 40 s.
    cache_budget_mb: int = 768
    validation_every: int = 4
    hold_out: bool = True
    min_rows: float = 4.0
    search_scale: bool = True
    bias: bool = True
    equalize: str = "auto"
    activation: bool = False
    sample_positions: int = 8192
    batch_positions: int = 1024
    reconstruct: str = "layer"
    block_layers: int = 2
    block_iterations: int = 200
    block_positions: int = 2048
    block_budget_mb: int = 256

    def __post_init__(self) -> None:
        name = self.ALGORITHM
        check(self.num_iteration >= 1, f"{name}: num_iteration must be at least 1")
        check(self.learning_rate > 0, f"{name}: learning_rate must be > 0")
        check(self.damping >= 0, f"{name}: damping must be >= 0")
        check(self.inputs in INPUTS, f"{name}: inputs is one of {', '.join(INPUTS)}; got {self.inputs!r}")
        check(set(self.op_types) <= set(OP_TYPES),
              f"{name}: op_types may hold {', '.join(OP_TYPES)}; got {', '.join(self.op_types)}")
        check(self.max_positions >= 1, f"{name}: max_positions must be at least 1")
        check(self.cache_budget_mb >= 0, f"{name}: cache_budget_mb must be >= 0")
        check(self.validation_every >= 0 and self.validation_every != 1,
              f"{name}: validation_every is 0 (no check) or at least 2")
        check(self.sample_positions >= 1 and self.batch_positions >= 1,
              f"{name}: sample_positions and batch_positions must be at least 1")
        check(self.reconstruct in RECONSTRUCT,
              f"{name}: reconstruct is one of {', '.join(RECONSTRUCT)}; got {self.reconstruct!r}")
        check(self.reconstruct == "layer" or self.inputs == "quantized",
              f"{name}: reconstruct: block learns each block on the quantized model's inputs; "
              "it needs inputs: quantized")
        check(self.block_layers >= 1 and self.block_iterations >= 1 and self.block_positions >= 1
              and self.block_budget_mb >= 1,
              f"{name}: block_layers, block_iterations, block_positions and block_budget_mb must be at least 1")
        check(self.min_rows >= 0, f"{name}: min_rows must be >= 0")
        check(self.equalize in self.EQUALIZE, f"{name}: equalize is one of {', '.join(self.EQUALIZE)}; "
              f"got {self.equalize!r}")
