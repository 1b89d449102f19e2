"""Progress bars of the quantize pipeline's long steps (calibration, GPTQ/AWQ, layer-wise
reconstruction, HQQ): one rule for when they show.

tqdm on stderr, with the step's name and tqdm's estimate of the time left. `enabled`:
True or False as the caller was told (`progress=` in the API, `--quiet` in the CLI); None
shows the bar when stderr is a terminal, so logs and pipes stay clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def shown(enabled: bool | None) -> bool:
    """Whether a bar is drawn (module doc)."""
    return sys.stderr.isatty() if enabled is None else enabled


def bar(iterable: Iterable[Any] | None = None, desc: str = "", unit: str = "it", enabled: bool | None = None,
        total: int | None = None) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand), removed when done."""
    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, leave=False,
                disable=not shown(enabled))
