"""Accuracy targets, as `mixed_precision.target` and `--target` write them
(`top1>=float-0.5`, `cosine>=0.999`): parsed and checked when the config is read,
compared with scores by the search (`onnxq.search`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from onnxq.errors import ConfigError

METRICS = ("top1", "cosine", "sqnr", "custom")
BUILT_IN = ("top1", "cosine", "sqnr")  # scored by onnxq, higher is better
_TARGET = re.compile(
    r"^\s*(?:(?!float\b)(?P<metric>[A-Za-z_][A-Za-z_0-9]*)\s*)?(?P<op>>=|<=)?\s*"
    r"(?P<rhs>float\s*(?:[-+]\s*[0-9.eE+-]+)?|[-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*$"
)


@dataclass(frozen=True)
class AccuracyTarget:
    """`metric op value`, with `value` relative to the float model's score when `relative`."""

    metric: str | None
    op: str
    value: float
    relative: bool

    def threshold(self, float_score: float | None) -> float:
        if not self.relative:
            return self.value
        if float_score is None or not math.isfinite(float_score):
            raise ConfigError(f"target {self.describe()} is relative to the float model, whose "
                              f"{self.metric} score is {float_score}; give an absolute value")
        limit = float_score + self.value
        if self.metric == "top1" and self.op == ">=" and limit > 100:
            raise ConfigError(f"target {self.describe()} asks for {limit:g}% top-1 (float scores {float_score:g}%), "
                              "more than every sample right; write e.g. 'top1>=float-0.5'")
        return limit

    def met(self, score: float, float_score: float | None) -> bool:
        limit = self.threshold(float_score)
        return score >= limit if self.op == ">=" else score <= limit

    @property
    def higher_is_better(self) -> bool:
        """Whether a higher score is closer to meeting the target (`>=`)."""
        return self.op == ">="

    def describe(self) -> str:
        rhs = (f"float{self.value:+g}" if self.value else "float") if self.relative else f"{self.value:g}"
        return f"{self.metric or 'custom'}{self.op}{rhs}"


def parse_target(text: str, metric: str | None = None) -> AccuracyTarget:
    """Parse `[METRIC] (>=|<=) (NUMBER | float[+-X])`; `metric` fills a missing METRIC."""
    m = _TARGET.match(str(text))
    if m is None:
        raise ConfigError(f"cannot read accuracy target {text!r}; write e.g. 'top1>=float-0.5', "
                          "'cosine>=0.999' or 'sqnr>=30'")
    name = (m.group("metric") or metric or "").lower() or None
    if name is not None and name not in METRICS:
        raise ConfigError(f"unknown metric {name!r} in accuracy target {text!r}; use "
                          f"{', '.join(METRICS)}")
    rhs = m.group("rhs").replace(" ", "")
    relative = rhs.startswith("float")
    try:
        value = float(rhs[5:] or 0) if relative else float(rhs)
    except ValueError:
        raise ConfigError(f"cannot read the value of accuracy target {text!r}") from None
    if name == "top1" and not relative and not 1 < value <= 100:
        raise ConfigError(f"accuracy target {text!r}: top1 is a percentage, and {value:g}% is "
                          f"{'a target any model meets' if value <= 1 else 'more than every sample right'}; "
                          "write e.g. 'top1>=75' or 'top1>=float-1'")
    op = m.group("op") or ">="
    if op == "<=" and name in BUILT_IN:  # higher is better for each: a '<=' asks for a worse model
        raise ConfigError(f"accuracy target {text!r}: higher {name} is better, so '<=' asks for a model no better "
                          f"than that; write '{name}>=...' (a lower-is-better score, an error or a loss, is a "
                          "custom metric: --metric custom with your evaluate)")
    if name == "cosine" and op == ">=" and (value > 1 if not relative else value > 0):
        raise ConfigError(f"accuracy target {text!r}: a cosine is at most 1 (float's own), so no model meets it; "
                          "write e.g. 'cosine>=0.999'")
    return AccuracyTarget(name, op, value, relative)
