"""Calibration shards: each observes its contiguous stretch of the calibration batches and
saves its statistics; `quantize` with `calibration.stats` merges them into the model a
single run gives, byte for byte (`onnxq.calibrate.shards`)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx_ir as ir

from onnxq.calibrate.access import FIXES, data_access
from onnxq.calibrate.executors import run_shards, write_all
from onnxq.calibrate.runner import observe
from onnxq.calibrate.shards import (
    count_batches,
    fingerprint,
    load_stats,
    parse_shard,
    save_stats,
    shard_window,
)
from onnxq.calibrate.sources import CalibrationSource
from onnxq.calibrate.statistics import Statistic
from onnxq.calibrate.text import text_windows
from onnxq.config import Config
from onnxq.config.defaults import config_for
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.folder import open_folder
from onnxq.pipeline.calibration import file_requests
from onnxq.pipeline.prepare import ModelSource, Prepared, prepare
from onnxq.search.base import search_base_config


@dataclass
class ShardResult:
    """What `calibrate_shard` wrote."""

    path: Path
    window: tuple[int, int]
    total_batches: int
    num_samples: int


def _calibration_requests(ready: Prepared) -> tuple[dict[str, Any], list[Statistic]]:
    """The tensors to observe and the statistics to collect, as a run of this config does
    (without a deferred pass: shards and `--stats` runs finish every pass up front), for
    the algorithms a run from the files can run (`without_another_read`: it has no data)."""
    tensors, statistics = ready.plan.calibrated_tensors(), file_requests(ready.model, ready.plan, ready.algorithms)
    if not tensors and not statistics:
        raise ConfigError("this config takes nothing from the data in a calibration pass (weight-only, or "
                          "algorithms that read the data themselves such as gptq with true_sequential), so there "
                          "are no statistics to write: quantize with this config and the data directly, or "
                          "calibrate for a static recipe (preset U8S8, for instance)")
    return tensors, statistics


def _calibration_config(config: Config) -> Config:
    """With an accuracy target, the statistics are those of the search's first model
    (`search.base.search_base_config`: its opset), so `quantize --stats` finds them."""
    return config if config.mixed_precision.target is None else search_base_config(config)


def _model_and_config(model: ModelSource, config: Config | Any) -> tuple[ModelSource, Config]:
    """The model file (a folder's, an onnxruntime-genai one included) and the calibration
    config the folder's model takes (`config_for`: a decoder's defaults)."""
    folder = open_folder(model) if isinstance(model, str | os.PathLike) else None
    config = _calibration_config(config_for(folder or model, config)[0])
    return (str(folder.model) if folder is not None else model), config


def calibrate_shard(
    model: ModelSource,
    stats: str | os.PathLike,
    config: Config | Any = None,
    calibration_data: Any = None,
    shard: tuple[int, int] | str = (0, 1),
    *,
    progress: bool | None = None,
) -> ShardResult:
    """Calibrate shard `shard` = (index, count) (or 'i/n', 1-based) of the data: its
    contiguous stretch of the calibration batches. Writes the observers' and statistics'
    state to `stats` (.npz); `quantize` with `calibration.stats` = every shard's file gives
    the model a single run over all the data gives, byte for byte
    (`onnxq.calibrate.shards`). A model folder stands for its model, as in `quantize`."""
    model, config = _model_and_config(model, config)
    index, count = parse_shard(shard) if isinstance(shard, str) else shard
    if not 0 <= index < count:
        raise ConfigError(f"shard index {index} is outside 0..{count - 1} (a tuple (index, count) counts from 0, "
                          "the string 'i/n' from 1)")
    if config.calibration.stats or config.calibration.load_ranges:
        raise ConfigError("calibrating a shard computes statistics; drop calibration.stats / load_ranges")
    config, calibration_data = _with_text(model, config, calibration_data)
    if calibration_data is None:
        raise CalibrationDataError("calibrating a shard needs calibration data; pass calibration_data, or "
                                   "calibration.text for an LLM folder's model")
    ready = prepare(model, config, calibration_data, progress, deferrable=False)
    tensors, statistics = _calibration_requests(ready)
    total = count_batches(ready.model, ready.settings.data, config.calibration)
    window = shard_window(index, count, total)
    state = observe(ready.model, tensors, ready.settings.data, config.calibration, progress, statistics, window)
    path = save_stats(stats, state, fingerprint(ready.model, tensors, statistics, config.calibration), window, total)
    return ShardResult(path, window, total, state.num_samples)


def _with_text(model: ModelSource, config: Config, data: Any) -> tuple[Config, Any]:
    """The config without `calibration.text`, and the data: the text's token windows where
    it names one (`calibrate/text.py`), so shards get the windows and tokenize nothing."""
    text = text_windows(model, config.calibration, data)
    if text is None:
        return config, data
    calibration = replace(config.calibration, text=None)
    return replace(config, calibration=calibration), {"input_ids": text.windows}


def _absolute(source: Any) -> Any:
    """Paths made absolute, so a worker with another working directory finds them."""
    return str(Path(source).resolve()) if isinstance(source, str | os.PathLike) else source


def calibrate_sharded(
    model: ModelSource,
    stats: str | os.PathLike,
    config: Config | Any = None,
    calibration_data: Any = None,
    shards: int = 2,
    executor: str = "process",
    address: str | None = None,
    *,
    progress: bool | None = None,
) -> ShardResult:
    """Calibrate `shards` shards in parallel on `executor` ('process': local processes;
    'ray': Ray tasks, on the cluster at `address` or a local instance) and write their
    merged statistics to `stats`, for `quantize` with `calibration.stats`. A model folder
    stands for its model, as in `quantize`."""
    model, config = _model_and_config(model, config)
    config, calibration_data = _with_text(model, config, calibration_data)
    if calibration_data is None:
        raise CalibrationDataError("calibration needs data; pass calibration_data, or calibration.text for an "
                                   "LLM folder's model")
    access = data_access(CalibrationSource(calibration_data))
    if not access.rereadable:  # every shard reads it from its start
        raise CalibrationDataError("sharded calibration reads the data more than once (to prepare, then in each "
                                   f"shard), but a {type(calibration_data).__name__} can be read only once; "
                                   f"{FIXES[access]}")
    model, calibration_data = _absolute(model), _absolute(calibration_data)
    ready = prepare(model, config, calibration_data, progress, deferrable=False)
    tensors, statistics = _calibration_requests(ready)
    parts = run_shards(executor, calibrate_shard, model if not isinstance(model, ir.Model) else ir.to_proto(model),
                       config, calibration_data, shards, address)
    with tempfile.TemporaryDirectory(prefix="onnxq-shards-") as folder:
        state = load_stats(write_all(parts, folder), ready.model, tensors, statistics, config.calibration)
    total = state.num_batches
    path = save_stats(stats, state, fingerprint(ready.model, tensors, statistics, config.calibration), (0, total),
                      total)
    return ShardResult(path, (0, total), total, state.num_samples)
