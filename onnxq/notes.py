"""Notes in the summary as records: what a note is about (`Topic`), its text, the nodes or
tensors it names, and the pass, algorithm or stage that wrote it. Stages return notes;
the run collects them; `format_summary` renders the text at the end. A program (or a
test) reads the topic and nodes instead of matching prose."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from onnxq.errors import reworded


class Topic(Enum):
    LOAD = "load"  # the model as read: opset upgrades, rewrites on load
    CONFIG = "config"  # how the config resolves for this model (the edge layers)
    PASS = "pass"  # a pre-quantization pass's report (`source`: its name)
    ALGORITHM = "algorithm"  # an algorithm's report (`source`: its name)
    SKIPPED = "skipped"  # an algorithm that did not run, and the fix (`source`: its name)
    RECIPE = "recipe"  # passes and algorithms the run added or moved (an equalizing pass, runs last)
    TARGET = "target"  # what the target added or would have added
    CALIBRATION = "calibration"  # the data: arrays left out
    FLOAT = "float"  # nodes or tensors kept in float, named in `nodes`
    PROVIDER = "provider"  # what the execution provider will do with the model
    EMISSION = "emission"  # a lowering's report
    CHECK = "check"  # the output check after emission
    WARNING = "warning"  # something the user should act on
    SEARCH = "search"  # the accuracy-target search
    REPORT = "report"  # the HTML report's analysis
    OUTPUT = "output"  # what was written besides the model (a model folder's other files)


@dataclass(frozen=True)
class Note:
    """One note: `text` is what the summary prints."""

    topic: Topic
    text: str
    nodes: tuple[str, ...] = ()
    source: str | None = None

    def __str__(self) -> str:
        return self.text


def notes(topic: Topic, texts: Iterable[str], source: str | None = None) -> list[Note]:
    """Plain report lines as notes of one topic."""
    return [Note(topic, text, (), source) for text in texts]


def of(found: Iterable[Note], topic: Topic, source: str | None = None) -> list[Note]:
    """The notes of `topic` (and `source`, when given)."""
    return [n for n in found if n.topic is topic and (source is None or n.source == source)]


def renamed_notes(found: Iterable[Note], names: dict[str, str]) -> list[Note]:
    """The notes with the caller's parameter names (`errors.renamed`, for what the summary
    tells a wrapper's caller to pass)."""
    return [replace(n, text=reworded(n.text, names)) for n in found]


def counted(n: int, noun: str) -> str:
    """'1 model', '3 models'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
