"""`hqq` as an algorithm: half-quadratic zero points (`numerics/hqq.py`) for every MatMul
weight lowered to MatMulNBits, whatever the weight spec's symmetry.

The same numerics as the weight spec's `calib_method: hqq`, offered beside GPTQ and AWQ so
`--algorithm hqq` and a typed `HQQConfig` pick it like the others: blocks get min-max
scales and optimised float zero points (asymmetric, which is what HQQ optimises), stored
by MatMulNBits as they are. No calibration data is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.emit.matmul_nbits import quantize_blockwise
from onnxq.errors import ConfigError
from onnxq.graph.fold import constant_array
from onnxq.graph.load import drop_pages
from onnxq.optimize import PassContext, register_algorithm
from onnxq.optimize.gptq import NO_LAYERS, matmul_nbits_layers
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.matmul_nbits import FLOAT_TYPES, weight_dtype


@dataclass(frozen=True)
class HQQConfig:
    """Options of `hqq`: iterations of the half-quadratic solver, the lp norm p (< 1
    forgives outliers), the initial beta and its growth kappa (the paper's defaults)."""

    ALGORITHM: ClassVar[str] = "hqq"

    iterations: int = 20
    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ConfigError(f"hqq: iterations must be at least 1, got {self.iterations}")
        if not 0 < self.p <= 1:
            raise ConfigError(f"hqq: p must be in (0, 1], got {self.p}")
        if self.beta <= 0 or self.kappa < 1:
            raise ConfigError(f"hqq: beta must be > 0 and kappa >= 1, got beta {self.beta}, kappa {self.kappa}")


@register_algorithm("hqq", options=HQQConfig, data="none", rewrites=("weights",))
def hqq(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], options: HQQConfig,
        ctx: PassContext) -> str:
    """Quantize every MatMulNBits weight with HQQ zero points; pin it for emission."""
    layers = matmul_nbits_layers(model, plan)
    if not layers:
        return NO_LAYERS
    solver = tuple(sorted(dataclasses.asdict(options).items()))
    for node, spec in layers:
        hqq_spec = dataclasses.replace(spec, symmetric=False, calib_method="hqq", calib_options=solver)
        w = np.asarray(constant_array(node.inputs[1]))
        ctx.weights.pin_node(node.name, node.inputs[1],
                             quantize_blockwise(w, hqq_spec, FLOAT_TYPES[weight_dtype(node)]))
        drop_pages(node.inputs[1].const_value)  # read once; a mapped weight's pages may go
    return f"{len(layers)} MatMul weights quantized with HQQ (asymmetric blocks, float zero points)"
