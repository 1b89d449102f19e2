"""Parsing of method-specific `calib_options` into each observer's options dataclass."""

from __future__ import annotations

import difflib
import math
from dataclasses import fields
from typing import Any

from onnxq.errors import ConfigError


def parse_options(cls: type | None, method: str, pairs: Any) -> Any:
    """Build `cls(**options)` from (key, value) pairs or a dict; None if `cls` is None.

    An unknown key raises ConfigError naming the closest valid key (or listing them);
    the dataclass's own `__post_init__` checks the values.
    """
    items = dict(pairs or ())
    valid = [f.name for f in fields(cls)] if cls is not None else []
    for key in items:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            if close:
                hint = f"did you mean '{close[0]}'?"
            elif valid:
                hint = "valid options: " + ", ".join(valid)
            else:
                hint = "this method takes no options"
            raise ConfigError(f"unknown calib option '{key}' for method '{method}'; {hint}")
    return None if cls is None else cls(**items)


def check_bool_or_none(method: str, key: str, value: Any) -> None:
    """Raise ConfigError unless `value` is True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"calib option '{key}' for method '{method}' must be true, false or null, got {value!r}"
        )


def check_number(method: str, key: str, value: Any) -> float:
    """`value` as a float; ConfigError if it is not a finite real number (a NaN passed
    every range check below and raised a ValueError in the observer, after calibration)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"calib option '{key}' for method '{method}' must be a number, got {value!r}"
        )
    if not math.isfinite(value):
        raise ConfigError(f"calib option '{key}' for method '{method}' must be a finite number, got {value!r}")
    return float(value)
