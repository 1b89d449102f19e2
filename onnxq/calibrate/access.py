"""How a run may read its calibration data: one value instead of three flags.

none: no data (ranges loaded from a file, weight-only recipes, `onnxq inspect`);
read once: a generator or a reader without `rewind()`: the calibration pass reads it,
  nothing else can;
replayable: a path, a dict of arrays, a list of feeds, a reader with `rewind()`;
statistics files: no data, but the calibration pass's statistics read from files
  (`--stats`), which hold what the first algorithm asks of the data and nothing more.

A stage that needs another read asks `rereadable`; when the answer is no, `refusal`
is the one sentence that says why and what to pass instead (`REASONS`, then `FIXES`).
"""

from __future__ import annotations

from enum import Enum

from onnxq.calibrate.data import CalibrationSource


class Access(Enum):
    NONE = "none"
    ONCE = "read once"
    REPLAYABLE = "replayable"
    FILES = "statistics files"

    @property
    def readable(self) -> bool:
        """A pass over the data can run (the first one, for data read once)."""
        return self in (Access.ONCE, Access.REPLAYABLE)

    @property
    def rereadable(self) -> bool:
        """The data can be read again after the calibration pass."""
        return self is Access.REPLAYABLE


# Why a stage that reads the data again cannot, and the fix: one of each per access.
REASONS = {
    Access.NONE: "there is no calibration data (ranges loaded from a file)",
    Access.ONCE: "the calibration data can be read only once",
    Access.FILES: "it reads the calibration data itself, which statistics files do not hold",
}
FIXES = {
    Access.NONE: "pass calibration_data",
    Access.ONCE: "pass a path, a dict of arrays, a list of feeds or a reader with rewind()",
    Access.FILES: "pass calibration_data as well (the same files still serve)",
}


def data_access(data: CalibrationSource | None, stats: bool = False) -> Access:
    """The access a run has to `data`, with statistics files given (`stats`) or not."""
    if data is None or data.source is None:
        return Access.FILES if stats else Access.NONE
    return Access.REPLAYABLE if data.replayable else Access.ONCE


def refusal(access: Access, context: str = "") -> str:
    """Why data with this access cannot be read again (`context` added to the reason),
    then the fix."""
    return f"{REASONS[access]}{context}; {FIXES[access]}"
