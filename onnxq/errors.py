"""User-facing errors: each one says what is wrong and how to fix it, in one line.

The CLI prints these without a traceback and exits with status 2. Anything else that
escapes is a bug in onnxq and keeps its traceback.
"""

from __future__ import annotations


class OnnxqError(Exception):
    """A mistake in what the user gave us (model, data, config, options)."""


class ModelError(OnnxqError):
    """The input model cannot be read or is not valid ONNX."""


class ConfigError(OnnxqError):
    """The configuration has an unknown key, a bad value or a conflict."""


class CalibrationDataError(OnnxqError):
    """Calibration data is missing, mis-named or mis-shaped."""


class UnsupportedModelError(ModelError):
    """Valid ONNX that onnxq does not quantize: a training graph, map-typed inputs or outputs."""
