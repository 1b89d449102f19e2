"""onnxq's cache on disk: what was measured on this machine and may be read back instead of
measured again (the latency plan's choices, the CPU kernel probe).

The folder is `$ONNXQ_CACHE_DIR`, else `$XDG_CACHE_HOME/onnxq`, else `~/.cache/onnxq`, one
subfolder per kind. Entries are JSON, written atomically; a cache that cannot be read or
written is skipped (the caller measures, nothing is stored), so a cache is never the
reason a run fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from onnxq.parallel import cpu_count


def folder(kind: str) -> Path | None:
    """The cache folder of `kind` (module doc); None where there is no home to put it in."""
    if os.environ.get("ONNXQ_CACHE_DIR"):
        return Path(os.environ["ONNXQ_CACHE_DIR"]) / kind
    try:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    except RuntimeError:  # no HOME and no passwd entry
        return None
    return Path(base) / "onnxq" / kind


def cpu_fingerprint() -> str:
    """This CPU as its kernels see it: model name, feature flags, architecture and the
    cores this process may use."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(wanted))) + f"\n{platform.machine()} {cpu_count()}"


def read(kind: str, name: str) -> Any:
    """The JSON document stored under `name`, None where there is none or it cannot be read."""
    where = folder(kind)
    if where is None:
        return None
    try:
        return json.loads((where / f"{name}.json").read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nesting past Python's limit
        return None


def write(kind: str, name: str, doc: Any) -> None:
    """Store `doc` under `name` atomically; skipped where the folder is not writable."""
    where = folder(kind)
    if where is None:
        return
    temporary = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False) as f:
            temporary = f.name
            json.dump(doc, f, indent=1)
        os.replace(temporary, where / f"{name}.json")
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
