"""The plan while the planner builds it: the tables a `QuantPlan` freezes, what the
strategies read to fill them (the nodes by name, the config, the target), and the edits
they make (`plan/strategies`)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import Config, DType
from onnxq.plan.plan import (
    FLOAT_DTYPES,
    INTEGER_ONLY,
    Kind,
    Lowered,
    QuantPlan,
    TensorPlan,
    Tie,
    qparams_key,
)
from onnxq.target.narrowing import target_weight_spec
from onnxq.target.profile import TargetProfile

# The tables of a `QuantPlan` that the planner fills, in its field order.
TABLES = ("tensors", "quantized_nodes", "float_nodes", "fused_activations", "lowered", "tied", "float_weights", "nbits_refused",
          "float_inputs", "coarser_weights")


@dataclasses.dataclass
class Draft:
    """The plan under construction (frozen into a `QuantPlan` by `freeze`)."""

    nodes: dict[str, ir.Node]
    config: Config
    target: TargetProfile | None
    tensors: dict[str, TensorPlan] = dataclasses.field(default_factory=dict)
    quantized_nodes: dict[str, str] = dataclasses.field(default_factory=dict)
    float_nodes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    fused_activations: dict[str, str] = dataclasses.field(default_factory=dict)
    lowered: dict[str, Lowered] = dataclasses.field(default_factory=dict)
    tied: dict[str, Tie] = dataclasses.field(default_factory=dict)
    float_weights: dict[str, str] = dataclasses.field(default_factory=dict)
    nbits_refused: dict[str, str] = dataclasses.field(default_factory=dict)
    float_inputs: dict[str, str] = dataclasses.field(default_factory=dict)
    coarser_weights: dict[str, str] = dataclasses.field(default_factory=dict)

    def update(self, name: str, **changes: object) -> TensorPlan:
        """Replace the planned tensor `name` by a copy with `changes`."""
        tensor = self.tensors[name] = dataclasses.replace(self.tensors[name], **changes)
        return tensor

    def add_use(self, value: ir.Value, kind: Kind, spec: ResolvedSpec, node: ir.Node, index: int,
                axis: int | None = None) -> TensorPlan:
        """Plan `value` as input `index` of `node` (an activation read in another type than
        its own is requantized for this use)."""
        tensor = self.tensors.setdefault(value.name, TensorPlan(value.name, kind, spec, axis=axis))
        use = (node.name, index)
        requant = tensor.requant
        if kind is Kind.ACTIVATION and qparams_key(spec) != qparams_key(tensor.spec):
            requant = {**requant, use: spec}
        return self.update(value.name, consumers=(*tensor.consumers, use), requant=requant)

    def add_output(self, value: ir.Value, spec: ResolvedSpec, alias_of: str | None = None) -> None:
        """Plan `value` as the quantized output of its producer (read by every consumer)."""
        self.tensors.setdefault(value.name, TensorPlan(value.name, Kind.ACTIVATION, spec))
        self.update(value.name, spec=spec, alias_of=alias_of, all_consumers=True)

    def quantized(self, node: ir.Node) -> None:
        self.quantized_nodes[node.name] = node.op_type

    def float_node(self, node: ir.Node, reason: str, as_given: bool = False) -> None:
        """Keep `node` float for `reason`; a node whose outputs are all integers or booleans
        (shape and index arithmetic) for `INTEGER_ONLY`, unless the reason is `as_given`
        (the caller's: an already quantized kernel, a config's exclusion)."""
        if not as_given and node.outputs and all(v.dtype is not None and v.dtype not in FLOAT_DTYPES
                                                 for v in node.outputs):
            reason = INTEGER_ONLY
        self.float_nodes[node.name] = (node.op_type, reason)

    def lower(self, node: ir.Node, strategy: str, spec: ResolvedSpec | DType) -> None:
        """Record that `strategy` lowers `node` with `spec`."""
        self.lowered[node.name] = Lowered(strategy, spec)

    def target_weight_spec(self, spec: ResolvedSpec, kernel: str, activation: ResolvedSpec | None,
                           k_axes: tuple[int, ...] | None = None) -> ResolvedSpec:
        """`spec` as the target's `kernel` can run it (`target.narrowing`)."""
        return target_weight_spec(self.target, spec, kernel, activation, k_axes)

    def freeze(self) -> QuantPlan:
        return QuantPlan(**{name: getattr(self, name) for name in TABLES})
