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

# Methods whose range is the data's, whatever the type it is quantized to (the others fit
# the range to the type's grid: entropy, MSE, HFMG, IFMR, ... search with its levels).
TYPE_FREE_METHODS = frozenset({"minmax", "percentile"})


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


def load_ranges(path: str | os.PathLike, needed: dict[str, ResolvedSpec],
                model_digest: str | None = None) -> tuple[dict[str, tuple[float, float]], int]:
    """Ranges for the `needed` tensors (name -> the spec this run quantizes it with) from a
    file written by `save_ranges`, and its sample count; refused when the file names another
    model digest than `model_digest`, or a tensor's range was made for another recipe."""
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
    _check_recipe(p, tensors, needed)
    return ranges, int(doc.get("num_samples", 0))


def _recipe(method: object, dtype: object, symmetric: object) -> str:
    return f"{dtype} {'symmetric' if symmetric else 'asymmetric'} {method}"


def _check_recipe(path: Path, saved: dict[str, object], specs: dict[str, ResolvedSpec]) -> None:
    """Refuse ranges made by another calibration method, symmetry or (for methods that fit
    the range to the type) type than this run's: a symmetric range, or an int8 entropy range,
    is not the range this recipe would calibrate, and would be used without a word. Entries
    without these fields (hand-written files) are taken as they are."""
    differ = []
    for name, spec in specs.items():
        entry = saved[name]
        method, dtype, symmetric = (entry.get(k) if isinstance(entry, dict) else None
                                    for k in ("calib_method", "dtype", "symmetric"))
        if method is None or symmetric is None:
            continue
        same_type = dtype is None or spec.calib_method in TYPE_FREE_METHODS or dtype == str(spec.dtype)
        if method != spec.calib_method or bool(symmetric) != bool(spec.symmetric) or not same_type:
            differ.append((name, _recipe(method, dtype, symmetric),
                           _recipe(spec.calib_method, spec.dtype, spec.symmetric)))
    if differ:
        name, was, now = differ[0]
        more = f" ({len(differ)} tensors differ)" if len(differ) > 1 else ""
        raise CalibrationDataError(f"{path}: the range of tensor {name!r} was calibrated {was}, and this recipe "
                                   f"calibrates it {now}{more}; recalibrate with --save-ranges under this recipe, "
                                   "or load it with the recipe it was saved under")


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
