"""Cross-Layer Equalization (Nagel et al., "Data-Free Quantization", ICCV 2019).

For two layers joined by a positively homogeneous activation (Relu, or nothing),
f(W2 relu(W1 x + b1)) == f((W2 S) relu(S^-1 W1 x + S^-1 b1)) for any positive diagonal S.
Choosing s_i = sqrt(r1_i / r2_i), with r1_i the range (max |w|) of output channel i of
W1 and r2_i the range of input channel i of W2, gives both the range sqrt(r1_i * r2_i):
per-tensor weight quantization then wastes far fewer levels on small channels. Chains
conv -> depthwise conv -> conv share the middle layer, so the pairs are swept repeatedly
until the scales stop changing.

Clip(0, t) (ReLU6) is not homogeneous: scaling a channel moves its clip threshold, and a
Clip holds one scalar threshold. With calibration data, the scales of such pairs are
bounded so that the Clip acts exactly as before on the data: a channel whose
pre-activation stays below t may be scaled by any s >= 1.25 max / t (headroom for unseen
data), a channel that reaches t is not scaled. Without data these pairs are skipped. `relu6_to_relu` instead replaces the
Clip by Relu and equalizes freely, as Nagel et al. do for MobileNetV2; that changes the
float function wherever a pre-activation exceeded t (on MobileNet v1 0.75 float top-1
drops from 85.5% to 69.9%, so it is off by default; see benchmarks/passes.py).

`scale_append_bias` adds high-bias absorption: with calibration data, the smallest
pre-activation c_i >= 0 of each channel of a Relu pair is moved from b1 into b2
(relu(z - c) + c == z for z >= c), which shrinks the activation range. It is applied only
where the second layer is a Gemm or an unpadded Conv (zero padding would not carry c).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Reduce, Statistic
from onnxq.errors import ConfigError
from onnxq.graph import layout
from onnxq.graph.edit import set_constant
from onnxq.graph.fold import constant_array
from onnxq.optimize.context import PassContext
from onnxq.optimize.registry import register_pass

LAYERS = {"Conv", "Gemm"}
HOMOGENEOUS = {"Relu", "LeakyRelu"}  # f(s x) == s f(x) for s > 0
# Per-channel ops that commute with a positive per-channel scale.
PASS_THROUGH = {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Dropout", "Identity", "Flatten"}
# ... and that also commute with a per-channel shift (needed for bias absorption).
SHIFT_THROUGH = {"MaxPool", "GlobalAveragePool", "GlobalMaxPool", "Dropout", "Identity", "Flatten"}
TOLERANCE = 1e-4  # stop sweeping when no scale moves by more than this (relative)
SCALE_LIMIT = 1e3  # total scales are clamped to [1/limit, limit]
# A channel below a Clip max t is scaled up only while its calibrated max stays below
# t / CLIP_HEADROOM: unseen data may go a little higher (on MobileNet v1 this cuts the
# float logit change on held-out images from 4.5% to 1.2% at no int8 cost).
CLIP_HEADROOM = 1.25


@dataclass(frozen=True)
class CLEConfig:
    """Options of the `cle` pass.

    steps: maximum sweeps over all pairs; stops earlier once no scale moves by more than
      1e-4 (Nagel et al. iterate to convergence; MobileNet v1's chain of 27 pairs takes
      17 sweeps; its int8 accuracy is flat, within 0.6 points, from 1 to 50 sweeps).
    scale_append_bias: also absorb high biases into the next layer (needs data).
    relu6_to_relu: replace Clip(0, max) between equalized layers by Relu.
    skip_layers: node names never equalized (as either layer of a pair).
    """

    ALGORITHM: ClassVar[str] = "cle"

    steps: int = 20
    scale_append_bias: bool = False
    relu6_to_relu: bool = False
    skip_layers: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"cle: steps must be >= 1, got {self.steps}")


@dataclass
class Pair:
    """Two layers whose shared channels can be rescaled; `between` are the nodes joining them."""

    first: ir.Node
    second: ir.Node
    between: list[ir.Node]
    low: np.ndarray | float = 0.0  # bounds on the total scale of each channel
    high: np.ndarray | float = np.inf
    total: np.ndarray | float = 1.0  # product of the scales applied so far

    @property
    def clip_max(self) -> float | None:
        """The smallest Clip max between the layers (None: no bounded Clip)."""
        maxes = [_clip_bounds(n)[1] for n in self.between if n.op_type == "Clip"]
        maxes = [m for m in maxes if m is not None]
        return min(maxes) if maxes else None


def _clip_bounds(node: ir.Node) -> tuple[float | None, float | None] | None:
    """(min, max) of a Clip with constant bounds (None: unbounded); None if not constant."""
    bounds = layout.clip_bounds(node)
    if bounds is None:
        return None
    return tuple(None if np.isinf(b) else b for b in bounds)


def _joins(node: ir.Node) -> bool:
    """Whether `node` may sit between two equalized layers."""
    if node.domain not in ("", "ai.onnx") or any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return False
    if node.op_type in HOMOGENEOUS:
        return True
    if node.op_type == "Clip":
        bounds = _clip_bounds(node)
        return bounds is not None and bounds[0] == 0.0 and (bounds[1] is None or bounds[1] > 0.0)
    if node.op_type == "Flatten":  # only when each channel stays one column
        shape = node.inputs[0].shape
        spatial = shape is not None and all(d == 1 for d in list(shape)[2:])
        return layout.attr(node, "axis", 1) == 1 and spatial
    if node.op_type == "Dropout":
        return len(node.inputs) < 3 or node.inputs[2] is None
    return node.op_type in PASS_THROUGH


def _is_layer(node: ir.Node) -> bool:
    if node.op_type not in LAYERS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    w = constant_array(node.inputs[1])
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if w is None or w.dtype.kind != "f" or (bias is not None and constant_array(bias) is None):
        return False
    if node.op_type == "Gemm":
        return w.ndim == 2 and not layout.gemm_transposes(node)[0]
    return w.ndim >= 3


def find_pairs(graph: ir.Graph, skip: set[str]) -> list[Pair]:
    """Layer pairs joined through a single-consumer path of homogeneous per-channel ops."""
    pairs = []
    for first in graph:
        if not _is_layer(first) or first.name in skip:
            continue
        value, between = first.outputs[0], []
        while not value.is_graph_output() and len(value.uses()) == 1:
            use = value.uses()[0]
            node = use.node
            if use.idx != 0:
                break
            if _is_layer(node) and node.name not in skip:
                w1, w2 = constant_array(first.inputs[1]), constant_array(node.inputs[1])
                if layout.out_channels(first, w1.shape) == layout.in_channels(node, w2.shape):
                    pairs.append(Pair(first, node, between))
                break
            if not _joins(node):
                break
            between.append(node)
            value = node.outputs[0]
    return pairs


# -- weight ranges and scaling (geometry: onnxq.graph.layout) ----------------------------


def out_ranges(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """max |w| per output channel."""
    return layout.out_channel_absmax(node, w)


def in_ranges(node: ir.Node, w: np.ndarray) -> np.ndarray:
    """max |w| per input channel (for grouped convs: channel g*in_per_group + j)."""
    return layout.in_channel_absmax(node, w)


def scale_out(node: ir.Node, w: np.ndarray, b: np.ndarray | None, factor: np.ndarray) -> None:
    """Multiply output channel i of the layer (weight and bias) by factor[i], in place."""
    w *= layout.out_channel_factor(node, w.shape, factor)
    if b is not None:
        b *= factor


def scale_in(node: ir.Node, w: np.ndarray, factor: np.ndarray) -> None:
    """Multiply input channel i of the layer by factor[i], in place."""
    w *= layout.in_channel_factor(node, w.shape, factor)


def equalization_scales(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """s = sqrt(r1 / r2), 1 where a channel is dead in either layer."""
    alive = (r1 > 0) & (r2 > 0)
    return np.sqrt(np.where(alive, r1, 1.0) / np.where(alive, r2, 1.0))


# -- the pass --------------------------------------------------------------------------


class _Params:
    """float64 working copies of the weights and biases of every paired layer."""

    def __init__(self, pairs: list[Pair]) -> None:
        self.w: dict[str, np.ndarray] = {}
        self.b: dict[str, np.ndarray | None] = {}
        self.nodes: dict[str, ir.Node] = {}
        for pair in pairs:
            for node in (pair.first, pair.second):
                if node.name in self.nodes:
                    continue
                self.nodes[node.name] = node
                self.w[node.name] = constant_array(node.inputs[1]).astype(np.float64)
                bias = constant_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
                self.b[node.name] = None if bias is None else bias.astype(np.float64).reshape(-1)

    def bias(self, node: ir.Node, channels: int) -> np.ndarray:
        """The layer's bias as a [channels] array, created (zero) if absent."""
        b = self.b[node.name]
        if b is None or b.size != channels:
            b = np.zeros(channels) + (0.0 if b is None else b)
            self.b[node.name] = b
        return b

    def write(self, graph: ir.Graph) -> None:
        for name, node in self.nodes.items():
            dtype = constant_array(node.inputs[1]).dtype
            set_constant(graph, node, 1, self.w[name].astype(dtype), f"{name}_cle_weight")
            if self.b[name] is not None:
                old = node.inputs[2] if len(node.inputs) > 2 else None
                shape = constant_array(old).shape if old is not None else self.b[name].shape
                b = self.b[name].reshape(shape) if np.prod(shape) == self.b[name].size else self.b[name]
                set_constant(graph, node, 2, b.astype(dtype), f"{name}_cle_bias")


def _bias_ok(node: ir.Node) -> bool:
    """A bias the output channels can be scaled in: absent, scalar or one per channel."""
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    b = constant_array(bias) if bias is not None else None
    w = constant_array(node.inputs[1])
    return b is None or b.size in (1, layout.out_channels(node, w.shape))


def equalize(pairs: list[Pair], params: _Params, steps: int) -> tuple[int, float]:
    """Sweep the pairs until no scale moves by more than TOLERANCE; (sweeps, last change)."""
    change = 0.0
    for sweep in range(1, steps + 1):
        change = 0.0
        for pair in pairs:
            w1, w2 = params.w[pair.first.name], params.w[pair.second.name]
            s = equalization_scales(out_ranges(pair.first, w1), in_ranges(pair.second, w2))
            bounded = np.clip(np.clip(pair.total * s, pair.low, pair.high), 1 / SCALE_LIMIT, SCALE_LIMIT)
            s, pair.total = bounded / pair.total, bounded
            b1 = params.b[pair.first.name]
            if b1 is not None and b1.size == 1 and s.size > 1:
                b1 = params.bias(pair.first, s.size)
            scale_out(pair.first, w1, b1, 1.0 / s)
            scale_in(pair.second, w2, s)
            change = max(change, float(np.abs(np.log(s)).max(initial=0.0)))
        if change < TOLERANCE:
            return sweep, change
    return steps, change


def _replace_clip(graph: ir.Graph, clip: ir.Node) -> ir.Node:
    relu = ir.node("Relu", [clip.inputs[0]], name=clip.name)
    ir.convenience.replace_nodes_and_values(graph, clip, [clip], [relu], list(clip.outputs), list(relu.outputs))
    return relu


def _absorbable(pair: Pair) -> bool:
    """Relu between, shift-commuting ops only, and a second layer that carries a shift exactly."""
    acts = [n for n in pair.between if n.op_type not in SHIFT_THROUGH]
    if len(acts) != 1 or acts[0].op_type not in ("Relu", "Clip"):
        return False
    if acts[0].op_type == "Clip" and _clip_bounds(acts[0])[1] is not None:
        return False
    second = pair.second
    if second.op_type == "Gemm":
        return True
    pads = layout.attr(second, "pads", None)
    auto_pad = layout.attr(second, "auto_pad", "NOTSET")
    return (pads is None or not any(pads)) and auto_pad in ("NOTSET", "VALID")


def _channel_stat(model: ir.Model, names: list[str], reduce: Reduce, ctx: PassContext,
                  purpose: str) -> dict[str, np.ndarray]:
    """Per-channel (axis 1) `reduce` of each named tensor over the calibration data."""
    stats = {name: Statistic(name, reduce, 1) for name in names}
    found = ctx.collect(model, list(stats.values()), purpose)
    return {name: found[stat] for name, stat in stats.items() if found[stat] is not None}


def absorb_high_biases(model: ir.Model, pairs: list[Pair], params: _Params, ctx: PassContext) -> str:
    """Move each channel's smallest calibrated pre-activation (if > 0) from b1 into b2."""
    pairs = [p for p in pairs if _absorbable(p) and params.b[p.first.name] is not None]
    if not pairs:
        return "no pair qualifies for high-bias absorption (Relu, then a Gemm or an unpadded Conv)"
    params.write(model.graph)  # stream the equalized model
    names = [p.first.outputs[0].name for p in pairs]
    lows = _channel_stat(model, names, "min", ctx, "cle bias absorption")
    absorbed = 0
    for pair, name in zip(pairs, names):
        if name not in lows:
            continue
        c = np.maximum(lows[name], 0.0)
        w2 = params.w[pair.second.name]
        channels = layout.out_channels(pair.second, w2.shape)
        params.bias(pair.first, c.size)[:] -= c
        params.bias(pair.second, channels)[:] += layout.apply_to_input(pair.second, w2, c)
        absorbed += int(np.count_nonzero(c))
    return f"{absorbed} high-bias channels absorbed in {len(pairs)} pairs"


def bound_clipped_scales(model: ir.Model, pairs: list[Pair], ctx: PassContext) -> int:
    """Bound the scales of pairs joined by Clip(0, t) so the clip acts as before on the data.

    A channel whose calibrated pre-activation max m stays below t may be scaled by any
    s >= m * CLIP_HEADROOM / t (it still never reaches the threshold); a channel that
    reaches t keeps s = 1.
    Returns the number of pinned channels.
    """
    names = [p.first.outputs[0].name for p in pairs]
    highs = _channel_stat(model, names, "max", ctx, "cle clip bounds")
    pinned = 0
    for pair, name in zip(pairs, names):
        m, t = highs[name], pair.clip_max
        free = m <= t  # never reaches t
        pair.low = np.where(free, np.minimum(np.maximum(m, 0.0) * CLIP_HEADROOM / t, 1.0), 1.0)
        pair.high = np.where(free, np.inf, 1.0)
        pinned += int(np.count_nonzero(~free))
    return pinned


def _has_data(ctx: PassContext) -> bool:
    return ctx.settings.access.readable


@register_pass("cle", options=CLEConfig, data="optional", rewrites=("weights", "biases", "graph"), equalizes=True)
def cross_layer_equalization(model: ir.Model, opts: CLEConfig, ctx: PassContext) -> str:
    """Equalize per-channel weight ranges of adjacent Conv/Gemm layers (see module doc)."""
    graph = model.graph
    pairs = [p for p in find_pairs(graph, set(opts.skip_layers)) if _bias_ok(p.first)]
    clipped = [p for p in pairs if p.clip_max is not None]
    notes = []
    if clipped and not opts.relu6_to_relu:
        if _has_data(ctx):
            pinned = bound_clipped_scales(model, clipped, ctx)
            notes.append(f"{pinned} channels reaching a Clip max kept unscaled")
        else:
            pairs = [p for p in pairs if p.clip_max is None]
            notes.append(f"{len(clipped)} pairs joined by Clip(0, max) skipped (no calibration data)")
    if not pairs:
        return "; ".join(["no Conv/Gemm pairs to equalize"] + notes)
    params = _Params(pairs)
    sweeps, change = equalize(pairs, params, opts.steps)
    if opts.relu6_to_relu:
        clips = {c.name: c for p in pairs for c in p.between if c.op_type == "Clip" and p.clip_max is not None}
        relus = {name: _replace_clip(graph, clip) for name, clip in clips.items()}
        for pair in pairs:
            pair.between = [relus.get(n.name, n) for n in pair.between]
        if clips:
            notes.append(f"{len(clips)} Clip(0, max) replaced by Relu (float outputs change)")
    if opts.scale_append_bias:
        if _has_data(ctx):
            notes.append(absorb_high_biases(model, pairs, params, ctx))
        else:
            notes.append("high-bias absorption skipped (needs calibration data)")
    params.write(graph)
    head = (f"{len(pairs)} layer pair{'' if len(pairs) == 1 else 's'} equalized in {sweeps} "
            f"sweep{'' if sweeps == 1 else 's'} (last max |log s| {change:.1e})")
    return "; ".join([head] + notes)
