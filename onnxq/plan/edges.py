"""The classes of layers a config gives their own specs: the first and last weighted layers
(`edge_weight`, `edge_input`) and the depthwise convolutions (`depthwise_weight`).

Low-bit weight recipes keep the first and the last weighted layer at 8 bits (the
protocol of AdaRound's and BRECQ's int4 results): the first layer reads the raw input
through few channels, the last writes the outputs. Float8 recipes keep the same two
layers' inputs float: float8's 3-bit mantissa drops the low bits of an input that came
from 8-bit data. `Config.edge_weight` and `Config.edge_input` name the weight and
input-activation specs for those two layers; each is applied as a node-level override
beneath the user's own node overrides (a field the user set for that node wins), above
op-type and global specs.
A run fixes its edge layers once (`prepare`); re-emissions (the accuracy-target search's
trials) reuse them, so promoting a layer to float never moves the edge. A weight tensor
shared by several layers is planned once, from its first consumer's spec.

Depthwise convolutions (every group reads one input channel) hold few weights each: 9 a
channel for a 3x3 kernel, which 4-bit codes fit poorly, and about 1% of a MobileNet's
weights. `depthwise_weight` is applied like the edge specs, beneath them: an edge layer
that is depthwise takes the edge spec.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnxq.config.resolve import resolve_node_config
from onnxq.config.spec import (
    EDGE_FIELDS,
    LAYER_CLASS_FIELDS,
    Config,
    QuantizationConfig,
    QuantizationSpec,
)
from onnxq.config.validate import check_resolved
from onnxq.errors import ConfigError
from onnxq.graph import layout
from onnxq.graph.fold import is_constant

WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def edge_layers(model: ir.Model, config: Config) -> list[ir.Node]:
    """The first and the last node (graph order) of a weighted op type with a constant
    weight, each only if the config quantizes its weight: an excluded or float first
    layer is not replaced by the next one (the protocol is about the model's ends)."""
    layers = [node for node in model.graph if node.op_type in WEIGHTED and len(node.inputs) > 1
              and is_constant(node.inputs[1])]
    ends = layers[:1] + layers[-1:] if len(layers) > 1 else layers
    return [node for node in ends if _weight_quantized(config, node)]


def _weight_quantized(config: Config, node: ir.Node) -> bool:
    resolved = resolve_node_config(config, node.name, node.op_type)
    return resolved is not None and resolved.weight is not None


def _edge_specs(config: Config) -> dict[str, QuantizationSpec]:
    """The tensor classes the config sets for the edge layers: {field of
    QuantizationConfig: spec}."""
    specs = {field: getattr(config, key) for key, field in EDGE_FIELDS.items()}
    return {field: spec for field, spec in specs.items() if spec is not None}


def depthwise_layers(model: ir.Model, config: Config) -> list[ir.Node]:
    """The Conv nodes with more than one group whose constant weight [M, 1, k...] gives
    each group one input channel, each only if the config quantizes its weight."""
    found = []
    for node in model.graph:
        if node.op_type != "Conv" or len(node.inputs) < 2 or layout.groups(node) < 2:
            continue
        if not is_constant(node.inputs[1]):
            continue
        shape = node.inputs[1].const_value.shape  # without reading the weight's bytes
        if len(shape) > 2 and shape[1] == 1 and _weight_quantized(config, node):
            found.append(node)
    return found


def _depthwise_taking(model: ir.Model, config: Config, edges: list[str]) -> list[str]:
    """The depthwise layers `depthwise_weight` applies to: an edge layer takes
    `edge_weight` whole where the config sets it, not a mix of the two."""
    if config.depthwise_weight is None:
        return []
    skip = set(edges) if config.edge_weight is not None else set()
    return [node.name for node in depthwise_layers(model, config) if node.name not in skip]


def with_edges(config: Config, model: ir.Model, names: list[str] | None = None) -> tuple[Config, list[str]]:
    """`config` with `edge_weight` and `edge_input` as node-level overrides of the edge
    layers, and `depthwise_weight` of the depthwise convolutions (`_depthwise_taking`), as
    a copy (the config itself is left alone); and the edge layers' names. `names`: the
    edge layers a run already chose (a re-emission must not move them). Unchanged without
    those fields."""
    specs = _edge_specs(config)
    if not specs and config.depthwise_weight is None:
        return config, []
    if names is None:
        names = [node.name for node in edge_layers(model, config)] if specs else []
    overrides = dict(config.layer_quant_config)
    for name in names:
        overrides[name] = _with_specs(overrides.get(name), specs)
    for name in _depthwise_taking(model, config, names):
        overrides[name] = _with_specs(overrides.get(name), {"weight": config.depthwise_weight})
    return dataclasses.replace(config, layer_quant_config=overrides), names


def _with_specs(own: QuantizationConfig | None, specs: dict[str, QuantizationSpec]) -> QuantizationConfig:
    """A node's own override with each of `specs` merged beneath its fields."""
    own = own or QuantizationConfig()
    return dataclasses.replace(own, **{field: _merged(getattr(own, field), spec) for field, spec in specs.items()})


def _merged(own: QuantizationSpec | None, edge: QuantizationSpec) -> QuantizationSpec:
    """The user's node-level spec with the fields it leaves unset taken from `edge`."""
    if own is None:
        return edge
    unset = {f.name: getattr(edge, f.name) for f in dataclasses.fields(own) if getattr(own, f.name) is None}
    return dataclasses.replace(own, **unset)


def apply_edges(config: Config, model: ir.Model) -> tuple[Config, list[str], list[tuple[str, tuple[str, ...]]]]:
    """`with_edges` for a run: the layers' resolved configs checked like any node
    override's (an int32 weight, per-group without a group size), under the config's own
    keys, and the summary's notes naming them, with the layers each note is about."""
    applied, names = with_edges(config, model)
    if applied is config:
        return applied, names, []
    ops = {node.name: node.op_type for node in model.graph}
    depthwise = _depthwise_taking(model, config, names)
    edge = _edge_specs(config)
    layers_of = {**{key: names for key in EDGE_FIELDS if getattr(config, key) is not None},
                 **({"depthwise_weight": depthwise} if depthwise else {})}
    for own, layers in layers_of.items():  # one at a time, so that an error names its own key
        alone = dataclasses.replace(config, **{key: None for key in LAYER_CLASS_FIELDS if key != own})
        try:
            check_resolved(with_edges(alone, model, names)[0], [(name, ops[name]) for name in layers])
        except ConfigError as exc:
            raise ConfigError(f"{own}: {exc}") from None
    said = []
    if names and edge:
        keys = " / ".join(key for key in EDGE_FIELDS if getattr(config, key) is not None)
        what = " and ".join(f"{_describe(spec)} {'weights' if field == 'weight' else 'inputs'}"
                            for field, spec in edge.items())
        said.append((f"{keys}: the first and last weighted layers ({', '.join(names)}) take {what}"
                     + _own_fields(config, names), tuple(names)))
    if depthwise:
        count = "the depthwise convolution" if len(depthwise) == 1 else f"the {len(depthwise)} depthwise convolutions"
        said.append((f"depthwise_weight: {count} take{'s' if len(depthwise) == 1 else ''} "
                     f"{_describe(config.depthwise_weight)} weights" + _own_fields(config, depthwise), tuple(depthwise)))
    return applied, names, said


def _own_fields(config: Config, layers: list[str]) -> str:
    """The note's word on the layers whose node overrides keep fields of their own."""
    own = [name for name in layers if name in config.layer_quant_config]
    return f"; the node overrides of {', '.join(own)} keep the fields they set" if own else ""


def _describe(spec: QuantizationSpec) -> str:
    """A spec in a few words: its dtype, bits, granularity and symmetry where set."""
    parts = [str(spec.dtype)] if spec.dtype is not None else []
    parts += [f"{spec.bits}-bit"] if spec.bits is not None else []
    parts += [str(spec.qscheme)] if spec.qscheme is not None else []
    if spec.symmetric is not None:
        parts.append("symmetric" if spec.symmetric else "asymmetric")
    return " ".join(parts) or "their own"
