"""Weights as the target's int8 kernels can run them: the spec the planner gives each
weighted op, narrowed where the kernel saturates or mishandles zero points."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType, QScheme
from onnxq.graph import layout
from onnxq.target.profile import TargetProfile


def kernel_class(node: ir.Node, weight: np.ndarray) -> str:
    """The int8 kernel family onnxruntime runs for a weighted op: `depthwise` for a Conv
    with one input and one output channel per group, `gemm` for everything else."""
    return "depthwise" if layout.is_depthwise(node, weight.shape) else "gemm"


def target_weight_spec(
    target: TargetProfile | None, spec: ResolvedSpec, kernel: str, activation: ResolvedSpec | None,
    k_axes: tuple[int, ...] | None = None,
) -> ResolvedSpec:
    """`spec` as the target can run it: int8 weights that the kernel cannot saturate
    (per-tensor weights of uint8 activations as uint8, U8U8 kernels; pair-safe scales where
    the K order is known and weights are symmetric, else 7 bits; `reduce_range` and an
    explicit `bits` in the config win), and symmetric weights where per-channel zero
    points are miscomputed (depthwise Conv)."""
    if target is None:
        return spec
    if not spec.symmetric and target.symmetric_weights_needed(kernel, spec.qscheme == QScheme.PER_CHANNEL.value):
        spec = dataclasses.replace(spec, symmetric=True)
    if spec.bits is not None or spec.dtype is not DType.INT8:
        return spec
    act = activation.dtype.value if activation is not None else None
    if act not in ("uint8", "int8"):
        act = None
    if activation is not None and activation.is_dynamic:
        act, kernel = "uint8", "dynamic"
    bits = target.weight_bits(kernel, act)
    if bits is None:
        return spec
    if target.reduce_range is None and spec.qscheme == QScheme.PER_TENSOR.value and act == "uint8" \
            and kernel == "gemm" and "u8u8_gemm" not in target.wrong:
        # One scale for the tensor must hold every channel's kernel pairs, far coarser than
        # pair-safe per-channel scales; uint8 weights run U8U8 kernels, exact on every CPU
        # (MobileNet per-tensor CLE + bias correction: 83.38 pair-safe, 85.25 uint8).
        return dataclasses.replace(spec, dtype=DType.UINT8)
    if target.reduce_range is None and k_axes is not None and spec.symmetric \
            and spec.qscheme != QScheme.PER_GROUP.value:
        return dataclasses.replace(spec, pairs=k_axes)
    return dataclasses.replace(spec, bits=bits)
