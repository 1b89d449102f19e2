"""Dynamic quantization: activations quantized at run time by the kernel, weights offline
(lowered by `emit/dynamic` to MatMulInteger/ConvInteger/DynamicQuantizeLSTM)."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.graph.fold import constant_array
from onnxq.plan.draft import Draft
from onnxq.plan.rules import DYNAMIC_OPS
from onnxq.plan.strategies.registry import Decision, Lower, Refuse, register_strategy


@register_strategy("dynamic", order=40)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    if cfg.input_tensors is None or not cfg.input_tensors.is_dynamic:
        return None
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    if node.op_type not in DYNAMIC_OPS:
        return Refuse("dynamic quantization covers MatMul, Gemm, Conv and LSTM only")
    if cfg.weight is None or constant_array(weight) is None:
        return Refuse("dynamic quantization needs a constant weight")
    return Lower(draft.target_weight_spec(cfg.weight, "dynamic", cfg.input_tensors))
