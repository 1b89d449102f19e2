"""Calibration data sources, checked against the model's inputs and streamed in batches:
the public names of `inputs.py` (the model's inputs, feeds checked against them),
`sources.py` (the kinds of source) and `batches.py` (validated batches).

Accepted sources: a directory of .npy/.npz files, one .npz (arrays keyed by input name,
samples on axis 0), one .npy (single-input models), a mapping of input name to array,
any iterable of feed dicts, and onnxruntime's `CalibrationDataReader` protocol (an
object with `get_next()`). Nothing is read ahead beyond one batch. What one sample is
for an input with a fixed batch: `inputs.py`.
"""

from __future__ import annotations

from onnxq.calibrate.batches import iter_batches
from onnxq.calibrate.inputs import (
    Feed,
    InputSpec,
    axes_of,
    check_feed,
    feed_rows,
    feed_samples,
    model_inputs,
    sample_rows,
)
from onnxq.calibrate.sources import CalibrationSource, raw_feeds

__all__ = ["CalibrationSource", "Feed", "InputSpec", "axes_of", "check_feed", "feed_rows", "feed_samples",
           "iter_batches", "model_inputs", "raw_feeds", "sample_rows"]
