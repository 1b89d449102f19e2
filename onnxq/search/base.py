"""The config an accuracy-target search quantizes its first model with."""

from __future__ import annotations

import dataclasses

from onnxq.config.spec import Config, MixedPrecisionConfig
from onnxq.pipeline.prepare import required_opset
from onnxq.search.ladder import rung_opset


def with_calibration(config: Config, **changes: object) -> Config:
    """`config` with these `calibration` fields changed."""
    return dataclasses.replace(config, calibration=dataclasses.replace(config.calibration, **changes))


def search_base_config(config: Config) -> Config:
    """The config the search's first model is quantized with: no target, at the opset its
    ladder's highest rung needs (`onnxq calibrate` with a target calibrates the same), and
    no latency measurement (the search measures the model it returns, once)."""
    return dataclasses.replace(with_calibration(config, measure_latency=False), mixed_precision=MixedPrecisionConfig(),
                               opset=max(required_opset(config), rung_opset(config.mixed_precision.ladder)))
