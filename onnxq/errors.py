"""User-facing errors: each one says what is wrong and how to fix it, in one line.

The CLI prints these without a traceback and exits with status 2. Anything else that
escapes is a bug in onnxq and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any


class OnnxqError(Exception):
    """A mistake in what the user gave us (model, data, config, options)."""


class ModelError(OnnxqError):
    """The input model cannot be read or is not valid ONNX."""


class ConfigError(OnnxqError):
    """The configuration has an unknown key, a bad value or a conflict."""


class CalibrationDataError(OnnxqError):
    """Calibration data is missing, mis-named or mis-shaped."""


class UnsupportedModelError(ModelError):
    """Valid ONNX that onnxq does not quantize: a training graph, map-typed inputs or outputs."""


class UnknownFieldError(ConfigError, TypeError):
    """A keyword argument that names no field of a configuration class (a TypeError too,
    as Python's own error for it would be)."""


def renamed(exc: OnnxqError, names: dict[str, str]) -> OnnxqError:
    """`exc` again (same class) with its message naming the caller's parameters: a wrapper
    whose arguments have other names than `quantize`'s (`names`: ours -> theirs)."""
    return type(exc)(reworded(str(exc), names))


def reworded(text: str, names: dict[str, str]) -> str:
    """`text` with each of `names`' keys replaced by its value (`renamed`)."""
    for ours, theirs in names.items():
        text = text.replace(ours, theirs)
    return text


def closest_name(word: str, choices: list[str], cutoff: float = 0.6) -> str | None:
    """The closest of `choices` to `word`, compared case-insensitively, if any is close."""
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[match[0]] if match else None


def named_fields_only(cls: type) -> type:
    """Class decorator for configuration dataclasses: a keyword naming no field raises
    `UnknownFieldError` with the nearest field (`QuantizationSpec(dtyp="int8")`: did you
    mean 'dtype'?), where Python only says "unexpected keyword argument"."""
    init = cls.__init__

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = next((k for k in kwargs if k not in names), None)
        if unknown is not None:
            hint = closest_name(unknown, names) or next((n for n in names if n.startswith(unknown.lower())), None)
            raise UnknownFieldError(f"{cls.__name__} has no field {unknown!r}; "
                                    + (f"did you mean {hint!r}?" if hint else f"its fields: {', '.join(names)}"))
        init(self, *args, **kwargs)

    cls.__init__ = checked
    return cls


def duplicate_entry(key: str, name: str) -> str:
    """The error for a pass or algorithm listed twice in one source's `key` list."""
    return f"{key} lists {name} twice; give one entry for it, with all its options"
