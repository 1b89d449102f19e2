"""The first and last weighted layers, and the config that gives them `edge_weight`.

Low-bit weight recipes keep the first and the last weighted layer at 8 bits (the
protocol of AdaRound's and BRECQ's int4 results): the first layer reads the raw input
through few channels, the last writes the outputs. `Config.edge_weight` names the weight
spec for those two layers; it is applied as a node-level override beneath the user's own
node overrides (a field the user set for that node wins), above op-type and global specs.
A run fixes its edge layers once (`prepare`); re-emissions (the accuracy-target search's
trials) reuse them, so promoting a layer to float never moves the edge. A weight tensor
shared by several layers is planned once, from its first consumer's spec.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnxq.config.resolve import resolve_node_config
from onnxq.config.spec import Config, QuantizationConfig, QuantizationSpec
from onnxq.config.validate import check_resolved
from onnxq.errors import ConfigError
from onnxq.graph.fold import constant_array

WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def edge_layers(model: ir.Model, config: Config) -> list[ir.Node]:
    """The first and the last node (graph order) of a weighted op type with a constant
    weight, each only if the config quantizes its weight: an excluded or float first
    layer is not replaced by the next one (the protocol is about the model's ends)."""
    layers = [node for node in model.graph if node.op_type in WEIGHTED and len(node.inputs) > 1
              and constant_array(node.inputs[1]) is not None]
    ends = layers[:1] + layers[-1:] if len(layers) > 1 else layers
    return [node for node in ends if _weight_quantized(config, node)]


def _weight_quantized(config: Config, node: ir.Node) -> bool:
    resolved = resolve_node_config(config, node.name, node.op_type)
    return resolved is not None and resolved.weight is not None


def with_edge_weight(config: Config, model: ir.Model, names: list[str] | None = None) -> tuple[Config, list[str]]:
    """`config` with `edge_weight` as node-level weight overrides of the edge layers (a
    copy; the config itself is left alone), and their names. `names`: the layers a run
    already chose (a re-emission must not move them). Unchanged without `edge_weight`."""
    if config.edge_weight is None:
        return config, []
    if names is None:
        names = [node.name for node in edge_layers(model, config)]
    overrides = dict(config.layer_quant_config)
    for name in names:
        own = overrides.get(name)
        weight = _merged(own.weight if own is not None else None, config.edge_weight)
        overrides[name] = dataclasses.replace(own, weight=weight) if own is not None else QuantizationConfig(
            weight=weight)
    return dataclasses.replace(config, layer_quant_config=overrides), names


def _merged(own: QuantizationSpec | None, edge: QuantizationSpec) -> QuantizationSpec:
    """The user's node-level weight spec with the fields it leaves unset taken from `edge`."""
    if own is None:
        return edge
    unset = {f.name: getattr(edge, f.name) for f in dataclasses.fields(own) if getattr(own, f.name) is None}
    return dataclasses.replace(own, **unset)


def apply_edge_weight(config: Config, model: ir.Model) -> tuple[Config, list[str], str | None]:
    """`with_edge_weight` for a run: the edge layers' resolved configs checked like any
    node override's (an int32 weight, per-group without a group size), under the config's
    own key, and the summary's note naming them (None without edge layers)."""
    config, names = with_edge_weight(config, model)
    if not names:
        return config, names, None
    ops = {node.name: node.op_type for node in model.graph}
    try:
        check_resolved(config, [(name, ops[name]) for name in names])
    except ConfigError as exc:
        raise ConfigError(f"edge_weight: {exc}") from None
    return config, names, (f"edge_weight: the first and last weighted layers ({', '.join(names)}) take "
                           f"{_describe(config.edge_weight)} weights")


def _describe(spec: QuantizationSpec) -> str:
    """A weight spec in a few words: its dtype, granularity and symmetry where set."""
    parts = [str(getattr(spec, name)) for name in ("dtype", "qscheme") if getattr(spec, name) is not None]
    if spec.symmetric is not None:
        parts.append("symmetric" if spec.symmetric else "asymmetric")
    return " ".join(parts) or "their own"
