"""The latency plan's choices, cached on disk per model, config, CPU and onnxruntime version.

Timings vary between runs, so two searches of one model may settle on different plans;
the cache makes the same command on the same machine give the same bytes (and skip the
search's seconds). The key hashes the model (its file and the names, sizes and times
of the files beside it, or its serialized proto), the calibration data (a path's files by
name, size and time, arrays by their bytes, a reader by its type), the config as given,
the CPU (model name, flags, the cores this process may use) and the onnxruntime and onnxq
versions: another CPU or onnxruntime measures again. A GPU provider's plan is keyed by the
providers in the config, not by the GPU: another GPU model behind the same CPU reads it
(delete the folder, or set $ONNXQ_CACHE_DIR per machine). onnxq's own code is not hashed: a
checkout edited without a new version reads the old choices (delete the folder). The folder is `latency` in
onnxq's cache (`onnxq/cache.py`); a cache that cannot be read or written is skipped (the
search runs, nothing is stored).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq import cache
from onnxq.config.compose import as_config
from onnxq.config.io import config_to_json
from onnxq.config.spec import Config
from onnxq.emit.latency import timed_on
from onnxq.errors import OnnxqError
from onnxq.target.profile import GPU_PROVIDERS

FOLDER = "latency"


@dataclass(frozen=True)
class Entry:
    """What a search settled on: the config, the changes it carries, and the medians
    (batch -> ms) of the float model, the model as configured and the chosen one."""

    config: Config
    kept: list[str]
    float_ms: dict[int, float]
    first_ms: dict[int, float]
    best_ms: dict[int, float]
    skipped: list[str]  # batches the search could not time, and why

    def describe(self) -> str:
        top = max(self.float_ms)
        times = (f"batch {top}: float {self.float_ms[top]:.3g} ms, as configured {self.first_ms[top]:.3g} ms, "
                 f"chosen {self.best_ms[top]:.3g} ms")
        if not self.kept:
            where = timed_on(self.config.calibration.providers)
            return f"no change made the model faster on {where if where in GPU_PROVIDERS else 'this CPU'} ({times})"
        return f"{'; '.join(self.kept)} ({times})"


def _stat(files: list[Path], root: Path | None = None) -> str:
    """Name, size and modification time of each file (a file gone since is named as gone)."""
    lines = []
    for p in files:
        try:
            info = p.stat()
            lines.append(f"{p.relative_to(root) if root else p.name} {info.st_size} {info.st_mtime_ns}")
        except OSError:
            lines.append(f"{p.name} gone")
    return "\n".join(lines)


def _external_files(path: Path) -> list[Path]:
    """The external data files `path` names (not the other files beside it: an output
    written there must not change the key)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001  the run itself says what is wrong with the file
        return []
    names = {entry.value for tensor in model.graph.initializer
             for entry in tensor.external_data if entry.key == "location"}
    return sorted(path.parent / n for n in names)


def _model_digest(source: object) -> str:
    digest = hashlib.sha256()
    if isinstance(source, str | os.PathLike) and Path(source).is_file():
        with open(source, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        # Its external data files by size and time (reading gigabytes would cost more than
        # the search).
        digest.update(_stat(_external_files(Path(source))).encode())
    elif isinstance(source, onnx.ModelProto):
        digest.update(source.SerializeToString())
    elif isinstance(source, ir.Model):
        digest.update(ir.to_proto(source).SerializeToString())
    else:
        digest.update(str(source).encode())
    return digest.hexdigest()


def _onnxq_version() -> str:
    try:
        return importlib.metadata.version("onnxq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _hash_arrays(digest: hashlib._Hash, feeds: Mapping[str, Any]) -> None:
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        digest.update(f"{name} {array.dtype} {array.shape}".encode())
        digest.update(memoryview(array).cast("B"))


def _data_digest(data: object) -> str | None:
    """The calibration data: a path by its files' names, sizes and times, arrays (a dict,
    an .npz, a list of feeds) by their bytes; None for a reader, which the cache cannot
    look inside (its runs are not cached)."""
    if isinstance(data, str | os.PathLike):
        path = Path(data)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return f"{data}\n{_stat(files, path if path.is_dir() else None)}"
    digest = hashlib.sha256()
    if isinstance(data, Mapping):
        _hash_arrays(digest, data)
    elif isinstance(data, list | tuple) and all(isinstance(feed, Mapping) for feed in data):
        for feed in data:
            _hash_arrays(digest, feed)
    else:
        return None
    return digest.hexdigest()


def key(source: object, config: Config, data: object = None) -> str | None:
    """The cache key of quantizing `source` under `config` on calibration `data` with this
    CPU and onnxruntime; None where the data cannot be told apart (a reader)."""
    data_part = _data_digest(data)
    if data_part is None:
        return None
    parts = [_model_digest(source), config_to_json(config), data_part, cache.cpu_fingerprint(), ort.__version__,
             _onnxq_version()]
    return hashlib.sha256("\n--\n".join(parts).encode()).hexdigest()[:32]


def load(name: str) -> Entry | None:
    """The entry stored under `name`, None where there is none or it cannot be read."""
    doc = cache.read(FOLDER, name)
    if doc is None:
        return None
    try:
        times = [{int(b): float(ms) for b, ms in doc[k].items()} for k in ("float_ms", "first_ms", "best_ms")]
        if not times[0] or any(t.keys() != times[0].keys() for t in times):
            return None
        return Entry(as_config(doc["config"]), list(doc["kept"]), *times, [str(s) for s in doc["skipped"]])
    except (ValueError, KeyError, TypeError, AttributeError, OnnxqError):
        return None


def store(name: str, entry: Entry) -> None:
    """Write `entry` under `name` (atomically; skipped where the folder is not writable)."""
    cache.write(FOLDER, name, {"config": json.loads(config_to_json(entry.config)), "kept": entry.kept,
                               "float_ms": entry.float_ms, "first_ms": entry.first_ms, "best_ms": entry.best_ms,
                               "skipped": entry.skipped})
