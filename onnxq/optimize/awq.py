"""AWQ (Lin et al. 2023), activation-aware weight quantization, for the MatMul weights
lowered to MatMulNBits, in numpy.

Input channels that carry large activations matter most. AWQ scales each input row k of
W [K, N] by s_k = m_k^alpha (m: the channel's RMS over calibration data), quantizes W s
with round-to-nearest and divides the input by s, so the important rows get finer
steps. alpha is searched on a grid per layer; each candidate's output error
E[|x (W - Q(W s) / s)|^2] = sum over columns of e^T H e is exact under H = E[x x^T],
which the calibration pass collects once (the `gram` statistic GPTQ uses), so no
candidate runs the model. A layer whose best alpha is 0 is left as it is. The division
is a Mul by 1/s on the MatMul's input (float, per channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.emit.matmul_nbits import dequantize_blockwise, quantize_blockwise
from onnxq.errors import ConfigError
from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array
from onnxq.optimize import PassContext, register_algorithm, statistics_of
from onnxq.optimize.gptq import NO_LAYERS, hessian_requests, layers_with_hessians
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.matmul_nbits import FLOAT_TYPES, weight_dtype


@dataclass(frozen=True)
class AWQConfig:
    """Options of `awq` (bits, sym and group_size come from the weight spec). grid:
    alpha candidates in [0, 1]. min_gain: the share by which the output error must drop
    for a layer to be scaled (its Mul costs time; a smaller gain is noise)."""

    ALGORITHM: ClassVar[str] = "awq"

    grid: int = 20
    min_gain: float = 0.02

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise ConfigError(f"awq: grid must be at least 1, got {self.grid}")
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"awq: min_gain must be in [0, 1), got {self.min_gain}")


@statistics_of("awq")
def awq_requests(model: ir.Model, plan: QuantPlan, options: AWQConfig) -> list[Statistic]:
    return hessian_requests(model, plan)


def output_error(w: np.ndarray, w_hat: np.ndarray, hessian: np.ndarray) -> float:
    """E[|x (w - w_hat)|^2] for inputs x with second moment `hessian` (w: [K, N])."""
    e = (w - w_hat).astype(np.float64)
    return float(np.sum(e * (hessian @ e)))


def search_scales(w: np.ndarray, hessian: np.ndarray, spec, scale_dtype: type, grid: int,
                  min_gain: float = 0.0) -> tuple[float, np.ndarray]:
    """The alpha of least output error and its per-input-channel scales (module doc);
    alpha 0 unless the error drops by at least `min_gain`."""
    rms = np.sqrt(np.maximum(np.diag(hessian), 1e-12))
    nearest = output_error(w, dequantize_blockwise(quantize_blockwise(w, spec, scale_dtype)), hessian)
    best = (nearest * (1 - min_gain), 0.0, np.ones(len(rms)))
    for alpha in np.arange(1, grid + 1) / grid:
        s = rms ** alpha
        s = s / np.sqrt(s.max() * s.min())  # centred, so the weights keep their magnitude
        w_hat = dequantize_blockwise(quantize_blockwise((w * s[:, None]).astype(np.float32), spec, scale_dtype))
        err = output_error(w, w_hat / s[:, None], hessian)
        if err < best[0]:
            best = (err, float(alpha), s)
    return best[1], best[2]


@register_algorithm("awq", options=AWQConfig, data="required", rewrites=("weights", "graph"))
def awq(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], options: AWQConfig,
        ctx: PassContext) -> str:
    """Scale the input rows of every MatMul lowered to MatMulNBits (module doc)."""
    layers = layers_with_hessians(model, plan, ctx, "awq")
    if not layers:
        return NO_LAYERS
    edit = GraphEditor(model.graph)
    alphas = []
    for node, spec, hessian in layers:
        weight = node.inputs[1]
        w = constant_array(weight)
        if hessian is None or len(weight.uses()) != 1:
            continue
        alpha, s = search_scales(w, hessian, spec, FLOAT_TYPES[weight_dtype(node)], options.grid, options.min_gain)
        alphas.append(alpha)
        if alpha == 0.0:
            continue
        node.replace_input_with(1, edit.initializer(f"{weight.name}_awq", (w * s[:, None]).astype(w.dtype)))
        inverse = edit.initializer(f"{node.name}_awq_inverse_scale", (1.0 / s).astype(w.dtype))
        scaled = edit.add_node("Mul", [node.inputs[0], inverse], f"{node.inputs[0].name}_awq",
                               dtype=node.inputs[0].dtype, shape=node.inputs[0].shape)
        node.replace_input_with(0, scaled)
    model.graph.sort()
    moved = sum(a > 0 for a in alphas)
    return (f"{moved} of {len(layers)} MatMul weights scaled (alpha median "
            f"{float(np.median(alphas)) if alphas else 0:.2f}); the rest kept round-to-nearest")
