"""Load user code that registers observers, passes or algorithms before a CLI command runs.

`register_observer`, `register_pass` and `register_algorithm` fill tables when their
module is imported; in Python the user imports it, on the command line `--plugin` (or
the `ONNXQ_PLUGINS` environment variable, paths or module names separated by the OS path
separator) names it: a `.py` file or an importable module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from onnxq.errors import ConfigError

ENV = "ONNXQ_PLUGINS"
# What this process imported, as the names that import it again (files by absolute path):
# calibration shards running in worker processes load the same plugins.
LOADED: list[str] = []


def plugin_names(flags: Iterable[str] | None) -> list[str]:
    """Plugins from the environment, then the flags, each once, in order."""
    names = [n for n in os.environ.get(ENV, "").split(os.pathsep) if n.strip()]
    return list(dict.fromkeys(names + list(flags or [])))


def load_plugin(name: str) -> ModuleType:
    """Import `name`: a `.py` file (by path) or a module name; ConfigError if it cannot.
    Recorded in `LOADED` under the name that imports it again."""
    is_file = name.endswith(".py") or os.sep in name or (os.altsep is not None and os.altsep in name)
    try:
        module, key = _import_file(name) if is_file else (importlib.import_module(name), name)
    except ConfigError:
        raise
    except ModuleNotFoundError as exc:
        if not is_file and exc.name == name.split(".")[0]:
            raise ConfigError(f"plugin {name}: no module of that name; pass a .py file or an "
                              "importable module name") from None
        raise ConfigError(f"plugin {name} failed to import: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's code: any error it raises is theirs to fix
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"plugin {name} failed to import: {type(exc).__name__}: {first}") from exc
    if key not in LOADED:
        LOADED.append(key)
    return module


def _import_file(name: str) -> tuple[ModuleType, str]:
    """The module of the `.py` file `name` (once per file) and its absolute path."""
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"plugin {name}: no such file; pass a .py file or an importable module name")
    resolved = str(path.resolve())
    module_name = f"onnxq_plugin_{hashlib.sha1(resolved.encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name], resolved
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module, resolved


def load_plugins(flags: Iterable[str] | None) -> list[ModuleType]:
    """Import every plugin `plugin_names` gives."""
    return [load_plugin(name) for name in plugin_names(flags)]
