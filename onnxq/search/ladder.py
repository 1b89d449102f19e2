"""The rungs a sensitive layer can be raised to, as ordinary node overrides of a config.

int8: the layer's weights in 8 bits (for recipes with 4-bit QDQ weights), the rest as configured;
int16: the layer's activations (inputs and output) in int16, its weights as configured;
fp16 / bf16: the layer computes in that float type; float: the layer stays float32.
A promoted config is a plain `Config` (node overrides in `layer_quant_config`), so the
result of a search can be saved and reused without searching again.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnxq.config.compose import deep_merge
from onnxq.config.io import config_from_dict, config_to_dict
from onnxq.config.spec import Config, DType
from onnxq.config.spec_rules import GRID_FIELDS
from onnxq.numerics.qmath import qdq_opset
from onnxq.plan import Kind, QuantPlan


def _rung_override(rung: str) -> dict[str, dict[str, str]]:
    """A node override, in the config-file shape, that raises a node to `rung`."""
    if rung == "int8":
        return {"weight": {"dtype": "int8", "bits": 8}}
    if rung == "int16":
        return {"input_tensors": {"dtype": "int16"}, "output_tensors": {"dtype": "int16"}}
    dtype = {"fp16": "float16", "bf16": "bfloat16", "float": "float32"}[rung]
    # The bias stays float32 (a bias spec takes int32 or float32): the float-type lowering
    # casts it with the node, as the FP16/BF16 presets do with no bias spec at all. A float
    # type has no grid: the node's own integer settings (bits, qscheme, ...) are cleared, so
    # that none is judged against the float type.
    spec = {"dtype": dtype, **dict.fromkeys(("bits", *GRID_FIELDS))}
    return {**{tc: dict(spec) for tc in ("input_tensors", "output_tensors", "weight")},
            "bias": {"dtype": "float32"}}


def narrow_weight_nodes(plan: QuantPlan) -> set[str]:
    """The nodes whose QDQ weight has fewer than 8 bits (int4/uint4, or `bits` below 8):
    what the int8 rung changes. Weight-only blocks (MatMulNBits, `plan.lowered`) are not
    among them: a tied LM head raised alone would unshare its table (W8_GROUP128 is their
    8-bit recipe)."""
    return {use[0] for t in plan.tensors.values()
            if t.kind is Kind.WEIGHT and (t.spec.dtype in (DType.INT4, DType.UINT4) or (t.spec.bits or 8) < 8)
            for use in t.consumers}


def applicable(rungs: list[str], plan: QuantPlan) -> list[str]:
    """The rungs that change something under `plan`: int8 only where `narrow_weight_nodes`."""
    narrow = bool(narrow_weight_nodes(plan))
    return [r for r in rungs if r != "int8" or narrow]


def effective(promotions: Mapping[str, str], plan: QuantPlan) -> dict[str, str]:
    """`promotions` less those that would not raise the node: int8 for a node without
    narrow weights (its weights are 8-bit already, or it has none), and int16 for a node
    that reads float inputs already (`plan.float_inputs`: a MatMul whose per-group weight
    no integer kernel pairs with int8 inputs), where 16-bit inputs would lower them, that
    reads only constants (`constant_only_nodes`), that quantizes its inputs at run time
    (`dynamic_nodes`) or whose inputs are 16-bit already (`sixteen_bit_nodes`)."""
    narrow = narrow_weight_nodes(plan)
    fixed = constant_only_nodes(plan) | dynamic_nodes(plan) | sixteen_bit_nodes(plan)
    return {node: rung for node, rung in promotions.items()
            if (rung != "int8" or node in narrow)
            and (rung != "int16" or (node not in plan.float_inputs and node not in fixed))}


def sixteen_bit_nodes(plan: QuantPlan) -> set[str]:
    """The nodes whose quantized activation inputs are all 16-bit already (A16W8): the
    int16 rung would score the same model again."""
    widths: dict[str, set[bool]] = {}
    for t in plan.tensors.values():
        if t.kind is Kind.ACTIVATION:
            for node, _ in t.consumers:
                widths.setdefault(node, set()).add(t.spec.dtype in (DType.INT16, DType.UINT16))
    return {node for node, wide in widths.items() if wide == {True}}


def dynamic_nodes(plan: QuantPlan) -> set[str]:
    """The nodes lowered to dynamic kernels (activations quantized at run time): onnxruntime
    quantizes them to uint8, so the int16 rung has no 16-bit form to give them (its config
    is refused)."""
    return set(plan.nodes_for("dynamic"))


def constant_only_nodes(plan: QuantPlan) -> set[str]:
    """The nodes whose quantized inputs are all constants (an embedding Gather's table):
    the int16 rung would widen the table, a weight in all but name (MiniLM's word
    embeddings: +11.9 MB), and no activation."""
    reads = {kind: {use[0] for t in plan.tensors.values() if t.kind is kind for use in t.consumers}
             for kind in (Kind.CONSTANT, Kind.ACTIVATION)}
    return reads[Kind.CONSTANT] - reads[Kind.ACTIVATION]


def rung_opset(ladder: list[str]) -> int:
    """The ai.onnx opset the ladder's types need (int16 Q/DQ: 21)."""
    return max((qdq_opset(DType.INT16) for r in ladder if r == "int16"), default=13)


def with_promotions(config: Config, promotions: Mapping[str, str]) -> Config:
    """`config` with each promoted node overridden to its rung, merged over any override it
    had field by field (a rung changes only what it names), as a config file would be."""
    if not promotions:
        return config
    overrides = {node: _rung_override(rung) for node, rung in promotions.items()}
    return config_from_dict(deep_merge(config_to_dict(config), {"layer_quant_config": overrides}))
