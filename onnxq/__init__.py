"""onnxq: post-training quantization for ONNX models.

    import onnxq
    result = onnxq.quantize("model.onnx", "model.int8.onnx", config="U8S8",
                            calibration_data="samples/")
    print(onnxq.format_summary(result.summary))
"""

import sys as _sys
from pathlib import Path as _Path

try:
    from onnxq.config import (
        Config,
        QuantizationConfig,
        QuantizationSpec,
        as_config,
        compose_config,
        get_preset,
        load_config,
        save_config,
    )
    from onnxq.errors import (
        CalibrationDataError,
        ConfigError,
        ModelError,
        OnnxqError,
        UnsupportedModelError,
    )
    from onnxq.optimize.adaquant import AdaQuantConfig
    from onnxq.optimize.adaround import AdaRoundConfig
    from onnxq.optimize.awq import AWQConfig
    from onnxq.optimize.bias_correction import BiasCorrectionConfig
    from onnxq.optimize.cle import CLEConfig
    from onnxq.optimize.fold_batchnorm import FoldBatchNormConfig
    from onnxq.optimize.gptq import GPTQConfig
    from onnxq.optimize.hqq import HQQConfig
    from onnxq.optimize.smoothquant import SmoothQuantConfig
    from onnxq.quantize import ModelQuantizer, QuantizationResult, quantize
    from onnxq.report import Summary, format_summary
except KeyboardInterrupt:  # Ctrl-C while the command line starts (a second or more on a busy machine)
    _cli = _Path(_sys.argv[0]).stem == "onnxq" or _sys.orig_argv[-len(_sys.argv) - 1:][:2] == ["-m", "onnxq"]
    if not _cli:  # a program importing onnxq gets its KeyboardInterrupt
        raise
    print("onnxq: interrupted", file=_sys.stderr)  # as after start-up, not a 30-line import traceback
    raise SystemExit(130) from None

__version__ = "0.1.0"

__all__ = [
    "AdaQuantConfig",
    "AWQConfig",
    "AdaRoundConfig",
    "BiasCorrectionConfig",
    "CLEConfig",
    "CalibrationDataError",
    "Config",
    "ConfigError",
    "FoldBatchNormConfig",
    "GPTQConfig",
    "HQQConfig",
    "ModelError",
    "ModelQuantizer",
    "OnnxqError",
    "QuantizationConfig",
    "QuantizationResult",
    "QuantizationSpec",
    "SmoothQuantConfig",
    "Summary",
    "UnsupportedModelError",
    "as_config",
    "compose_config",
    "format_summary",
    "get_preset",
    "load_config",
    "save_config",
    "quantize",
]
