"""Parse the options of one pass or algorithm entry into its frozen options dataclass."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from onnxq.config.spec import enum_text
from onnxq.errors import ConfigError

T = TypeVar("T")


def _coerce(value: Any, default: Any, key: str, where: str) -> Any:
    """Check `value` against the type of the field's default; lists become tuples."""
    if isinstance(default, bool):
        ok = isinstance(value, bool | np.bool_)
        value = bool(value) if ok else value
    elif isinstance(default, int):  # numpy's integers too (a value read from an array)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
        value = int(value) if ok else value
    elif isinstance(default, float):
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
        value = float(value) if ok else value
    elif isinstance(default, tuple):
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    elif isinstance(default, str):  # a name from the option's fixed set: any case, as every enum
        ok = isinstance(value, str)
        value = enum_text(value) if ok else value
    else:
        ok = True
    if not ok:
        want = "a list of names" if isinstance(default, tuple) else type(default).__name__
        raise ConfigError(f"{where}: option {key!r} must be {want}, got {value!r}")
    return value


def check_field_types(options: Any, where: str) -> None:
    """The fields of a typed options dataclass against their defaults' types, as a dict
    entry's are (`_coerce`): `AdaRoundConfig(learning_rate="fast")` is a `ConfigError`,
    not a TypeError from the range check after it; a list is kept as a tuple. Every
    registered options class runs it (`checks_types_first`)."""
    for f in dataclasses.fields(options):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if default is not None:
            object.__setattr__(options, f.name, _coerce(getattr(options, f.name), default, f.name, where))


def checks_types_first(cls: type, where: str) -> None:
    """Make the options dataclass `cls` run `check_field_types` on each instance: first in
    its `__post_init__` (before the range checks there), else after its `__init__`."""
    own = getattr(cls, "__post_init__", None)
    if own is not None:
        def post_init(self: Any) -> None:
            check_field_types(self, where)
            own(self)

        cls.__post_init__ = post_init
        return
    init = cls.__init__

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        check_field_types(self, where)

    cls.__init__ = checked


def parse_options(cls: type[T], options: Mapping[str, Any], where: str) -> T:
    """Build `cls` (a dataclass whose fields all have defaults) from an entry's options.

    Unknown keys raise ConfigError naming the closest known option; values must have the
    type of the field's default (ints are accepted for floats, lists for tuples; strings,
    names from a fixed set, are read in any case: `reconstruct: Block`).
    """
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known options: {', '.join(known)}"
            raise ConfigError(f"{where}: unknown option {key!r}{hint}")
        field = known[key]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        values[key] = _coerce(value, default, key, where)
    return cls(**values)
