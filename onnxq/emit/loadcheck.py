"""Never write a model onnxruntime cannot load.

After emission the model is opened in a default `onnxruntime.InferenceSession` (all
graph optimisations, the user's providers), as a deployment would open it. If that
fails, the quantized nodes responsible are found by bisection over the planned nodes,
each trial re-emitting from the pre-emission model with some nodes kept float and
asking onnxruntime again, so no decision reads onnxruntime's error text. The culprits
stay float and the summary says so.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.session import open_session, refusal
from onnxq.errors import OnnxqError
from onnxq.runtime import options_for

UNLOADABLE = "onnxruntime cannot load this node quantized (default session options)"
MAX_CULPRITS = 64
# A model with more float weights than this whose load-check session runs nothing (no
# output check) is opened without the kernels' prepacking: their packed copies of the
# weights add to what the session holds (a 1.1B-parameter Llama's 0.55 GB of int4
# MatMulNBits weights, accuracy level 4: the session adds 0.85-1.0 GB with them, 0.6 GB
# without), for a session that only proves the graph loads (its kernels, types, shapes).
PREPACK_ALWAYS_BYTES = 256 << 20


def prepacks(model_bytes: int, runs_samples: bool) -> bool:
    """Whether the load check's session prepacks the weights (see `PREPACK_ALWAYS_BYTES`)."""
    return runs_samples or model_bytes <= PREPACK_ALWAYS_BYTES


def open_deployed(model: ir.Model, providers: list[str], prepack: bool = True) -> ort.InferenceSession | None:
    """A default session (all optimisations) of `model` on `providers`, None if
    onnxruntime cannot open it; without `prepack`, kernels keep the weights as they are
    (the session runs, slower, on another path: for a check that only opens it)."""
    options = options_for(model, _options(prepack))
    try:
        return open_session(model, options, providers)
    except OnnxqError:
        raise  # an unavailable provider is the user's to fix, not the model's
    except Exception:  # onnxruntime raises several unrelated types; any failure counts
        return None


def _options(prepack: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def load_error(model: ir.Model, providers: list[str], prepack: bool = True) -> str | None:
    """What onnxruntime says when it cannot open `model` as `open_deployed` does, first line
    and without its error-code prefix (for the summary only: no decision reads it); None
    where it opens."""
    try:
        open_session(model, options_for(model, _options(prepack)), providers)
    except OnnxqError:
        raise
    except Exception as exc:  # noqa: BLE001  onnxruntime raises several unrelated types
        return refusal(str(exc) or type(exc).__name__)
    return None


def model_loads(model: ir.Model, providers: list[str], prepack: bool = True) -> bool:
    """Whether a default session (all optimisations) opens `model` on `providers`."""
    return open_deployed(model, providers, prepack) is not None


@dataclass
class Trial:
    """One emission with some nodes kept float: the model and whether it loads."""

    model: ir.Model
    loads: bool
    payload: object = None


def find_culprits(candidates: list[Hashable], emit: Callable[[set], Trial],
                  explain: Callable[[ir.Model], str | None] | None = None) -> tuple[Trial, list]:
    """Smallest set of `candidates` to keep float so that `emit(kept_float)` loads.

    Candidates are node names (quantized emission) or (op type, type) pairs (float cast).
    `explain`: onnxruntime's refusal of a model, said where not even the all-float one loads.

    Culprits are found one at a time: the shortest prefix of the remaining candidates
    (in graph order) that fails when quantized alone ends at a culprit. Each culprit
    costs about log2(len(candidates)) trials.
    """
    culprits: list[str] = []
    remaining = list(candidates)
    every = emit(set(remaining))
    if not every.loads:
        said = explain(every.model) if explain is not None else None
        raise OnnxqError(
            "onnxruntime cannot load this model even with every quantized node kept float"
            + (f" (onnxruntime: {said})" if said else "")
            + "; check that the float model loads in a default onnxruntime session"
        )
    while True:
        trial = emit(set(culprits))
        if trial.loads:
            return trial, culprits
        if not remaining or len(culprits) >= MAX_CULPRITS:
            raise OnnxqError(
                "onnxruntime cannot load the quantized model even with "
                f"{len(culprits)} nodes kept float; check that the float model loads in onnxruntime, "
                "or exclude the failing op types (--exclude)"
            )
        lo, hi = 1, len(remaining)  # the prefix remaining[:hi] is known to fail
        while lo < hi:
            mid = (lo + hi) // 2
            if emit(set(culprits) | set(remaining[mid:])).loads:
                lo = mid + 1
            else:
                hi = mid
        culprits.append(remaining[hi - 1])
        remaining = remaining[hi:]
