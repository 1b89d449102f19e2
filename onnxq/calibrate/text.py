"""Calibration text for an LLM decoder (`calibration.text`, `--calib-text FILE`): a plain
UTF-8 text file tokenized with the model folder's own tokenizer (`tokenizer.py`) and cut
into token windows, which then calibrate exactly as an .npz of `input_ids` does
(`decoder.py`).

The windows are consecutive and do not overlap, from the text's first token on; what is
left after the last whole window is not used. Their length is
`calibration.sequence_length`: by default 256 tokens, or the model's context length
(genai_config.json) where it is shorter. Their count is `calibration.max_samples`: by
default 64, so 16k tokens (GPTQ and AWQ want rows well beyond each layer's input width;
SmolLM2-135M GPTQ takes about 70 s per 16 windows of 256 tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxq.calibrate.decoder import decoder_inputs
from onnxq.calibrate.tokenizer import load_tokenizer
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.folder import GENAI_CONFIG, genai_settings
from onnxq.graph.load import check_readable

DEFAULT_SEQUENCE_LENGTH = 256
DEFAULT_WINDOWS = 64


@dataclass(frozen=True)
class TextWindows:
    """The token windows cut from a calibration text, and where they came from."""

    path: Path
    windows: np.ndarray  # int64 [windows, sequence_length]
    tokens: int  # tokens the whole text gives
    reader: str  # which tokenizer reader read the folder's tokenizer

    def describe(self) -> str:
        count, length = self.windows.shape
        return (f"calibration text: {self.path.name}, {self.tokens} tokens ({self.reader}), cut into {count} "
                f"window{'' if count == 1 else 's'} of {length} tokens")


def text_windows(model: Any, calibration: CalibrationConfig, data: Any) -> TextWindows | None:
    """The windows of `calibration.text` for the decoder at path `model` (its folder holds
    the tokenizer), or None without a text; `data`, the calibration data given besides,
    must be None then."""
    if calibration.text is None:
        return None
    if data is not None:
        raise CalibrationDataError("both calibration text (--calib-text, calibration.text) and calibration data "
                                   "(--calib-data) are given; give one")
    if not isinstance(model, str | os.PathLike):
        raise CalibrationDataError("calibration text is tokenized with the tokenizer beside the model: pass the "
                                   "model folder or its .onnx file, not a model object")
    model = Path(model)
    check_readable(model)
    if decoder_inputs(model) is None:
        raise CalibrationDataError(f"calibration text calibrates an LLM decoder with a KV cache (inputs input_ids and "
                                   f"past_key_values.*), which {model.name} is not; pass --calib-data instead")
    path = Path(calibration.text)
    text = _read_text(path)
    settings = genai_settings(model.parent)
    length = _window_length(calibration.sequence_length, settings.get("context_length"))
    tokenizer = load_tokenizer(model.parent)
    ids = tokenizer.encode(text)
    _check_vocabulary(ids, settings.get("vocab_size"), model.parent)
    count = min(calibration.max_samples or DEFAULT_WINDOWS, len(ids) // length)
    if count == 0:
        raise CalibrationDataError(f"{path} gives {len(ids)} tokens, fewer than one window of {length}; give more "
                                   "text or shorter windows (--sequence-length, calibration.sequence_length)")
    return TextWindows(path, ids[:count * length].reshape(count, length), len(ids), tokenizer.reader)


def _read_text(path: Path) -> str:
    """The text of `path`, which must be a non-empty UTF-8 file."""
    if path.is_dir():
        raise CalibrationDataError(f"calibration text {path} is a directory; pass one plain text file (join the "
                                   "texts into one)")
    if not path.is_file():
        raise CalibrationDataError(f"calibration text not found: {path}; pass a plain text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationDataError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8 "
                                   "plain text") from None
    if not text.strip():
        raise CalibrationDataError(f"{path} is empty; give a plain text file with a few thousand words of the "
                                   "model's domain")
    return text


def _window_length(asked: int | None, context: Any) -> int:
    """Tokens per window: `asked`, at most the context length; by default 256 or the
    context length where shorter."""
    context = context if isinstance(context, int) and context > 0 else None
    if asked is None:
        return min(DEFAULT_SEQUENCE_LENGTH, context or DEFAULT_SEQUENCE_LENGTH)
    if context is not None and asked > context:
        raise ConfigError(f"sequence_length {asked} (--sequence-length) is beyond the model's context length {context} "
                          f"({GENAI_CONFIG}); use at most {context}")
    return asked


def _check_vocabulary(ids: np.ndarray, vocab_size: Any, folder: Path) -> None:
    """Every id is inside the model's vocabulary (a tokenizer of another model is not)."""
    if isinstance(vocab_size, int) and ids.size and int(ids.max()) >= vocab_size:
        raise CalibrationDataError(f"the tokenizer in {folder} gives token id {int(ids.max())}, beyond the model's "
                                   f"vocabulary of {vocab_size} ({GENAI_CONFIG}): it is another model's tokenizer; "
                                   "copy the model's own tokenizer files into the folder")
