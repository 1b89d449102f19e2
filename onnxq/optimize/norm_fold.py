"""Fold a per-channel input scale into the normalization that produces the input.

AWQ divides a group's shared input by s per channel. Where that input is the normalized
output of a (Skip)(Simplified)LayerNormalization or RMSNormalization read by the group
alone, y = norm(x) * gamma (+ beta), so y / s = norm(x) * (gamma / s) (+ beta / s): the
division goes into the norm's own weights, as AutoAWQ's scale_ln_fcs does, instead of a
Mul on every token's activations (SmolLM2-135M decode: the q/k/v and gate/up Muls are 60
of AWQ's 120). The norm's other outputs (the skip sum, mean, inverse std) do not read
gamma, so they are unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxq.graph.edit import GraphEditor
from onnxq.graph.fold import constant_array

# op type -> (gamma input, beta input or None); the normalized tensor is output 0.
NORMS: dict[str, tuple[int, int | None]] = {
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1, None),
    "RMSNormalization": (1, None),
    "SkipLayerNormalization": (2, 3),
    "SkipSimplifiedLayerNormalization": (2, None),
}


def fold_input_scale(edit: GraphEditor, x: ir.Value, readers: set[str], inverse: np.ndarray) -> bool:
    """Multiply the weights of the norm producing `x` by `inverse` (1 / s, per channel)
    when only the nodes named in `readers` read `x` and the norm alone reads those
    weights; True when done (then `x` already carries the scale), False to leave it."""
    node = x.producer()
    if node is None or node.op_type not in NORMS or node.outputs[0] is not x:
        return False
    if {use.node.name for use in x.uses()} != readers or x in edit.graph.outputs:
        return False
    slots = [i for i in NORMS[node.op_type] if i is not None and i < len(node.inputs) and node.inputs[i] is not None]
    arrays = {i: constant_array(node.inputs[i]) for i in slots}
    for i, array in arrays.items():
        weight = node.inputs[i]
        if array is None or len(weight.uses()) != 1 or array.shape != inverse.shape or weight in edit.graph.outputs:
            return False
    for i, array in arrays.items():
        array = np.asarray(array)
        node.replace_input_with(i, edit.initializer(f"{node.inputs[i].name}_awq",
                                                    (array * inverse.astype(array.dtype)).astype(array.dtype)))
    return True
