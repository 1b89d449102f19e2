"""What a pass or algorithm reads, and what it hands back.

A stage of `optimize/` takes read-only inputs (`RunSettings`, and a context frozen for its
one call) and returns its result (`PassResult`, `AlgorithmResult`): what must stay float,
what it deferred, which biases it fitted. It writes into no state of another stage; the
runner (`optimize/runner.py`) merges each result into its own record, and the pipeline
reads the runner's returned outcome. The model itself is rewritten in place: that is
what a pass is for.

A pass whose statistics can be read from the model before it runs (SmoothQuant's channel
maxima) may defer its data-dependent half when it is the last pass: it makes its
structural edits with neutral values and returns a `Deferred`; the calibration pass
collects its statistics together with the ranges, and `finish` then writes the real
values and says which tensors it scaled per channel, so their ranges follow exactly
(`calibrate/rescale.py`) instead of costing a second pass over the data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.access import Access, data_access
from onnxq.calibrate.data import CalibrationSource
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError
from onnxq.plan import QuantPlan
from onnxq.plan.params import WeightCache
from onnxq.plan.plan import EMPTY

# A tensor a pass scaled per channel: its values became old * factor along axis (factor > 0).
Rescale = tuple[int, np.ndarray]
Statistics = Mapping[Statistic, "np.ndarray | None"]


@dataclass(frozen=True)
class Deferred:
    """The data-dependent half of a pass, run after the calibration pass (module doc).

    statistics: what `finish` needs, collected on the model as the pass left it.
    rescalable: tensor -> channel axis, every tensor `finish` may scale.
    finish(statistics) -> (report line, {tensor: (axis, factor)} of the tensors it scaled).
    """

    name: str
    statistics: tuple[Statistic, ...]
    rescalable: Mapping[str, int]
    finish: Callable[[Mapping[Statistic, np.ndarray | None]], tuple[str, dict[str, Rescale]]]


@dataclass(frozen=True)
class RunSettings:
    """What every pass and algorithm of a run reads and none changes: the calibration data
    and how it may be read (`calibrate/access.py`), the calibration settings, the
    emission format an algorithm's trial emission must match."""

    data: CalibrationSource
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    progress: bool | None = None
    qdq_domain: str = "ai.onnx"  # the Q/DQ domain emission uses
    extended: bool = False  # emission writes the extended format (qdq-ext: its own rounding and types)

    @classmethod
    def of(cls, data: Any = None, calibration: CalibrationConfig | None = None, **kwargs: Any) -> RunSettings:
        """Settings for `data` (anything `CalibrationSource` takes, or one already made)."""
        source = data if isinstance(data, CalibrationSource) else CalibrationSource(data)
        return cls(source, calibration or CalibrationConfig(), **kwargs)

    @property
    def access(self) -> Access:
        """How the calibration data may be read (none, once, again, statistics files only)."""
        return data_access(self.data, bool(self.calibration.stats))

    def collect(self, model: ir.Model, stats: list[Statistic], purpose: str,
                known: Statistics = EMPTY) -> dict[Statistic, np.ndarray | None]:
        """The requested statistics of `model`: from `known` when it has them all, else one
        pass over the data."""
        if all(stat in known for stat in stats):
            return {stat: known[stat] for stat in stats}
        if not self.access.readable:
            raise CalibrationDataError(f"{purpose} needs calibration data; pass calibration_data")
        return collect(model, stats, self.data, self.calibration, self.progress, purpose)


@dataclass(frozen=True)
class PassContext:
    """What a pass reads besides the model and its options."""

    settings: RunSettings
    # Nodes earlier passes created that must stay float (node -> reason).
    keep_float: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    # Whether this pass may defer its data-dependent half (`Deferred`): it is the last
    # pass and calibration follows.
    may_defer: bool = False

    def collect(self, model: ir.Model, stats: list[Statistic], purpose: str) -> dict[Statistic, np.ndarray | None]:
        return self.settings.collect(model, stats, purpose)


@dataclass(frozen=True)
class PassResult:
    """What a pass hands back: its report line (None when it deferred), the nodes it
    created that must stay float, its deferred half."""

    note: str | None
    keep_float: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    deferred: Deferred | None = None
    idle: bool = False  # it found nothing to do: its note is said only where the pass was asked for


# emit_trial(model, plan, ranges, weights): rewrite `model` in place as emission will, with
# the run's format and float8 statistics (`emit/trial.py`); the pipeline provides it.
TrialEmitter = Callable[[ir.Model, QuantPlan, Mapping[str, tuple[float, float]], WeightCache], None]


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm reads besides the model, plan, ranges and options.

    weights: the quantized weights so far (`plan.params.WeightCache`), the algorithm's own
      copy: what it pins there (learned rounding, GPTQ's blocks) is handed back to the run
      with its result, and emission uses it.
    """

    settings: RunSettings
    emit_trial: TrialEmitter
    weights: WeightCache = field(default_factory=WeightCache)
    # Statistics collected on the model as it is now (by the calibration pass, for the
    # first algorithm only: each one rewrites the model the next observes).
    statistics: Statistics = field(default_factory=lambda: EMPTY)
    # Layers whose bias an earlier algorithm fitted on the quantized model's own inputs
    # (node -> algorithm): they hold their mean correction already.
    fitted_biases: Mapping[str, str] = field(default_factory=lambda: EMPTY)

    def collect(self, model: ir.Model, stats: list[Statistic], purpose: str) -> dict[Statistic, np.ndarray | None]:
        """The requested statistics: those already collected, else one pass over the data."""
        return self.settings.collect(model, stats, purpose, self.statistics)


@dataclass(frozen=True)
class AlgorithmResult:
    """What an algorithm hands back: its report line, the plan when it changed a decision,
    the layers whose bias it fitted (node -> its name), and what the user should act on
    (each its own `warning:` line in the summary)."""

    note: str
    plan: QuantPlan | None = None
    fitted_biases: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    warnings: tuple[str, ...] = ()
    idle: bool = False  # it found nothing to change (the output check then reads no fit of its)
