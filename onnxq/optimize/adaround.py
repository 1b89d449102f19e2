"""AdaRound (Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization",
ICML 2020): learn, per weight, whether to round down or up.

Each weight's code is down + h(V) (up - down), down and up the codes just below and above
w / s on the weight type's grid (floor and floor + 1 for integers, the neighbouring
float8 values for float8: `layerwise/grid.py`), h the rectified sigmoid
clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1) with zeta = 1.1, gamma = -0.1, V
initialised so that h equals the weight's fractional part. Adam minimises the layer's
output error with quantized inputs (`layerwise`) plus `reg_param` * sum(1 - |2h - 1|^beta),
the regulariser that drives every h to 0 or 1, off for the first `warm_start` share of
the iterations, then with beta annealed from `beta_range_start` to `beta_range_end`
(cosine). The codes finally round h at 1/2, and a layer whose output error does not
drop below nearest rounding's keeps nearest rounding.

The error is computed from each layer's input statistics (`layerwise/gram.py`), exact
over every position of every calibration sample, so each iteration is one full-batch
gradient step at the cost of an [M, K] x [K, K] product: a few hundred of them do what the
paper's 10k-20k mini-batch steps do. The weights' granularity, bits and type come from
the weight's QuantizationSpec (per-tensor or per-channel, int2..int8, 7-bit and pair-safe
target weights included, float8 E4M3FN/E5M2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnxq.optimize.context import AlgorithmResult
from onnxq.optimize.layerwise.adam import Adam
from onnxq.optimize.layerwise.block_fit import Rounding
from onnxq.optimize.layerwise.driver import reconstruct
from onnxq.optimize.layerwise.options import LayerwiseConfig, check
from onnxq.optimize.layerwise.problem import Problem, Solution
from onnxq.optimize.layerwise.soft_rounding import (
    SPAN,
    beta_at,
    rectified_sigmoid,
    regulariser_gradient,
    start_logits,
)
from onnxq.optimize.registry import register_algorithm


@dataclass(frozen=True)
class AdaRoundConfig(LayerwiseConfig):
    """Options of `adaround`: those of `LayerwiseConfig` and AMCT ADA's regulariser
    fields (the bias, with `LayerwiseConfig.bias`, is re-solved at every step). reg_param:
    weight of the rounding regulariser. beta_range_start /
    beta_range_end: its annealed exponent. warm_start: share of the steps before the
    regulariser starts."""

    ALGORITHM: ClassVar[str] = "adaround"

    # Faster than the shared 0.01 for soft rounding variables: 300 steps at 0.03 gave a
    # higher output SQNR on each shared model (MobileNet int4 10.3 -> 10.6 dB, per-tensor
    # int8 18.4 -> 18.5 dB, ResNet-20 int4 19.0 -> 19.3 dB).
    learning_rate: float = 0.03
    reg_param: float = 0.01
    beta_range_start: float = 20.0
    beta_range_end: float = 2.0
    warm_start: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.reg_param >= 0, "adaround: reg_param must be >= 0")
        check(self.beta_range_start >= self.beta_range_end > 0,
              "adaround: need beta_range_start >= beta_range_end > 0 (e.g. 20 and 2)")
        check(0 <= self.warm_start < 1, "adaround: warm_start is a share of the iterations in [0, 1)")


def _beta(options: AdaRoundConfig, step: int, steps: int | None = None) -> float | None:
    """The regulariser's exponent at `step` of `steps` (default num_iteration), None
    during the warm start."""
    steps = options.num_iteration if steps is None else steps
    return beta_at(step, steps, options.warm_start, options.beta_range_start, options.beta_range_end)


def learn_rounding(problem: Problem, options: AdaRoundConfig) -> Solution:
    """The codes AdaRound learns for one layer (module doc)."""
    u = problem.w / problem.scale
    # The codes just below and above each weight (a float8 grid's gap grows with the
    # value); codes that cannot move (either one off the grid) keep their nearest value.
    floor, free = problem.grid.brackets(u)
    gap = problem.grid.up(floor) - floor
    base = np.where(free, floor, problem.nearest).astype(np.float32)
    movable = (free * gap).astype(np.float32)
    v = start_logits(np.clip((u - floor) / np.where(free, gap, 1.0), 0.0, 1.0))
    scale32 = problem.scale.astype(np.float32)
    k = problem.w.shape[2]
    full = np.empty(problem.t.shape, dtype=np.float32)
    full[:, :, k] = problem.bias
    tune_bias = options.bias and problem.has_bias
    # d loss / d h per weight = coef * gradient: loss scale, grid step, movable or not.
    coef = (2.0 / (problem.outputs * max(problem.reference, 1e-30)) * problem.scale * movable).astype(np.float32)
    adam = Adam(options.learning_rate)
    sig, soft, slope, scratch = (np.empty_like(v) for _ in range(4))
    for step in range(options.num_iteration):
        _, _, active = rectified_sigmoid(v, sig, soft)
        np.multiply(soft, movable, out=full[:, :, :k])
        full[:, :, :k] += base
        full[:, :, :k] *= scale32
        grad, _ = problem.gradient(full, step, tune_bias)
        grad *= coef
        beta = _beta(options, step)
        if beta is not None and options.reg_param:
            grad -= regulariser_gradient(soft, beta, options.reg_param, slope, scratch)
        np.subtract(1, sig, out=slope)  # h's slope: sig (1 - sig) SPAN where it is not clipped
        slope *= sig
        slope *= SPAN
        slope *= active
        grad *= slope
        adam.step(0, v, grad)
    codes = np.where(free, np.where(v >= 0, floor + gap, floor), problem.nearest)
    return Solution(codes, bias=problem.best_bias(codes * problem.scale) if tune_bias else None)


@register_algorithm("adaround", options=AdaRoundConfig, data="required", rewrites=("weights", "biases"), flag=1,
                    learns_rounding=True, serial_blas=True,
                    flag_help="learn each weight's rounding, layer by layer, against the float model (AdaRound)")
def adaround(model, plan, ranges, opts: AdaRoundConfig, ctx) -> str | AlgorithmResult:
    """Learn the rounding of every quantized Conv/Gemm/MatMul weight (module doc)."""
    blocks = None
    if opts.reconstruct == "block":
        blocks = Rounding(opts.block_iterations, opts.learning_rate, opts.reg_param,
                          functools.partial(_beta, opts, steps=opts.block_iterations))
    return reconstruct("adaround", learn_rounding, model, plan, ranges, opts, ctx, blocks)
