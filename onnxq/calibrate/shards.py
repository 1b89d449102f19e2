"""Calibration in shards: each shard observes a contiguous stretch of the batches and
saves its state; merging the states gives exactly the state of one run over all of them.

Exactness: min/max fold in any order, histograms live on a canonical power-of-two grid
(`observers/histogram.py`), counts are integers, and sums (means, Hessians) follow a
fixed tree over the global batch index (`statistics.Accumulator`). So a model quantized
from merged shard statistics is byte-identical to one calibrated in a single run.

A stats file is an .npz of plain arrays (no pickle): a JSON header (format, the batch
window it covers, the total number of batches, a fingerprint of the model, the
calibrated tensors and their specs, the statistics requested and the batching options,
the calibrated tensors' order, the counts) and each observer's and statistic's state. Files merge when their fingerprints agree and
their windows tile [0, total) without gap or overlap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.data import iter_batches, model_inputs
from onnxq.calibrate.observers import make_observer
from onnxq.calibrate.runner import CalibrationState, calibration_batch
from onnxq.calibrate.statistics import Accumulator, Statistic, StatisticsSet
from onnxq.config.resolve import ResolvedSpec
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.save import write_npz_atomic

FORMAT = "onnxq-stats"
# 2: channel means of images counted per sample (GlobalAveragePool), batches cut by size.
# 3: a padded or strided convolution's input holds its window means, not its channel means.
VERSION = 3


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' (1 <= i <= n) as (i - 1, n)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ConfigError(f"--shard takes i/n with 1 <= i <= n (e.g. 1/4), got {text!r}")
    return int(match[1]) - 1, int(match[2])


def count_batches(model: ir.Model, data: Any, options: CalibrationConfig) -> int:
    """How many calibration batches the data makes (reads it once, runs nothing)."""
    batches = iter_batches(data, model_inputs(model), calibration_batch(model, options, data), options.max_samples,
                           "counting calibration batches", options.max_batches)
    return sum(1 for _ in batches)


def shard_window(index: int, count: int, total: int) -> tuple[int, int]:
    """Batches [first, end) of shard `index` (0-based) of `count` over `total` batches."""
    if total < count:
        raise CalibrationDataError(f"the calibration data makes {total} batches, fewer than the {count} shards; "
                                   "use fewer shards or a smaller calibration.batch_size")
    return index * total // count, (index + 1) * total // count


# Values of each weight the digest reads, evenly strided: enough to see any pass that
# rewrites weights (CLE, SmoothQuant, BatchNorm folding), cheap on a model of many GB.
SAMPLED_VALUES = 4096


def model_digest(model: ir.Model) -> str:
    """A digest of the graph (structure, weight shapes and a strided sample of each
    weight's values): statistics and ranges calibrated on one model fit another only if
    this agrees (CLE before calibration and not after changes the values alone)."""
    h = hashlib.sha256()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        h.update(repr((node.domain, node.op_type, [v.name if v is not None else "" for v in node.inputs],
                       [v.name for v in node.outputs], sorted(node.attributes))).encode())
    for name, value in sorted(model.graph.initializers.items()):
        h.update(repr((name, value.shape, value.dtype)).encode())
        if value.const_value is not None:
            flat = value.const_value.numpy().reshape(-1)
            h.update(np.ascontiguousarray(flat[::max(1, flat.size // SAMPLED_VALUES)][:SAMPLED_VALUES]).tobytes())
    return h.hexdigest()


def observed(spec: ResolvedSpec) -> tuple:
    """What of a tensor's spec shapes its observer's state: the method and its options, the
    histogram's bins and folding (symmetric), the granularity. The type, bits, percentile
    and scale type only enter `compute_range`, so one file serves int8 and int16 runs (an
    accuracy target's promoted layers) and other percentiles alike."""
    return (spec.calib_method, tuple(sorted(dict(spec.calib_options or ()).items())), spec.num_bins,
            spec.symmetric, spec.qscheme, spec.ch_axis, spec.is_dynamic)


def fingerprint(model: ir.Model, tensors: dict[str, ResolvedSpec], statistics: Collection[Statistic],
                options: CalibrationConfig) -> dict[str, str]:
    """Digests of what must agree between shards, by part (`PARTS`: the model's
    `model_digest`, the calibrated tensors and specs, the statistics, how the data is
    batched), and of all of them ("all"), which decides."""
    parts = {
        "model": model_digest(model),
        "tensors": repr(sorted((n, observed(s)) for n, s in tensors.items())),
        "statistics": repr(list(statistics)),
        "batching": repr((calibration_batch(model, options), options.max_samples, options.max_batches)),
    }
    h = hashlib.sha256()
    for text in parts.values():
        h.update(text.encode())
    return {"all": h.hexdigest(), **{k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in parts.items()}}


# What a stats file's part, when it differs from this run's, says was different.
PARTS = {
    "model": "another model (or the same one with other passes before calibration: --cle, --smoothquant, the "
             "preset's)",
    "tensors": "other calibrated tensors or methods (--preset, --calib-method and its --num-bins or "
               "--percentile, --activation-type, excludes, overrides)",
    "statistics": "other algorithms' statistics (--bias-correction, --adaround, the target's algorithms)",
    "batching": "another batching (calibration.batch_size, max_samples, max_batches)",
}


def save_stats(path: str | os.PathLike, state: CalibrationState, fingerprint_: dict[str, str],
               window: tuple[int, int], total: int) -> Path:
    """Write a shard's (or a merged) state covering batches `window` of `total`, atomically."""
    tensors = list(state.observers)
    arrays: dict[str, np.ndarray] = {}
    for i, name in enumerate(tensors):
        arrays.update({f"o{i}.{k}": v for k, v in state.observers[name].state().items()})
    found = state.statistics
    for i, stat in enumerate(found.order if found is not None else []):
        if stat in found.accumulators:  # derived ones (absmax from min and max) are not stored
            arrays.update({f"s{i}.{k}": v for k, v in found.accumulators[stat].state().items()})
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint_["all"],
            "parts": {k: v for k, v in fingerprint_.items() if k != "all"}, "window": list(window),
            "total": total, "tensors": tensors, "num_samples": state.num_samples,
            "num_batches": state.num_batches, "num_passes": state.num_passes}
    return write_npz_atomic(path, {"__header__": np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays})


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        meta = json.loads(arrays.pop("__header__").tobytes().decode())
    except FileNotFoundError:
        raise CalibrationDataError(f"stats file not found: {path}") from None
    except (zipfile.BadZipFile, EOFError) as exc:  # a partial copy, a flipped byte
        raise CalibrationDataError(f"stats file {path} is damaged or truncated ({exc}); copy it again or "
                                   "calibrate that shard again") from None
    except (OSError, ValueError, KeyError, UnicodeDecodeError):  # not an .npz of ours (numpy's text: pickles)
        raise CalibrationDataError(f"{path} is not an onnxq stats file; write one with "
                                   "onnxq calibrate ... --stats FILE") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CalibrationDataError(f"{path} is not an onnxq stats file; write one with onnxq calibrate ... --stats FILE")
    if meta.get("version") != VERSION:
        raise CalibrationDataError(f"{path} has stats format version {meta.get('version')}, this onnxq reads "
                                   f"{VERSION}: calibrate again with this version")
    return meta, arrays


def _prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def load_stats(paths: Sequence[str | os.PathLike], model: ir.Model, tensors: dict[str, ResolvedSpec],
               statistics: Sequence[Statistic], options: CalibrationConfig) -> CalibrationState:
    """The merged state of stats files that together cover all calibration batches of
    this model and config; a clear error when they do not."""
    expected = fingerprint(model, tensors, statistics, options)
    parts = []
    for p in map(Path, paths):
        meta, arrays = _read(p)
        if meta["fingerprint"] != expected["all"]:
            recorded = meta.get("parts") if isinstance(meta.get("parts"), dict) else {}
            differ = [PARTS[k] for k in PARTS if k in recorded and recorded[k] != expected[k]]
            what = "; ".join(differ) or "another model, config or batching (calibration.batch_size, max_samples, " \
                                        "max_batches)"
            raise CalibrationDataError(f"{p} was calibrated for {what}: run onnxq calibrate again with the same "
                                       "model and flags as quantize")
        parts.append((tuple(meta["window"]), meta, arrays, p))
    parts.sort(key=lambda part: part[0])
    total = parts[0][1]["total"]
    end = 0
    for (first, last), meta, _, p in parts:
        if meta["total"] != total:
            raise CalibrationDataError(f"{p} comes from a run over {meta['total']} batches, others over {total}")
        if first != end:
            what = "overlaps another file" if first < end else f"leaves batches {end}..{first - 1} uncovered"
            raise CalibrationDataError(f"{p} (batches {first}..{last - 1}) {what}: pass each shard's file once, "
                                       "all of them")
        end = last
    if end != total:
        raise CalibrationDataError(f"the stats files cover batches 0..{end - 1} of {total}: a shard's file is "
                                   f"missing (run onnxq calibrate --shard for it)")
    state = None
    for _, meta, arrays, p in parts:
        try:
            part = _state(meta, arrays, tensors, statistics)
            if state is None:
                state = part
            else:
                state.merge(part)
        except (KeyError, ValueError, TypeError, IndexError) as exc:  # a file edited or damaged inside
            raise CalibrationDataError(f"stats file {p} is damaged or was edited ({type(exc).__name__}: {exc}); "
                                       "calibrate that shard again") from None
    assert state is not None
    return state


def _state(meta: dict[str, Any], arrays: dict[str, np.ndarray], tensors: dict[str, ResolvedSpec],
           statistics: Sequence[Statistic]) -> CalibrationState:
    """One file's calibration state."""
    if set(meta["tensors"]) != set(tensors):
        raise KeyError(f"tensors {sorted(set(tensors) ^ set(meta['tensors']))[:3]}")
    part = CalibrationState({}, StatisticsSet(statistics) if statistics else None,
                            int(meta["num_samples"]), int(meta["num_batches"]), int(meta["num_passes"]))
    for i, name in enumerate(meta["tensors"]):
        part.observers[name] = make_observer(tensors[name])
        part.observers[name].set_state(_prefixed(arrays, f"o{i}."))
    if part.statistics is not None:
        for i, stat in enumerate(statistics):
            if stat in part.statistics.accumulators:
                part.statistics.accumulators[stat] = Accumulator.from_state(stat, _prefixed(arrays, f"s{i}."))
    return part

