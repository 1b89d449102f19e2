"""Run models in onnxq's extended QDQ format (`quant_format: qdq-ext`) in onnxruntime.

The extended ops are onnxruntime-extensions Python custom ops (domain
`ai.onnx.contrib`), vectorised with numpy (`onnxq.numerics.extended` is their reference):

- `OnnxqQuantizeDequantize(x, scale, zero_point)`, attributes `qmin`, `qmax`, `round_mode`
  (half_even, half_up: ties away from zero, floor, ceil) and `axis` (-1 ... for per-channel scales,
  ignored for scalar ones): any integer grid up to 32 bits.
- `OnnxqBlockQuantizeDequantize(x)`, attributes `format` (mxint8, mxfp8_e4m3, mxfp8_e5m2,
  mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1, bfp16), `block_size` (0: the format's) and `axis`.

A deployment pipeline opens such a model with

    import onnxq.runtime
    session = onnxq.runtime.InferenceSession("model.ext.onnx")

or adds the ops to its own options with `onnxq.runtime.session_options()`. Nothing is
compiled: onnxruntime-extensions ships the bridge, onnxq the numpy kernels.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnxruntime as ort

from onnxq.errors import OnnxqError
from onnxq.graph.quantized import EXTENDED_DOMAIN, EXTENDED_OPS
from onnxq.numerics.extended import BLOCK_FORMATS, block_fake_quantize, fake_quantize

DOMAIN = EXTENDED_DOMAIN
QDQ_OP, BLOCK_OP = EXTENDED_OPS
NO_AXIS = -(2**31)  # `axis` attribute value meaning "per tensor"
_registered = False


def _extensions() -> Any:
    try:
        import onnxruntime_extensions  # imported on first use: only extended models need it
    except ImportError:
        raise OnnxqError("the extended QDQ format runs through onnxruntime-extensions; install it with "
                         "pip install 'onnxruntime-extensions>=0.12,<0.16'") from None
    return onnxruntime_extensions


def register() -> None:
    """Register the extended ops with onnxruntime-extensions (once per process)."""
    global _registered
    if _registered:
        return
    ext = _extensions()
    d = ext.PyCustomOpDef

    @ext.onnx_op(op_type=QDQ_OP, inputs=[d.dt_float, d.dt_float, d.dt_float], outputs=[d.dt_float],
                 attrs={"qmin": d.dt_int64, "qmax": d.dt_int64, "round_mode": d.dt_string, "axis": d.dt_int64})
    def _quantize_dequantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, qmin: int = -128,
                             qmax: int = 127, round_mode: str = "half_even", axis: int = NO_AXIS) -> np.ndarray:
        return fake_quantize(x, scale, zero_point, qmin, qmax, round_mode, None if axis == NO_AXIS else axis)

    @ext.onnx_op(op_type=BLOCK_OP, inputs=[d.dt_float], outputs=[d.dt_float],
                 attrs={"format": d.dt_string, "block_size": d.dt_int64, "axis": d.dt_int64})
    def _block_quantize_dequantize(x: np.ndarray, format: str = "mxint8", block_size: int = 0,  # noqa: A002
                                   axis: int = -1) -> np.ndarray:
        if format not in BLOCK_FORMATS:
            raise ValueError(f"unknown block format {format!r}; use one of {', '.join(BLOCK_FORMATS)}")
        return block_fake_quantize(x, format, axis, block_size or None)

    _registered = True


def session_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """`options` (default: new ones) with the extended ops registered."""
    register()
    options = options or ort.SessionOptions()
    options.register_custom_ops_library(_extensions().get_library_path())
    return options


def options_for(model: Any, options: ort.SessionOptions) -> ort.SessionOptions:
    """`options`, with the extended ops registered only when the onnx-ir `model` imports
    their domain (the library load stays off the hot paths of ordinary models)."""
    return session_options(options) if DOMAIN in model.opset_imports else options


def InferenceSession(path_or_bytes: str | os.PathLike | bytes, options: ort.SessionOptions | None = None,  # noqa: N802
                     providers: list[str] | None = None, **kwargs: Any) -> ort.InferenceSession:
    """An `onnxruntime.InferenceSession` that can run the extended ops."""
    source = path_or_bytes if isinstance(path_or_bytes, bytes) else str(path_or_bytes)
    return ort.InferenceSession(source, session_options(options), providers=providers or ["CPUExecutionProvider"],
                                **kwargs)
