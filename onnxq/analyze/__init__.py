"""Accuracy analysis of a quantized model: per-tensor and per-layer error (`analysis.py`),
and the HTML report (`html.py`)."""

from onnxq.analyze.analysis import (
    Analysis,
    LayerReport,
    TensorReport,
    analyze_models,
    format_analysis,
)

__all__ = ["Analysis", "LayerReport", "TensorReport", "analyze_models", "format_analysis"]
