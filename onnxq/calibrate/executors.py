"""Where calibration shards run: local processes or Ray tasks, chosen from a table.

Each task runs the shard function it is given (`onnxq.pipeline.shards.calibrate_shard`,
passed by the caller, so this module imports nothing above it) on its shard and returns
the stats file's bytes, so no shared output folder is needed; the model and the calibration data
must be readable at the same path on every worker (a shared filesystem or a copy).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from onnxq.errors import ConfigError
from onnxq.parallel import cpu_count
from onnxq.plugins import LOADED, load_plugin

# calibrate(model, stats_path, config, data, shard, progress=False): writes one shard's stats file.
ShardFn = Callable[..., Any]


def shard_task(calibrate: ShardFn, model: Any, config: Any, data: Any, shard: tuple[int, int],
               plugins: tuple[str, ...] = ()) -> bytes:
    """Calibrate one shard with `calibrate` (in a worker, after importing the caller's
    `plugins`) and return its stats file's bytes."""
    for name in plugins:
        load_plugin(name)

    with tempfile.TemporaryDirectory(prefix="onnxq-shard-") as folder:
        path = Path(folder) / "stats.npz"
        calibrate(model, path, config, data, shard, progress=False)
        return path.read_bytes()


Executor = Callable[[ShardFn, Any, Any, Any, int, str | None], list[bytes]]


def _processes(calibrate: ShardFn, model: Any, config: Any, data: Any, count: int,
               address: str | None) -> list[bytes]:
    if address:
        raise ConfigError("--ray-address goes with --executor ray")
    workers = max(1, min(count, cpu_count()))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(shard_task, calibrate, model, config, data, (i, count), tuple(LOADED))
                   for i in range(count)]
        return [f.result() for f in futures]


def _ray(calibrate: ShardFn, model: Any, config: Any, data: Any, count: int, address: str | None) -> list[bytes]:
    try:
        import ray  # optional dependency: pip install 'onnxq[ray]'
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'onnxq[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    try:
        task = ray.remote(num_cpus=1)(shard_task)
        return ray.get([task.remote(calibrate, model, config, data, (i, count), tuple(LOADED))
                        for i in range(count)])
    finally:
        if started:
            ray.shutdown()


EXECUTORS: dict[str, Executor] = {"process": _processes, "ray": _ray}


def run_shards(executor: str, calibrate: ShardFn, model: Any, config: Any, data: Any, count: int,
               address: str | None = None) -> list[bytes]:
    """Every shard's stats file bytes, in shard order, each written by `calibrate`."""
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}; choose {', '.join(EXECUTORS)}")
    if count < 1:
        raise ConfigError(f"--shards must be at least 1, got {count}")
    return EXECUTORS[executor](calibrate, model, config, data, count, address)


def write_all(parts: Sequence[bytes], folder: str | os.PathLike) -> list[Path]:
    """The shards' bytes as files in `folder`."""
    paths = []
    for i, blob in enumerate(parts):
        paths.append(Path(folder) / f"shard{i}.npz")
        paths[-1].write_bytes(blob)
    return paths
