"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights.

For y = x W, x W == (x / s)(s W) for any per-input-channel s > 0. Choosing
s_j = max|x_j|^alpha / max|W_j|^(1-alpha) flattens the few outlier channels that make
per-tensor activation quantization coarse, at the price of wider weight rows (which
per-channel weight quantization absorbs well). alpha = 0.5 splits the difficulty evenly.

Consumers sharing one activation (Q/K/V after a LayerNorm) get one s, from the max over
all their weights. The 1/s goes, in order of preference:
- into the producer, when every consumer that reads values is smoothed: a
  LayerNormalization (scale, bias), a MatMul/Gemm/Conv with a constant weight (output
  channels, bias), a Mul/Div by a constant, or, through Relu/pooling or an Add/Sub of a
  constant, whatever produces their input;
- otherwise (`insert_mul`, the default) into a Mul by 1/s inserted before the smoothed
  consumers. That Mul only pays off when it runs in float (quantized, its input keeps the
  outliers and its constant 1/s loses precision), so the pass marks it to stay float
  through `PassResult.keep_float`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.errors import ConfigError
from onnxq.graph import layout
from onnxq.graph.edit import GraphEditor, set_constant
from onnxq.graph.fold import constant_array
from onnxq.optimize.context import Deferred, PassContext, PassResult, Rescale
from onnxq.optimize.options import parse_options
from onnxq.optimize.registry import register_pass

SMOOTHABLE = {"MatMul", "Gemm", "Conv"}
SHAPE_ONLY = {"Shape", "Size"}  # consumers that never read values
# Ops with f(x / s) == f(x) / s per channel for s > 0: 1/s passes through to their input.
HOMOGENEOUS = {"Relu", "LeakyRelu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Identity"}
SCALE_RANGE = (1e-5, 1e5)


@dataclass(frozen=True)
class SmoothQuantConfig:
    """Options of the `smoothquant` pass.

    alpha: migration strength in [0, 1] (`migration_strength`, in [0.2, 0.8], is an alias).
    op_types: consumer types smoothed (MatMul, Gemm, Conv with group 1).
    insert_mul: when the producer cannot absorb 1/s, insert a Mul (else leave the layers).
    skip_layers: consumer node names left alone.
    """

    ALGORITHM: ClassVar[str] = "smoothquant"

    alpha: float = 0.5
    op_types: tuple[str, ...] = ("MatMul", "Gemm")
    insert_mul: bool = True
    skip_layers: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"smoothquant: alpha must be in [0, 1], got {self.alpha}")
        unknown = sorted(set(self.op_types) - SMOOTHABLE)
        if unknown:
            raise ConfigError(f"smoothquant: cannot smooth {unknown}; op_types may hold {sorted(SMOOTHABLE)}")


def _parse(options: Mapping[str, Any]) -> SmoothQuantConfig:
    options = dict(options)
    if "migration_strength" in options:
        strength = options.pop("migration_strength")
        if "alpha" in options:
            raise ConfigError("smoothquant: give alpha or migration_strength, not both")
        if not isinstance(strength, int | float) or not 0.2 <= strength <= 0.8:
            raise ConfigError(f"smoothquant: migration_strength must be in [0.2, 0.8], got {strength!r}")
        options["alpha"] = float(strength)
    return parse_options(SmoothQuantConfig, options, "smoothquant")


@dataclass
class Consumer:
    """A layer reading the activation: its weight and which weight axis is the input channel."""

    node: ir.Node
    weight_axis: int
    act_axis: int  # input-channel axis of the activation (negative: from the end)


def _consumer(node: ir.Node, op_types: tuple[str, ...], skip: tuple[str, ...]) -> Consumer | None:
    if node.op_type not in op_types or node.domain not in ("", "ai.onnx") or node.name in skip:
        return None
    if len(node.inputs) < 2 or constant_array(node.inputs[0]) is not None:
        return None
    w = constant_array(node.inputs[1])
    if w is None or w.dtype.kind != "f":
        return None
    if node.op_type == "MatMul" and w.ndim != 2:
        return None
    if node.op_type == "Conv" and layout.groups(node) != 1:
        return None
    rank = w.ndim
    return Consumer(node, layout.weight_in_axis(node, rank), layout.act_channel_axis(node, rank))


def find_groups(graph: ir.Graph, opts: SmoothQuantConfig) -> dict[str, list[Consumer]]:
    """Smoothable consumers grouped by the activation they read (input 0)."""
    groups: dict[str, list[Consumer]] = {}
    for node in graph:
        consumer = _consumer(node, opts.op_types, opts.skip_layers)
        if consumer is None:
            continue
        act = node.inputs[0]
        group = groups.setdefault(act.name, [])
        if not group or group[0].act_axis == consumer.act_axis:
            group.append(consumer)
    return groups


def smoothing_scales(xmax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_j|^(1 - alpha); 1 for dead channels; clamped."""
    alive = (xmax > 0) & (wmax > 0)
    s = np.power(np.where(alive, xmax, 1.0), alpha) / np.power(np.where(alive, wmax, 1.0), 1.0 - alpha)
    return np.clip(np.where(alive, s, 1.0), *SCALE_RANGE)


def _weight_absmax(consumer: Consumer) -> np.ndarray:
    w = np.abs(constant_array(consumer.node.inputs[1]).astype(np.float64))
    return w.max(axis=tuple(i for i in range(w.ndim) if i != consumer.weight_axis))


# An edit multiplies input `index` of `node` by `factor` (broadcasting).
Edit = tuple[ir.Node, int, np.ndarray]


def _const_input(node: ir.Node) -> tuple[int, np.ndarray] | None:
    consts = [(i, constant_array(v)) for i, v in enumerate(node.inputs[:2])]
    found = [(i, a) for i, a in consts if a is not None]
    return found[0] if len(found) == 1 and len(node.inputs) == 2 else None


def fold_edits(value: ir.Value, factor: np.ndarray, axis: int) -> tuple[list[Edit], list[ir.Value]] | None:
    """Edits that make `value` come out multiplied by `factor` along `axis`, and every
    tensor they scale (the producer chain down to `value`); None when it cannot."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or value is not node.outputs[0]:
        return None
    f = layout.along(factor, axis)
    op = node.op_type
    if op in HOMOGENEOUS and len(node.outputs) == 1:
        inner = node.inputs[0]
        if inner is None or inner.is_graph_output() or len(inner.uses()) != 1:
            return None
        found = fold_edits(inner, factor, axis)
        return None if found is None else (found[0], found[1] + [value])
    edits = _own_edits(node, op, factor, f, axis)
    if edits is not None:
        return edits, [value]
    found = _const_input(node)
    if found is None or op not in ("Add", "Sub"):
        return None
    index = found[0]
    other = node.inputs[1 - index]
    if other.is_graph_output() or len(other.uses()) != 1:
        return None
    inner = fold_edits(other, factor, axis)
    return None if inner is None else (inner[0] + [(node, index, f)], inner[1] + [value])


def _own_edits(node: ir.Node, op: str, factor: np.ndarray, f: np.ndarray, axis: int) -> list[Edit] | None:
    """Edits of `node`'s own constants that scale its output by `factor`, or None."""
    if op == "Conv":
        w = constant_array(node.inputs[1])
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if w is None or axis != 1 - w.ndim or (bias is not None and constant_array(bias) is None):
            return None
        return [(node, 1, layout.out_channel_factor(node, w.shape, factor))] + \
            ([(node, 2, factor)] if bias is not None else [])
    if op == "LayerNormalization":
        if axis != -1 or layout.attr(node, "axis", -1) != -1 or constant_array(node.inputs[1]) is None:
            return None
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and constant_array(bias) is None:
            return None
        return [(node, 1, f)] + ([(node, 2, f)] if bias is not None else [])
    if op in ("MatMul", "Gemm"):
        w = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if w is None or w.ndim != 2 or axis != -1 or constant_array(node.inputs[0]) is not None:
            return None
        edits = [(node, 1, layout.out_channel_factor(node, w.shape, factor))]
        if op == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            if constant_array(node.inputs[2]) is None:
                return None
            edits.append((node, 2, factor))
        return edits
    found = _const_input(node)
    if found is not None and op == "Mul":
        return [(node, found[0], f)]
    if found is not None and op == "Div" and found[0] == 1:
        return [(node, 1, 1.0 / f)]
    return None


def _apply(graph: ir.Graph, edits: list[Edit]) -> None:
    for node, index, factor in edits:
        current = constant_array(node.inputs[index])
        new = (current.astype(np.float64) * factor).astype(current.dtype)
        set_constant(graph, node, index, new, f"{node.name}_smoothquant")


def _insert_mul(graph: ir.Graph, value: ir.Value, channels: int, axis: int, readers: list[ir.Node]) -> ir.Node:
    """Feed `readers` with value * factor (a new Mul, factor 1 until `finish_group`)."""
    edit = GraphEditor(graph)
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    const = edit.initializer(f"{value.name}_smoothquant_scale", layout.along(np.ones(channels), axis).astype(dtype))
    out = edit.add_node("Mul", [value, const], f"{value.name}_smoothquant", dtype=value.dtype, shape=value.shape)
    for node in readers:
        node.replace_input_with(0, out)
    return out.producer()


def _readers(value: ir.Value) -> list[ir.Node]:
    """Distinct nodes that read the values of `value` (not just its shape)."""
    seen: dict[int, ir.Node] = {}
    for use in value.uses():
        if use.node.op_type not in SHAPE_ONLY:
            seen[id(use.node)] = use.node
    return list(seen.values())


@dataclass
class Group:
    """Where one activation's 1/s goes: folded into its producer chain, or a Mul."""

    value: ir.Value
    consumers: list[Consumer]
    mul: ir.Node | None  # the inserted Mul, or None when folding
    rescaled: list[ir.Value]  # the tensors 1/s scales

    @property
    def axis(self) -> int:
        return self.consumers[0].act_axis

    @property
    def read(self) -> ir.Value:
        """What the consumers read: the Mul's output, or the activation (same values until finished)."""
        return self.value if self.mul is None else self.mul.outputs[0]


def place_group(graph: ir.Graph, value: ir.Value, consumers: list[Consumer], insert_mul: bool,
                keep_float: dict[str, str] | None = None) -> Group | None:
    """Decide, from the graph alone, where the group's 1/s goes; insert its Mul (factor 1)
    when the producer cannot absorb it. None when neither is possible."""
    axis = consumers[0].act_axis
    channels = _weight_absmax(consumers[0]).shape[0]
    nodes = {id(c.node) for c in consumers}
    others = [n for n in _readers(value) if id(n) not in nodes]
    chain = None if others or value.is_graph_output() else fold_edits(value, np.ones(channels), axis)
    if chain is not None:
        return Group(value, consumers, None, chain[1])
    if not insert_mul:
        return None
    mul = _insert_mul(graph, value, channels, axis, [c.node for c in consumers])
    if keep_float is not None:
        keep_float[mul.name] = "SmoothQuant scaling; quantized it would bring the outliers back"
    return Group(value, consumers, mul, [mul.outputs[0]])


def finish_group(graph: ir.Graph, group: Group, s: np.ndarray) -> tuple[str, np.ndarray]:
    """Scale the consumers' weights by s and the activation by 1/s: how, and the factor
    the rescaled tensors now carry (exactly the Mul's constant when one was inserted)."""
    axis = group.axis
    if group.mul is None:
        edits, _ = fold_edits(group.value, 1.0 / s, axis)
        _apply(graph, edits)
        how, factor = f"folded into {edits[0][0].op_type}", 1.0 / s  # the layer absorbing 1/s
    else:
        dtype = group.value.dtype.numpy() if group.value.dtype is not None else np.float32
        constant = layout.along(1.0 / s, axis).astype(dtype)
        set_constant(graph, group.mul, 1, constant, f"{group.value.name}_smoothquant_scale")
        how, factor = "Mul inserted", constant.reshape(-1)
    for c in group.consumers:
        w = constant_array(c.node.inputs[1])
        shape = [1] * w.ndim
        shape[c.weight_axis] = -1
        set_constant(graph, c.node, 1, (w.astype(np.float64) * s.reshape(shape)).astype(w.dtype),
                     f"{c.node.name}_smoothquant_weight")
    return how, factor


def _unplace(group: Group, keep_float: dict[str, str]) -> None:
    """Undo a group's inserted Mul (its consumers read the activation again)."""
    if group.mul is not None:
        for c in group.consumers:
            c.node.replace_input_with(0, group.value)
        keep_float.pop(group.mul.name, None)


@register_pass("smoothquant", options=_parse, data="required", rewrites=("weights", "graph", "activations"))
def smoothquant(model: ir.Model, opts: SmoothQuantConfig, ctx: PassContext) -> str | PassResult:
    """Migrate activation outliers of MatMul/Gemm inputs into their weights (module doc).

    The channel maxima are read from the model before scaling, so the pass defers its
    second half to the calibration pass when it may (`optimize.Deferred`)."""
    graph = model.graph
    groups = find_groups(graph, opts)
    if not groups:
        return "no MatMul/Gemm with a constant weight to smooth"
    if not ctx.settings.access.readable:  # e.g. `onnxq inspect`
        return f"{sum(map(len, groups.values()))} layers could be smoothed; skipped (needs calibration data)"
    values = {v.name: v for node in graph for v in node.inputs if v is not None and v.name in groups}
    keep_float: dict[str, str] = {}  # the inserted Muls, handed back with the result
    placed = {name: place_group(graph, values[name], consumers, opts.insert_mul, keep_float)
              for name, consumers in groups.items()}
    # Asked of what the consumers read, which the calibration pass also reduces per channel.
    stats = {name: Statistic(g.read.name, "absmax", g.axis) for name, g in placed.items() if g is not None}
    graph.sort()  # inserted Muls go before their consumers
    deferred = ctx.may_defer

    def finish(found: Mapping[Statistic, np.ndarray | None]) -> tuple[str, dict[str, Rescale]]:
        counts: dict[str, int] = {}
        rescaled: dict[str, Rescale] = {}
        layers = 0
        for name, group in placed.items():
            xmax = found.get(stats[name]) if name in stats else None
            wmax = None if group is None else np.max([_weight_absmax(c) for c in group.consumers], axis=0)
            if group is None or xmax is None or xmax.shape != wmax.shape:
                if group is not None and not deferred:
                    _unplace(group, keep_float)
                counts["skipped"] = counts.get("skipped", 0) + 1
                continue
            how, factor = finish_group(graph, group, smoothing_scales(xmax, wmax, opts.alpha))
            rescaled.update({v.name: (group.axis, factor) for v in group.rescaled})
            counts[how] = counts.get(how, 0) + 1
            layers += len(group.consumers)
        detail = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        smoothed = sum(n for k, n in counts.items() if k != "skipped")
        return f"{layers} layer{'s' * (layers != 1)} smoothed in {smoothed} group{'s' * (smoothed != 1)} (alpha {opts.alpha:g}): {detail}", rescaled

    rescalable = {v.name: g.axis for g in placed.values() if g is not None for v in g.rescaled}
    if deferred:
        return PassResult(None, keep_float, Deferred("smoothquant", tuple(stats.values()), rescalable, finish))
    return PassResult(finish(ctx.collect(model, list(stats.values()), "smoothquant"))[0], keep_float)
