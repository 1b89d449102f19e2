"""Top-1 against labels beside an analysis: the accuracy users judge a model by, where
the per-layer figures only say where its error comes from. `onnxq analyze --labels` and
the HTML report share it."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxq.evaluate import compare_models


def accuracy_note(float_model: Any, quant_model: Any, data: Any, labels: np.ndarray, *,
                  max_samples: int | None, providers: list[str] | None, batch_size: int = 32) -> str:
    """Float and quantized top-1 against `labels` on `data` (deployed kernels), or why
    there is none (the first output is no class scores)."""
    scored = compare_models(float_model, quant_model, data, labels, max_samples=max_samples, batch_size=batch_size,
                            providers=providers, progress=False)
    if scored.float_accuracy is None:
        return ("labels given, but the first output is no class scores ([samples, classes]): no top-1 against "
                "them")
    return (f"top-1 against the labels on {scored.samples} samples: float {scored.float_accuracy:.2%}, quantized "
            f"{scored.quant_accuracy:.2%}")
