"""Next-token perplexity of a language model's logits on token windows: what `onnxq
compare` reports for an LLM decoder, beside the logits' SQNR, which on its own says little
of the text the model writes (SmolLM2-135M int4 RTN: 5 dB of logit SQNR, perplexity 23.2
against float's 17.5).

Perplexity is exp(mean over predicted tokens of -log softmax(logits[t])[ids[t + 1]]), in
float64, as `benchmarks/genai.py` and the export tool compute it; the agreement is the
share of positions where both models' most likely next token is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class NextToken:
    """Running sums over windows: negative log-likelihood, tokens, top-1 agreement."""

    nll: float = 0.0
    tokens: int = 0
    agreeing: int = 0

    def add(self, logits: np.ndarray, ids: np.ndarray, reference: np.ndarray | None = None) -> None:
        """One batch: `logits` [batch, T, vocab] of `ids` [batch, T]; `reference`: the
        float model's logits, for the agreement."""
        for row, (scores, window) in enumerate(zip(logits, ids)):
            x = scores[:-1].astype(np.float64)
            x -= x.max(axis=1, keepdims=True)
            logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
            self.nll -= float(logp[np.arange(len(x)), window[1:]].sum())
            self.tokens += len(x)
            if reference is not None:
                self.agreeing += int(np.sum(scores[:-1].argmax(1) == reference[row, :-1].argmax(1)))

    def perplexity(self) -> float:
        """inf past float64's range (a mean loss over 709: a broken model, which must still print)."""
        if not self.tokens:
            return math.nan
        mean = self.nll / self.tokens
        return math.exp(mean) if mean < 709 else math.inf

    def agreement(self) -> float:
        return self.agreeing / self.tokens if self.tokens else math.nan


def scores_tokens(logits_shape: tuple[int, ...], ids_shape: tuple[int, ...]) -> bool:
    """Whether logits of this shape score these token ids: [batch, T, vocab] over [batch, T]."""
    return len(logits_shape) == 3 and len(ids_shape) == 2 and tuple(logits_shape[:2]) == tuple(ids_shape) \
        and ids_shape[1] > 1
