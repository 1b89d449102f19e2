"""Ranges that keep a Clip onnxruntime would drop.

A Clip whose output quantization does not clamp where it does (ReLU6 before a symmetric
8- or 16-bit QuantizeLinear, whose grid reaches qmin s) stays in the graph (`emit/qdq.py`). At
its default optimisation level onnxruntime (1.32) fuses Clip -> QuantizeLinear and
removes the Clip when the quantizer's grid [(qmin - zp) s, (qmax - zp) s] lies within the
Clip's bounds up to float32's epsilon, an absolute 1.2e-7 (`ClipQuantFusion`). Under
activations that small (a random-weight MobileNet-v2 computes in 1e-8 from its middle
on), the grid's negative half is within that epsilon of 0, the Clip goes, and every
negative value passes: S8S8 came out at -3.4 dB in a default session against 31.6 dB
with its optimisations off (A16W8: -0.0 against 42.8 dB). Such a tensor's range is scaled
up until its grid reaches 2 epsilon past the Clip's bound, which onnxruntime keeps: a
coarser grid on a tensor whose values are all under 1e-7 (8-bit: 27.8 dB at 1e-8, 8.4 dB
at 1e-9), instead of a lost activation.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.graph.layout import clip_bounds
from onnxq.notes import Note, Topic
from onnxq.numerics.qmath import compute_qparams, int_type, is_integer
from onnxq.plan.plan import QuantPlan

EPSILON = float(np.finfo(np.float32).eps)  # onnxruntime's tolerance, absolute


def _grid(spec: ResolvedSpec, low: float, high: float) -> tuple[float, float]:
    """The float32 ends of the grid a range [low, high] quantizes to, as onnxruntime
    computes them from the QuantizeLinear's scale and zero point."""
    scale, zp = compute_qparams(low, high, spec.dtype, spec.symmetric, spec.scale_type, bits=spec.bits)
    info = int_type(spec.dtype, spec.bits)
    s = np.float32(scale)
    return float(s * np.float32(info.qmin - int(zp))), float(s * np.float32(info.qmax - int(zp)))


def _dropped(grid: tuple[float, float], bounds: tuple[float, float]) -> bool:
    """Whether onnxruntime removes a Clip of `bounds` before a QuantizeLinear of this
    `_grid` although values under the Clip's minimum would pass the grid."""
    lower, upper = grid
    return lower < bounds[0] and bounds[0] - lower <= EPSILON and upper - bounds[1] <= EPSILON


def clip_safe_ranges(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
                     ) -> tuple[dict[str, tuple[float, float]], list[Note]]:
    """`ranges` with the Clip outputs onnxruntime would lose their Clip over widened (module
    doc), and a note naming them."""
    out = dict(ranges)
    widened = []
    for node in model.graph:
        if node.op_type != "Clip" or node.domain not in ("", "ai.onnx") or node.outputs[0].name not in plan.tensors:
            continue
        root = plan.root_of(node.outputs[0].name)
        spec = plan.tensors[root].spec
        bounds = clip_bounds(node)
        # onnxruntime (1.32) fuses 8- and 16-bit QuantizeLinear
        if bounds is None or root not in out or not is_integer(spec.dtype) or int_type(spec.dtype).bits not in (8, 16):
            continue
        low, high = out[root]
        grid = _grid(spec, low, high)
        if not _dropped(grid, bounds):
            continue
        factor = (bounds[0] - 2 * EPSILON) / grid[0] if grid[0] < 0 else 0.0
        while factor > 0 and _dropped(_grid(spec, low * factor, high * factor), bounds):
            factor *= 1.01  # float32 rounding of the new scale
        if factor > 0:
            out[root] = (low * factor, high * factor)
            widened.append(root)
    if not widened:
        return out, []
    names = ", ".join(widened[:3]) + (", ..." if len(widened) > 3 else "")
    return out, [Note(Topic.CALIBRATION, f"{len(widened)} Clip outputs' ranges widened to keep their Clip in "
                      f"onnxruntime (values under {EPSILON:.1g}, whose symmetric grid its Clip+QuantizeLinear fusion "
                      f"takes for the Clip's): {names}", tuple(widened))]
