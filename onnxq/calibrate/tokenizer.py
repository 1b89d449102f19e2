"""The tokenizer of an LLM model folder, read without transformers or torch: the Hugging
Face files `tokenizer.json` and `tokenizer_config.json`, which the onnxruntime-genai model
builder copies into the folder, read by onnxruntime-extensions (a runtime dependency),
else by onnxruntime-genai where it is installed (`READERS`, tried in order).

onnxruntime-extensions 0.15 picks its tokenizer by tokenizer_config.json's
`tokenizer_class` and refuses names it does not know, such as transformers 5's
`TokenizersBackend`. Where it refuses, a copy of the files in a temporary folder names
the class that tokenizer.json's model implies (`stand_in_class`): the tokens still come
from tokenizer.json (vocabulary, merges, pre-tokenizer, added tokens); the class only picks
the kind of model and the pre-tokenizer's default. On byte-level BPE tokenizers (GPT-2,
SmolLM2, Llama 3, Qwen) this gives transformers' ids exactly.

Text is tokenized without special tokens (no BOS or EOS), as calibration and perplexity
windows are cut from running text (`tokenizer(text, add_special_tokens=False)`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxq.errors import CalibrationDataError

VOCABULARY, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# The tokenizer.json models handed to the readers at all: others are refused first, as the
# native readers crashed the process now and then on a model type they do not know.
READABLE_MODELS = ("BPE", "Unigram", "WordPiece")
# What a reader may raise on a tokenizer it cannot read (the extensions raise RuntimeError).
UNREADABLE = (RuntimeError, ValueError, OSError, ImportError, KeyError, TypeError)


@dataclass(frozen=True)
class Tokenizer:
    """A folder's tokenizer: `encode(text)` gives int64 ids; `reader` says which read it."""

    encode: Callable[[str], np.ndarray]
    reader: str


def stand_in_class(vocabulary: dict) -> str | None:
    """A `tokenizer_class` onnxruntime-extensions reads as tokenizer.json's model is meant:
    byte-level BPE as GPT-2's, SentencePiece-style BPE (a `▁` metaspace or byte fallback)
    as Llama's, Unigram as T5's; None for models it does not read (WordPiece, WordLevel)."""
    model = vocabulary.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        around = json.dumps([vocabulary.get(key) for key in ("normalizer", "pre_tokenizer", "decoder")],
                            ensure_ascii=False)
        sentencepiece = bool(model.get("byte_fallback")) or "Metaspace" in around or "\u2581" in around
        return "LlamaTokenizer" if sentencepiece else "GPT2Tokenizer"
    return {"Unigram": "T5Tokenizer"}.get(kind)


def _extensions(folder: Path) -> Callable[[str], np.ndarray]:
    """onnxruntime-extensions' reader of the Hugging Face files in `folder` (imported here:
    only calibration text loads its native library)."""
    from onnxruntime_extensions.pp_api import Tokenizer as Reader

    reader = Reader(str(folder), {"add_special_tokens": False})
    return lambda text: np.asarray(reader.tokenize(text), np.int64)


def _as_is(folder: Path, vocabulary: dict | None = None) -> tuple[Callable[[str], np.ndarray], str]:
    if not (folder / TOKENIZER_CONFIG).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_CONFIG}")
    return _extensions(folder), "onnxruntime-extensions"


def _stand_in(folder: Path, vocabulary: dict | None = None) -> tuple[Callable[[str], np.ndarray], str]:
    """onnxruntime-extensions on a copy whose tokenizer_class is `stand_in_class`'s
    (`vocabulary`: tokenizer.json as read already, else read here)."""
    config_file = folder / TOKENIZER_CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if vocabulary is None:
        vocabulary = json.loads((folder / VOCABULARY).read_text(encoding="utf-8"))
    given, stand_in = config.get("tokenizer_class"), stand_in_class(vocabulary)
    if stand_in is None:
        raise ValueError(f"it reads no {(vocabulary.get('model') or {}).get('type')!r} tokenizer model")
    if given == stand_in:
        raise ValueError(f"it refuses tokenizer_class {given!r}")
    with tempfile.TemporaryDirectory(prefix="onnxq-tokenizer-") as copy:
        shutil.copy(folder / VOCABULARY, Path(copy) / VOCABULARY)
        (Path(copy) / TOKENIZER_CONFIG).write_text(json.dumps({**config, "tokenizer_class": stand_in}),
                                                   encoding="utf-8")
        encode = _extensions(Path(copy))  # read whole at creation: the copy may go
    named = f"tokenizer_class {given!r}" if config_file.is_file() else f"no {TOKENIZER_CONFIG}"
    return encode, f"onnxruntime-extensions, {named} read as {stand_in!r}"


def _genai(folder: Path, vocabulary: dict | None = None) -> tuple[Callable[[str], np.ndarray], str]:
    """onnxruntime-genai's reader (the one the folder deploys with; it needs genai_config.json)."""
    import onnxruntime_genai as og

    reader = og.Tokenizer(str(folder))
    reader.update_options(add_special_tokens="false")
    return lambda text: np.asarray(reader.encode(text), np.int64), "onnxruntime-genai"


# The readers tried in order, each with the name its failure is reported under; each takes
# the folder and, where the caller read it already, tokenizer.json's contents.
READERS: tuple[tuple[str, Callable[..., tuple[Callable[[str], np.ndarray], str]]], ...] = (
    ("onnxruntime-extensions", _as_is),
    ("with a stand-in tokenizer_class", _stand_in),
    ("onnxruntime-genai", _genai),
)


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of the model folder `folder`, from the first reader that reads it."""
    folder = Path(folder)
    if not (folder / VOCABULARY).is_file():
        raise CalibrationDataError(f"{folder} has no {VOCABULARY}, so calibration text cannot be tokenized; copy "
                                   f"the model's {VOCABULARY} and {TOKENIZER_CONFIG} into the folder, or pass token "
                                   "windows with --calib-data")
    vocabulary = _read_vocabulary(folder / VOCABULARY)
    model = vocabulary.get("model") if vocabulary is not None else None
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in READABLE_MODELS:
        raise CalibrationDataError(f"cannot load the tokenizer in {folder}: its tokenizer.json model is {kind!r}, "
                                   f"not one of {', '.join(READABLE_MODELS)}; tokenize the text yourself and pass "
                                   "token windows with --calib-data")
    failures = []
    for name, read in READERS:
        try:
            encode, reader = read(folder, vocabulary)
            return Tokenizer(encode, reader)
        except UNREADABLE as exc:
            failures.append(f"{name}: {_first_line(exc)}")
    raise CalibrationDataError(f"cannot load the tokenizer in {folder} ({'; '.join(failures)}); tokenize the text "
                               "yourself and pass token windows with --calib-data")


def _read_vocabulary(path: Path) -> dict | None:
    """tokenizer.json's contents, or None where the file is not a JSON object."""
    try:
        vocabulary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return vocabulary if isinstance(vocabulary, dict) else None


def _first_line(exc: BaseException) -> str:
    """An exception as one short line (the extensions' messages span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."
