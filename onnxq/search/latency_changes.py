"""The changes the latency plan tries (`search/latency.py`), as a table: each makes a config
of the best one so far, or says it does not apply to the model (None).

Each is an ordinary config edit (float op types, excluded nodes, an op-type override), so
the plan it settles on is a config a user can save and run again.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from onnxq.config.presets import fp16
from onnxq.config.spec import Config, DType, QuantizationConfig, QuantizationSpec
from onnxq.plan import QuantPlan
from onnxq.plan.rules import OP_RULES
from onnxq.target.profile import gpu_first

# Ops with integer kernels: the work int8 is for.
KERNEL_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})

Make = Callable[[Config, ir.Graph, QuantPlan], "Config | None"]


@dataclass(frozen=True)
class Change:
    """One change to try: what the summary calls it, and the config it makes."""

    name: str
    make: Make


def links(plan: QuantPlan) -> set[str]:
    """Op types quantized only to carry int8 between kernels (Add, Mul, Concat, pooling,
    data movement): not the kernels, not a Relu/Clip absorbed into a kernel's output (kept
    float it costs a second rounding over the kernel's whole range: MobileNet-v1 fell from
    23 to 8 dB), not an op that stores a weight (an embedding Gather: float, it quadruples)."""
    return {op for name, op in plan.quantized_nodes.items()
            if op not in KERNEL_OPS and name not in plan.fused_activations
            and (op not in OP_RULES or OP_RULES[op].weight_input is None)}


def _float_types(config: Config, types: list[str]) -> Config | None:
    added = [t for t in types if t not in config.float_op_types and t not in config.layer_type_quant_config]
    return dataclasses.replace(config, float_op_types=[*config.float_op_types, *added]) if added else None


def _all_links(config: Config, graph: ir.Graph, plan: QuantPlan) -> Config | None:
    """Int8 only inside the kernels: onnxruntime's float fusions (Gelu, SkipLayerNorm)
    come back, and no int8 link op runs slower than its float one."""
    return _float_types(config, sorted(links(plan)))


def _one_link(op_type: str) -> Change:
    return Change(f"{op_type} kept float",
                  lambda config, graph, plan: _float_types(config, [op_type]) if op_type in links(plan) else None)


def _dynamic_matmul(config: Config, graph: ir.Graph, plan: QuantPlan) -> Config | None:
    """MatMul/Gemm with activations quantized at run time (onnxruntime's
    DynamicQuantizeMatMul): no Q/DQ between them and the float ops around them."""
    if _float16_weights(config):
        return None
    types = sorted({"MatMul", "Gemm"} & set(plan.quantized_nodes.values()))
    dynamic = QuantizationConfig(input_tensors=QuantizationSpec(dtype=DType.UINT8, symmetric=False, is_dynamic=True),
                                 output_tensors=QuantizationSpec(dtype=DType.FLOAT32))
    overrides = {t: dynamic for t in types if t not in config.layer_type_quant_config}
    if not overrides:
        return None
    return dataclasses.replace(config, layer_type_quant_config={**config.layer_type_quant_config, **overrides})


def depthwise(node: ir.Node) -> bool:
    """A grouped Conv with one input channel per group."""
    group = node.attributes.get("group")
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    return (group is not None and group.as_int() > 1 and weight is not None and weight.shape is not None
            and len(weight.shape) > 1 and weight.shape[1] == 1)


def _float16_weights(config: Config) -> bool:
    weight = config.global_quant_config.weight
    return weight is not None and weight.dtype is DType.FLOAT16


def _float16(config: Config, graph: ir.Graph, plan: QuantPlan) -> Config | None:
    """The FP16 preset's weights and compute, where the timing runs on a GPU provider: the
    CUDA provider has no fused int8 Conv/GEMM (a QDQ model runs Q/DQ + float kernels,
    1.1-2.6x float's time on an H200) while float16 runs its tensor cores. What the user
    set stays: calibration, exclusions, float op types (with the preset's), layer and op-type
    overrides, passes and algorithms (so the model timed, emitted from the run's state, is
    the one a run of this config writes), target and opset."""
    providers = config.calibration.providers
    if gpu_first(providers) is None or _float16_weights(config):
        return None
    half = fp16()
    return dataclasses.replace(
        half, calibration=config.calibration, exclude=config.exclude, target=config.target,
        optimize_for=config.optimize_for, opset=config.opset,
        float_op_types=list(dict.fromkeys([*half.float_op_types, *config.float_op_types])),
        layer_quant_config=config.layer_quant_config, layer_type_quant_config=config.layer_type_quant_config,
        pre_quant_opt_config=config.pre_quant_opt_config, algo_config=config.algo_config)


def _kernels_float(which: Callable[[ir.Node], bool]) -> Make:
    """Exclude the quantized kernels `which` picks (names escaped: `exclude` takes regexes)."""
    def make(config: Config, graph: ir.Graph, plan: QuantPlan) -> Config | None:
        names = [re.escape(n.name) for n in graph if n.name in plan.quantized_nodes and which(n)]
        names = [n for n in names if n not in config.exclude]
        return dataclasses.replace(config, exclude=[*config.exclude, *names]) if names else None
    return make


# In the order they are tried: float16 on a GPU provider (its fast format), the link ops
# (the kernels stay int8), then dynamic MatMuls, then whole kernel classes that int8 does
# not speed up on this CPU.
CHANGES: tuple[Change, ...] = (
    Change("float16 weights and compute (the FP16 preset; GPU providers)", _float16),
    Change("int8 only in Conv/MatMul/Gemm (the ops between them float)", _all_links),
    *(_one_link(op) for op in ("Add", "Mul", "Concat", "MaxPool", "AveragePool", "GlobalAveragePool",
                               "Sigmoid", "Transpose", "Reshape", "Div", "Sub")),
    Change("MatMul/Gemm dynamic int8", _dynamic_matmul),
    Change("depthwise Conv kept float", _kernels_float(lambda n: n.op_type == "Conv" and depthwise(n))),
    Change("other Conv kept float", _kernels_float(lambda n: n.op_type in ("Conv", "ConvTranspose")
                                                 and not depthwise(n))),
    Change("MatMul/Gemm kept float", _kernels_float(lambda n: n.op_type in ("MatMul", "Gemm"))),
)
