"""Float targets: nodes configured for float16/bfloat16 are converted, not quantized
(lowered by `emit/float_cast`)."""

from __future__ import annotations

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig
from onnxq.numerics.qmath import FLOAT_TARGETS
from onnxq.plan.draft import Draft
from onnxq.plan.strategies.registry import Decision, Lower, register_strategy


@register_strategy("float_target", order=10, counted=False)
def claim(node: ir.Node, cfg: ResolvedConfig, draft: Draft) -> Decision:
    main = cfg.input_tensors or cfg.weight
    if main is not None and main.dtype in FLOAT_TARGETS:
        return Lower(main.dtype)
    return None
