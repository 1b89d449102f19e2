"""Name -> observer class table, filled by `@register_observer` in each observer module."""

from __future__ import annotations

from collections.abc import Callable

from onnxq.calibrate.observers.base import Observer
from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import ConfigError

OBSERVERS: dict[str, type[Observer]] = {}


def register_observer(name: str) -> Callable[[type[Observer]], type[Observer]]:
    """Class decorator: register an Observer subclass under calib method `name`."""

    def decorate(cls: type[Observer]) -> type[Observer]:
        if name in OBSERVERS and OBSERVERS[name] is not cls:
            raise ValueError(f"calib method {name!r} is already registered")
        cls.name = name
        OBSERVERS[name] = cls
        return cls

    return decorate


def _lookup(method: str) -> type[Observer]:
    key = str(method)
    if key not in OBSERVERS:
        raise ConfigError(
            f"unknown calib method '{key}'; valid methods: {', '.join(sorted(OBSERVERS))}"
        )
    return OBSERVERS[key]


def make_observer(spec: ResolvedSpec) -> Observer:
    """A fresh observer for `spec.calib_method`; ConfigError for unknown methods/options."""
    return _lookup(spec.calib_method)(spec)


def observer_class(method: str) -> type[Observer]:
    """The observer class registered for calib method `method`."""
    return _lookup(method)


def observer_options(method: str) -> type | None:
    """The options dataclass of calib method `method`, or None if it takes no options."""
    return _lookup(method).options_class
