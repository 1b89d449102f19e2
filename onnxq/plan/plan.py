"""The quantization plan: what each tensor becomes and which strategy lowers each node.

Every type here is frozen. The planner builds a plan once; a later stage that changes a
decision (tensors dropped after calibration, nodes an emitter refused, a bias added by
bias correction) gets a new plan from one of the `with_*`/`without` methods, so each stage
can be read alone: what it receives is what the stage before it returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import DType
from onnxq.graph.selection import FLOAT_TYPES
from onnxq.numerics.qmath import qdq_opset

# Why a node whose outputs are all integers or booleans stays as it is: the summary lists
# such nodes on one line (a graph network's shape and index arithmetic had filled 20 of its
# 23 'left in float' lines, burying its ScatterND and ReduceMean).
INTEGER_ONLY = "integer or boolean outputs (shapes, indices, masks): nothing to quantize"
FLOAT_DTYPES = FLOAT_TYPES | {ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2, ir.DataType.FLOAT8E4M3FNUZ,
                              ir.DataType.FLOAT8E5M2FNUZ}

EMPTY: Mapping[Any, Any] = MappingProxyType({})


def frozen_map(mapping: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """A read-only copy of `mapping`."""
    return MappingProxyType(dict(mapping))


class Kind(Enum):
    ACTIVATION = "activation"  # calibrated, Q/DQ inserted at run time
    WEIGHT = "weight"  # quantized offline, stored as integers + DequantizeLinear
    BIAS = "bias"  # int32, scale = input scale x weight scale
    CONSTANT = "constant"  # constant input of an activation op: offline, per-tensor


Use = tuple[str, int]  # (node name, input index)


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor is quantized."""

    name: str
    kind: Kind
    spec: ResolvedSpec
    axis: int | None = None  # per-channel axis (weights), or the block axis when per-group
    block_size: int | None = None  # per-group weights: entries of `axis` sharing a scale
    alias_of: str | None = None  # shares the parameters of this activation
    bias_inputs: tuple[str, str] | None = None  # (activation, weight) whose scales make the bias scale
    consumers: tuple[Use, ...] = ()  # uses fed through DQ
    all_consumers: bool = False  # producer is quantized: every consumer and graph output gets DQ
    source: str | None = None  # the graph value, when `name` is a per-node key (shared biases)
    # Consumers that want this activation in another type (mixed precision): requantized.
    requant: Mapping[Use, ResolvedSpec] = field(default_factory=lambda: EMPTY)

    def __post_init__(self) -> None:
        object.__setattr__(self, "requant", frozen_map(self.requant))


@dataclass(frozen=True)
class Lowered:
    """A node claimed by a strategy other than static QDQ, with what its lowering needs."""

    strategy: str
    spec: ResolvedSpec | DType


@dataclass(frozen=True)
class Tie:
    """An embedding Gather whose table is the weight of a MatMul lowered to MatMulNBits,
    transposed: a tied embedding and LM head (`plan/tied.py`), stored once (`emit/tied.py`)."""

    head: str  # the MatMul node
    block_size: int | None  # the pair's block size; None: each stores its own copy
    reason: str = ""  # why the block size is not the configured group size, or why two copies


def qparams_key(spec: ResolvedSpec) -> tuple:
    """The spec fields that change scale and zero point (two specs with the same key share them)."""
    return (spec.dtype, spec.symmetric, spec.scale_type)


@dataclass(frozen=True)
class QuantPlan:
    tensors: Mapping[str, TensorPlan] = field(default_factory=lambda: EMPTY)
    quantized_nodes: Mapping[str, str] = field(default_factory=lambda: EMPTY)  # name -> op type
    float_nodes: Mapping[str, tuple[str, str]] = field(default_factory=lambda: EMPTY)  # name -> (op, reason)
    fused_activations: Mapping[str, str] = field(default_factory=lambda: EMPTY)  # activation node -> producer
    lowered: Mapping[str, Lowered] = field(default_factory=lambda: EMPTY)  # node -> strategy that lowers it
    float_tensors: Mapping[str, str] = field(default_factory=lambda: EMPTY)  # dropped after planning, with why
    tied: Mapping[str, Tie] = field(default_factory=lambda: EMPTY)  # embedding Gather -> the LM head it shares
    # quantized nodes whose constant weight the config keeps float -> why: Q/DQ on their
    # activations, float arithmetic (no integer kernel takes a float weight)
    float_weights: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # MatMuls `matmul_nbits` could not lower to MatMulNBits -> why (they run as DQ + MatMul)
    nbits_refused: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # nodes whose inputs the config quantizes but that read float ones (weight-only), because
    # onnxruntime cannot run the pair (`plan/kernel_pairs`) -> why
    float_inputs: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # weights quantized coarser than the config asks (per tensor, per channel) -> to what and why
    coarser_weights: Mapping[str, str] = field(default_factory=lambda: EMPTY)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, frozen_map(getattr(self, f.name)))

    # --- reading -----------------------------------------------------------------------

    def integer_nodes(self) -> dict[str, str]:
        """The quantized nodes but those with a float weight (`float_weights`): name -> op."""
        return {n: op for n, op in self.quantized_nodes.items() if n not in self.float_weights}

    def float_weight_nodes(self) -> dict[str, tuple[str, str]]:
        """The quantized nodes whose weight stays float: name -> (op, why)."""
        return {n: (op, self.float_weights[n]) for n, op in self.quantized_nodes.items() if n in self.float_weights}

    def nodes_for(self, strategy: str) -> dict[str, ResolvedSpec | DType]:
        """The nodes `strategy` lowers, with the spec each was claimed with, in graph order."""
        return {name: low.spec for name, low in self.lowered.items() if low.strategy == strategy}

    def specs(self) -> list[ResolvedSpec]:
        """Every spec a planned tensor is quantized with, its requantizations' included."""
        return [t.spec for t in self.tensors.values()] + [s for t in self.tensors.values() for s in t.requant.values()]

    def required_opset(self) -> int:
        """The lowest ai.onnx opset whose Q/DQ accept every planned type and granularity."""
        opsets = [qdq_opset(spec.dtype) for spec in self.specs()]
        opsets += [21 for t in self.tensors.values() if t.block_size]
        return max(opsets, default=13)

    def calibrated_tensors(self) -> dict[str, ResolvedSpec]:
        """Activation tensors that need an observer, in a stable order."""
        return {
            t.name: t.spec
            for t in self.tensors.values()
            if t.kind is Kind.ACTIVATION and t.alias_of is None
        }

    def root_of(self, name: str) -> str:
        """The calibrated tensor whose parameters `name` uses."""
        while self.tensors[name].alias_of is not None:
            name = self.tensors[name].alias_of
        return name

    # --- deriving a new plan ------------------------------------------------------------

    def without(self, names: set[str], reason: str) -> tuple[QuantPlan, list[str]]:
        """A plan with `names`, their aliases and the biases scaled by them left float,
        and the tensor names dropped."""
        doomed = sorted(n for n in self.tensors if self.root_of(n) in names)
        doomed_set = set(doomed)
        doomed += [t.name for t in self.tensors.values()
                   if t.bias_inputs is not None and t.bias_inputs[0] in doomed_set]
        gone = set(doomed)
        tensors = {n: t for n, t in self.tensors.items() if n not in gone}
        float_tensors = {**self.float_tensors, **{n: reason for n in doomed}}
        return dataclasses.replace(self, tensors=tensors, float_tensors=float_tensors), doomed

    def with_float_nodes(self, reasons: Mapping[str, str], op_types: Mapping[str, str]) -> QuantPlan:
        """A plan in which the nodes of `reasons` (planned quantized) stay float, with why."""
        if not reasons:
            return self
        quantized = {n: op for n, op in self.quantized_nodes.items() if n not in reasons}
        float_nodes = {**self.float_nodes, **{n: (op_types.get(n, "?"), r) for n, r in reasons.items()}}
        return dataclasses.replace(self, quantized_nodes=quantized, float_nodes=float_nodes)

    def with_quantized_nodes(self, names: Iterable[str], op_types: Mapping[str, str]) -> QuantPlan:
        """A plan that also counts `names` as quantized (converted by a lowering)."""
        added = {n: op_types.get(n, "?") for n in names}
        return dataclasses.replace(self, quantized_nodes={**self.quantized_nodes, **added}) if added else self

    def with_tensor(self, tensor: TensorPlan, replacing: str | None = None) -> QuantPlan:
        """A plan in which `tensor` is planned (instead of the tensor named `replacing`)."""
        tensors = {n: t for n, t in self.tensors.items() if n != replacing}
        tensors[tensor.name] = tensor
        return dataclasses.replace(self, tensors=tensors)
