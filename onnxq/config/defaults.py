"""The preset a model gets where no config source names one (no --preset, no `preset:`
key, `config=None`): the recipe that deploys best for its kind of model.

An LLM decoder as deployed (an onnxruntime-genai folder, or any graph with KV-cache
inputs) gets weight-only int8: static int8 activations lose to it on accuracy and decode
speed alike. SmolLM2-135M, perplexity (float 17.53) and decode tokens/s (float 26.9):
U8S8 26.9; U8S8 + SmoothQuant 19.82 at 12.7 tok/s; W8_GROUP128 17.77 at 33.8 tok/s, with
no calibration data (docs/llm-weight-only.md#the-default-for-decoders). Every other model
gets U8S8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from onnxq.calibrate.decoder import is_decoder
from onnxq.config.compose import DEFAULT_PRESET, ConfigLike, as_config
from onnxq.config.spec import Config
from onnxq.errors import OnnxqError
from onnxq.graph.folder import ModelFolder, open_folder
from onnxq.graph.load import input_names
from onnxq.notes import Note, Topic

ModelSource = str | os.PathLike | onnx.ModelProto | ir.Model


@dataclass(frozen=True)
class KindDefault:
    """A kind of model's default: its preset, and the summary's line where it was used."""

    preset: str
    note: str | None = None  # None: nothing to say (the global default)
    # Calibration data given anyway: what the note adds (the preset reads none).
    no_data: str | None = None


# The defaults by kind of model (`model_kind`).
DEFAULTS: dict[str, KindDefault] = {
    "decoder": KindDefault(
        "W8_GROUP128",
        "decoder default: weight-only int8 (W8_GROUP128: no preset named; --preset U8S8 for static int8); "
        "4-bit, up to half the size again: --preset W4_GROUP128 --algorithm gptq --calib-data windows.npz",
        "calibration data (--calib-data, --calib-text) not needed: weight-only int8 calibrates nothing"),
    "model": KindDefault(DEFAULT_PRESET),
}


def model_kind(model: ModelSource | ModelFolder) -> str:
    """`decoder` for an onnxruntime-genai folder (a path, or one `open_folder` opened) or a
    graph with KV-cache inputs (`calibrate/decoder.py`), else `model`. A model that cannot be read is a `model`:
    loading it says what is wrong."""
    if isinstance(model, ir.Model):
        names = [value.name for value in model.graph.inputs]
    elif isinstance(model, onnx.ModelProto):
        names = [value.name for value in model.graph.input]
    else:
        try:
            folder = model if isinstance(model, ModelFolder) else open_folder(model)
            if folder is not None and folder.genai:
                return "decoder"
            names = input_names(folder.model if folder is not None else Path(model))
        except OnnxqError:
            return "model"
    return "decoder" if is_decoder(names) else "model"


def default_preset(model: ModelSource) -> str:
    """The preset `model` gets where no config source names one."""
    return DEFAULTS[model_kind(model)].preset


def config_for(model: ModelSource | ModelFolder, config: ConfigLike) -> tuple[Config, str | None]:
    """The config `config` (any form `as_config` takes) makes for `model`, and the kind
    of model whose default it is built on where it names no preset (None where it does).
    The model is read only then."""
    kind = None

    def pick() -> str:  # called only where no source names a preset
        nonlocal kind
        kind = model_kind(model)
        return DEFAULTS[kind].preset

    return as_config(config, pick), kind


def default_note(kind: str, data_use: str | None) -> Note | None:
    """The summary's note on a run built on `kind`'s default. `data_use`: what read the
    calibration data given (`calibration`, `check`: the output check alone, `nothing`;
    None: none was given)."""
    found = DEFAULTS[kind]
    if found.note is None:
        return None
    text = found.note
    if found.no_data and data_use in ("check", "nothing"):
        text += f"; {found.no_data} ({'only the output check used it' if data_use == 'check' else 'unused'})"
    return Note(Topic.CONFIG, text)
