"""The rungs a sensitive layer can be raised to, as ordinary node overrides of a config.

int16: the layer's activations (inputs and output) in int16, its weights as configured;
fp16 / bf16: the layer computes in that float type; float: the layer stays float32.
A promoted config is a plain `Config` (node overrides in `layer_quant_config`), so the
result of a search can be saved and reused without searching again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from onnxq.config.spec import Config, DType, QuantizationConfig, QuantizationSpec
from onnxq.numerics.qmath import qdq_opset


def _rung_config(rung: str) -> QuantizationConfig:
    if rung == "int16":
        act = QuantizationSpec(dtype=DType.INT16)
        return QuantizationConfig(input_tensors=act, output_tensors=act)
    dtype = {"fp16": DType.FLOAT16, "bf16": DType.BFLOAT16, "float": DType.FLOAT32}[rung]
    spec = QuantizationSpec(dtype=dtype)
    return QuantizationConfig(input_tensors=spec, output_tensors=spec, weight=spec, bias=spec)


def rung_opset(ladder: list[str]) -> int:
    """The ai.onnx opset the ladder's types need (int16 Q/DQ: 21)."""
    return max((qdq_opset(DType.INT16) for r in ladder if r == "int16"), default=13)


def with_promotions(config: Config, promotions: Mapping[str, str]) -> Config:
    """`config` with each promoted node overridden to its rung (over any override it had)."""
    layers = dict(config.layer_quant_config)
    for node, rung in promotions.items():
        layers[node] = _merged(layers.get(node), _rung_config(rung))
    return dataclasses.replace(config, layer_quant_config=layers)


def _merged(base: QuantizationConfig | None, top: QuantizationConfig) -> QuantizationConfig:
    """`top`'s specs over `base`'s, field by field (a rung changes only what it names)."""
    if base is None:
        return top
    merged = {}
    for f in dataclasses.fields(QuantizationConfig):
        low, high = getattr(base, f.name), getattr(top, f.name)
        if isinstance(high, QuantizationSpec) and isinstance(low, QuantizationSpec):
            values = {g.name: getattr(high, g.name) if getattr(high, g.name) is not None else getattr(low, g.name)
                      for g in dataclasses.fields(QuantizationSpec)}
            merged[f.name] = QuantizationSpec(**values)
        else:
            merged[f.name] = high if high is not None else low
    return QuantizationConfig(**merged)
