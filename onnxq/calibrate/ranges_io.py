"""Save calibrated ranges to JSON and load them back, so emission settings can be
iterated on without recalibrating."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import CalibrationDataError
from onnxq.graph.save import write_text_atomic

FORMAT_VERSION = 1


def save_ranges(
    path: str | os.PathLike, ranges: dict[str, tuple[float, float]], specs: dict[str, ResolvedSpec],
    num_samples: int, model_digest: str | None = None,
) -> None:
    """Write ranges (and the method that produced each) as JSON, atomically, with the
    digest of the model they were calibrated on (`shards.model_digest`)."""
    doc = {
        "format": "onnxq-ranges",
        "version": FORMAT_VERSION,
        "num_samples": num_samples,
        "model": model_digest,
        "tensors": {
            name: {
                "min": lo,
                "max": hi,
                "calib_method": specs[name].calib_method if name in specs else None,
                "dtype": str(specs[name].dtype) if name in specs else None,
                "symmetric": specs[name].symmetric if name in specs else None,
            }
            for name, (lo, hi) in ranges.items()
        },
    }
    write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def load_ranges(path: str | os.PathLike, needed: list[str],
                model_digest: str | None = None) -> tuple[dict[str, tuple[float, float]], int]:
    """Ranges for `needed` tensors from a file written by `save_ranges`, and its sample
    count; refused when the file names another model digest than `model_digest`."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationDataError(f"ranges file not found: {p}") from None
    except (OSError, ValueError) as exc:
        raise CalibrationDataError(f"cannot read ranges file {p}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != "onnxq-ranges":
        raise CalibrationDataError(f"{p} is not an onnxq ranges file (write one with --save-ranges)")
    saved = doc.get("model")
    if model_digest is not None and saved is not None and saved != model_digest:
        raise CalibrationDataError(
            f"{p} was calibrated on another model, or on this one with other weight-rewriting passes "
            "(cle, smoothquant, ...): recalibrate with --save-ranges and the same passes")
    tensors = doc.get("tensors", {})
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise CalibrationDataError(
            f"{p} has no range for tensor {missing[0]!r} ({len(missing)} missing); it was saved for "
            "another model or config: recalibrate with --save-ranges"
        )
    ranges = {n: _range(p, n, tensors[n]) for n in needed}
    return ranges, int(doc.get("num_samples", 0))


def _range(path: Path, name: str, entry: object) -> tuple[float, float]:
    """One tensor's [min, max] from the file: two numbers, not NaN, min <= max (a hand edit
    that breaks this would quantize the tensor on a grid no data has)."""
    try:
        low, high = float(entry["min"]), float(entry["max"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        raise CalibrationDataError(f"{path}: the range of tensor {name!r} is not two numbers min and max ({entry!r}); "
                                   "recalibrate with --save-ranges") from None
    if math.isnan(low) or math.isnan(high) or low > high:
        raise CalibrationDataError(f"{path}: the range of tensor {name!r} is [{low:g}, {high:g}], which no data "
                                   "has (NaN, or min above max); fix it or recalibrate with --save-ranges")
    return low, high
