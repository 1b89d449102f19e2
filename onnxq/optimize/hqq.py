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

from onnxq.graph.external_data import drop_pages
from onnxq.graph.fold import constant_array
from onnxq.numerics.blocks import quantize_blockwise
from onnxq.numerics.hqq import HqqOptions
from onnxq.optimize.context import AlgorithmContext, AlgorithmResult
from onnxq.optimize.gptq import NO_LAYERS, matmul_nbits_layers
from onnxq.optimize.registry import register_algorithm
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.matmul_nbits import BITS, FLOAT_TYPES, weight_dtype
from onnxq.progress import bar as progress_bar


@dataclass(frozen=True)
class HQQConfig(HqqOptions):
    """Options of `hqq`: the solver's (`numerics.hqq.HqqOptions`)."""

    ALGORITHM: ClassVar[str] = "hqq"


@register_algorithm("hqq", options=HQQConfig, data="none", rewrites=("weights",), rounds_blocks=True)
def hqq(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], options: HQQConfig,
        ctx: AlgorithmContext) -> str | AlgorithmResult:
    """Quantize every MatMulNBits weight with HQQ zero points; pin it for emission."""
    layers = matmul_nbits_layers(model, plan)
    if not layers:
        return NO_LAYERS
    solver = tuple(sorted(dataclasses.asdict(options).items()))
    for node, spec in progress_bar(layers, "hqq", "layer", ctx.settings.progress):
        hqq_spec = dataclasses.replace(spec, symmetric=False, calib_method="hqq", calib_options=solver)
        w = np.asarray(constant_array(node.inputs[1]))
        ctx.weights.pin_node(node.name, node.inputs[1],
                             quantize_blockwise(w, hqq_spec, FLOAT_TYPES[weight_dtype(node)]))
        drop_pages(node.inputs[1].const_value)  # read once; a mapped weight's pages may go
    if not any(BITS[spec.dtype] == 4 for _, spec in layers):  # 8-bit zero points are rounded onto the grid
        return (f"{len(layers)} MatMul weights quantized with HQQ (asymmetric 8-bit blocks, zero points rounded onto "
                "the grid: onnxruntime takes float ones in 4 bits only)")
    return (f"{len(layers)} MatMul weights quantized with HQQ (asymmetric blocks, float zero points); warning: "
            "onnxruntime's CPU MatMulNBits runs float zero points on a slow path (SmolLM2-135M decode: 4.5 "
            "tokens/s against RTN's and GPTQ's 90-160): where speed counts, use --algorithm gptq or rtn")
