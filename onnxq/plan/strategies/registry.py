"""The strategies table: what a strategy answers for a node, and `register_strategy`.

The planner offers every node to the registered strategies in `order`. A strategy answers
with `Lower(spec)` (the node goes to the lowering registered under the strategy's name,
`emit.LOWERINGS`), `Refuse(reason)` (the node stays float, and the summary says why),
`Planned()` (the strategy recorded the node's tensors in the draft itself: static QDQ), or
None (not its node: ask the next).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from onnxq.config.resolve import ResolvedConfig, ResolvedSpec
from onnxq.config.spec import DType
from onnxq.plan.draft import Draft


@dataclass(frozen=True)
class Lower:
    spec: ResolvedSpec | DType


@dataclass(frozen=True)
class Refuse:
    reason: str


@dataclass(frozen=True)
class Planned:
    pass


Decision = Lower | Refuse | Planned | None
ClaimFn = Callable[[ir.Node, ResolvedConfig, Draft], Decision]


@dataclass(frozen=True)
class Strategy:
    name: str
    order: int  # lower is asked first
    claim: ClaimFn
    counted: bool  # a node it lowers counts as quantized at once (else: once the lowering converts it)


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str, order: int, counted: bool = True) -> Callable[[ClaimFn], ClaimFn]:
    """Register `claim` as the strategy `name`, asked before those of higher `order`."""
    def decorate(fn: ClaimFn) -> ClaimFn:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is already registered")
        STRATEGIES[name] = Strategy(name, order, fn, counted)
        return fn
    return decorate


def weights_only(cfg: ResolvedConfig) -> bool:
    """No static activation quantization: weight-only or dynamic."""
    return cfg.input_tensors is None or cfg.input_tensors.is_dynamic


def ordered() -> list[Strategy]:
    """The registered strategies in the order they are asked."""
    return sorted(STRATEGIES.values(), key=lambda s: (s.order, s.name))
