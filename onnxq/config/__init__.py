"""Quantization configs: dataclasses, YAML/JSON files, validation, presets, resolution."""

from onnxq.config.compose import ConfigSources, as_config, compose_config, load_config
from onnxq.config.convert import config_to_dict, spec_from_dict
from onnxq.config.defaults import DEFAULTS, default_preset
from onnxq.config.io import config_from_dict, config_to_json, config_to_yaml, save_config
from onnxq.config.presets import PRESETS, Preset, get_preset
from onnxq.config.resolve import ResolvedConfig, ResolvedSpec, resolve_node_config
from onnxq.config.spec import (
    CalibMethod,
    CalibrationConfig,
    Config,
    DType,
    MixedPrecisionConfig,
    OptimizeFor,
    QScheme,
    QuantFormat,
    QuantizationConfig,
    QuantizationSpec,
    RoundMethod,
    ScaleType,
    Target,
)
from onnxq.config.validate import validate_config, validate_node_configs

__all__ = [
    "PRESETS",
    "MixedPrecisionConfig",
    "OptimizeFor",
    "CalibMethod",
    "CalibrationConfig",
    "Config",
    "ConfigSources",
    "DEFAULTS",
    "DType",
    "Preset",
    "QScheme",
    "QuantFormat",
    "Target",
    "QuantizationConfig",
    "QuantizationSpec",
    "ResolvedConfig",
    "ResolvedSpec",
    "RoundMethod",
    "ScaleType",
    "as_config",
    "compose_config",
    "config_from_dict",
    "config_to_dict",
    "config_to_json",
    "config_to_yaml",
    "default_preset",
    "get_preset",
    "load_config",
    "resolve_node_config",
    "save_config",
    "spec_from_dict",
    "validate_config",
    "validate_node_configs",
]
