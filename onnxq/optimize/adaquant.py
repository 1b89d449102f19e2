"""AdaQuant (Hubara et al., "Accurate Post Training Quantization With Small Calibration
Sets", ICML 2021): optimise each layer's weights continuously, through the rounding.

Per layer, Adam moves the float weights u (in steps of the weight grid) so that the
quantized weights s * round(u / t) (rounded on the weight type's grid and saturated:
`layerwise/grid.py`; a float8 grid's step is the gap between the values around a weight)
minimise the layer's output error with quantized inputs (`layerwise`), the rounding
passed straight through (STE), each weight
within `max_step` grid steps of its float value. With `bias`, the bias is re-solved
exactly at every step (the least-squares mean correction given the quantized weights:
the quadratic loss makes it closed-form); with `learn_scale` the scale factor t per
channel (or tensor) is learned too (LSQ's gradient). Layers run in graph order, each on
inputs from the already optimised prefix: the paper's sequential AdaQuant, whose bias
correction comes with every step rather than after.

The best step by loss is kept; a layer whose error does not drop below nearest
rounding's keeps nearest rounding. Only the quantized weights change: the model keeps
its float weights, so a later bias correction measures the error against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnxq.optimize.context import AlgorithmResult
from onnxq.optimize.layerwise.adam import Adam
from onnxq.optimize.layerwise.driver import reconstruct
from onnxq.optimize.layerwise.options import LayerwiseConfig, check
from onnxq.optimize.layerwise.problem import Problem, Solution
from onnxq.optimize.registry import register_algorithm


@dataclass(frozen=True)
class AdaQuantConfig(LayerwiseConfig):
    """Options of `adaquant`: those of `LayerwiseConfig` (learning_rate in grid steps per
    Adam step; the bias, with `LayerwiseConfig.bias`, is re-solved at every step), and:
    learn_scale: learn the weight scale too. max_step: how far, in grid steps, a weight may
    move from its float value (0: unbounded, as in the paper); bounded, the weights can
    fit the layer but not the calibration samples' peculiarities."""

    ALGORITHM: ClassVar[str] = "adaquant"

    learn_scale: bool = False
    max_step: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.reconstruct == "layer",
              "adaquant: reconstruct: block learns rounding, which is AdaRound's; use the adaround "
              "algorithm (on the command line: --reconstruct block without --adaquant)")
        check(self.max_step >= 0, "adaquant: max_step is in grid steps, >= 0 (0: unbounded)")


def tune_weights(problem: Problem, options: AdaQuantConfig) -> Solution:
    """Weights, bias and scale AdaQuant learns for one layer (module doc)."""
    s0 = problem.scale
    u = (problem.w / s0).astype(np.float32)
    u0 = u.copy()
    # Grid steps in scale units around each weight: 1 for integer codes (None), the gap
    # between its float8 neighbours for float8, so steps and `max_step` mean the same.
    spacing = problem.grid.step(u0)
    spacing = None if spacing is None else spacing.astype(np.float32)
    bound = None if not options.max_step else options.max_step if spacing is None else options.max_step * spacing
    t = np.ones((1, 1, 1) if not problem.per_channel else s0.shape, dtype=np.float32)
    tune_bias = options.bias and problem.has_bias
    k = problem.w.shape[2]
    adam = Adam(options.learning_rate)
    best = (np.inf, None, None, None)
    full = np.empty(problem.t.shape, dtype=np.float32)
    full[:, :, k] = problem.bias
    for step in range(options.num_iteration + 1):
        scaled = u / t
        codes = problem.grid.round(scaled)
        weights = codes * (s0 * t)
        full[:, :, :k] = weights
        if tune_bias and problem.through is None:  # from the float64 weights (closed form)
            full[:, :, k] = problem.linear_bias(weights)
        grad_w, loss = problem.gradient(full, step, tune_bias and problem.through is not None, with_loss=True)
        grad_w *= np.float32(2 / (problem.outputs * max(problem.reference, 1e-30)))
        if np.isfinite(loss) and loss < best[0]:
            best = (loss, codes.copy(), (u * s0).copy(), (s0 * t).copy())
        inside = problem.grid.unsaturated(scaled)
        adam.step(0, u, grad_w * (s0 * inside).astype(np.float32), spacing)
        if bound is not None:
            np.clip(u, u0 - bound, u0 + bound, out=u)
        if options.learn_scale:
            dt = grad_w * s0 * (codes - scaled * inside)
            adam.step(1, t, dt.sum(axis=2, keepdims=True) if problem.per_channel else dt.sum().reshape(1, 1, 1))
            np.maximum(t, 1e-3, out=t)
    _, codes, weights, scale = best
    if codes is None:  # every step was NaN/Inf: the driver keeps nearest rounding
        return Solution(np.full(problem.w.shape, np.nan))
    codes = codes.astype(np.float64)
    bias = problem.best_bias(codes * scale) if tune_bias else None
    return Solution(codes, weights, bias, scale if options.learn_scale else None)


@register_algorithm("adaquant", options=AdaQuantConfig, data="required", rewrites=("weights", "biases"), flag=2,
                    learns_rounding=True, serial_blas=True,
                    flag_help="optimise weights and biases layer by layer through the rounding (AdaQuant)")
def adaquant(model, plan, ranges, opts: AdaQuantConfig, ctx) -> str | AlgorithmResult:
    """Optimise every quantized Conv/Gemm/MatMul weight and bias (module doc)."""
    return reconstruct("adaquant", tune_weights, model, plan, ranges, opts, ctx)
