"""Quantization strategies: each claims the nodes it can lower, or refuses them with a reason.

The table and the answers a strategy gives are in `registry`; each built-in strategy is
one module here, imported below so that it registers. A new strategy is one module that
calls `register_strategy`, plus its lowering. A strategy's `claim(node, cfg, draft)` reads
and edits the plan under construction (`plan.draft.Draft`).
"""

from onnxq.plan.strategies import (  # noqa: F401  (imported to register)
    block_format,
    dynamic,
    float_target,
    gather_int4,
    matmul_nbits,
    static,
    weight_only,
)
from onnxq.plan.strategies.registry import (
    STRATEGIES,
    ClaimFn,
    Decision,
    Lower,
    Planned,
    Refuse,
    Strategy,
    ordered,
    register_strategy,
    weights_only,
)

__all__ = ["STRATEGIES", "ClaimFn", "Decision", "Lower", "Planned", "Refuse", "Strategy", "ordered",
           "register_strategy", "weights_only"]
