"""Keep onnxruntime's CPU provider off a fused kernel that is slower than its parts.

At the default level onnxruntime fuses a float Add whose only consumer is a
LayerNormalization into `com.microsoft.SkipLayerNormalization`
(onnxruntime/core/optimizer/skip_layer_norm_fusion.cc). On the CPU provider that kernel
is much slower than the two ops it replaces: onnxruntime 1.32 on x86 AVX2, 8x56x384
float32, 1.08 ms fused against 0.17 ms apart on one thread (0.56 against 0.12 on two),
the same at 768 channels. In an int8 transformer the residual Adds stay float (their
outliers do not fit 8 bits), so every block pays it twice: all-MiniLM-L6-v2 int8 ran
30.4 ms at batch 1 against 24.2 with the fusion avoided, and 91.8 against 87.5 at batch
8 (onnxruntime's own int8 model, whose residual Adds are quantized and never fuse: 23.9
and 88.4).

The fusion matches the op type Add only, so such an Add is written as Sum, which adds
its two inputs with the same broadcasting, bit for bit: the fused kernel is simply not
formed. Only CPU targets get this; on GPU providers the fused kernel is the fast one.
"""

from __future__ import annotations

import onnx_ir as ir


def _feeds_only_layernorm(value: ir.Value) -> bool:
    uses = list(value.uses())
    return (not value.is_graph_output() and len(uses) == 1 and uses[0].idx == 0
            and uses[0].node.op_type == "LayerNormalization" and uses[0].node.domain in ("", "ai.onnx"))


def keep_layernorm_apart(model: ir.Model) -> int:
    """Write each float Add feeding only a LayerNormalization as Sum; how many."""
    rewritten = 0
    for node in model.graph:
        if (node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2
                and _feeds_only_layernorm(node.outputs[0])):
            node.op_type = "Sum"
            rewritten += 1
    return rewritten
