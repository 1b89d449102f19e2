"""Save calibrated ranges to JSON and load them back, so emission settings can be
iterated on without recalibrating."""

from __future__ import annotations

import json
import os
from pathlib import Path

from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import CalibrationDataError

FORMAT_VERSION = 1


def save_ranges(
    path: str | os.PathLike, ranges: dict[str, tuple[float, float]], specs: dict[str, ResolvedSpec],
    num_samples: int,
) -> None:
    """Write ranges (and the method that produced each) as JSON, atomically."""
    doc = {
        "format": "onnxq-ranges",
        "version": FORMAT_VERSION,
        "num_samples": num_samples,
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
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def load_ranges(path: str | os.PathLike, needed: list[str]) -> tuple[dict[str, tuple[float, float]], int]:
    """Ranges for `needed` tensors from a file written by `save_ranges`, and its sample count."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationDataError(f"ranges file not found: {p}") from None
    except (OSError, ValueError) as exc:
        raise CalibrationDataError(f"cannot read ranges file {p}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != "onnxq-ranges":
        raise CalibrationDataError(f"{p} is not an onnxq ranges file (write one with --save-ranges)")
    tensors = doc.get("tensors", {})
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise CalibrationDataError(
            f"{p} has no range for tensor {missing[0]!r} ({len(missing)} missing); it was saved for "
            "another model or config: recalibrate with --save-ranges"
        )
    ranges = {n: (float(tensors[n]["min"]), float(tensors[n]["max"])) for n in needed}
    return ranges, int(doc.get("num_samples", 0))
