"""Calibration feeds for a decoder with a KV cache (an onnxruntime-genai model), built from
token windows: every input the graph takes, for the prefill and for the single-token
decode steps that follow it, which are the activations deployed (each generated token is
one decode step).

A window of T tokens gives one prefill of its first T - d tokens with an empty cache and d
decode steps, each fed one token with the cache the float model computed so far (its
`present.*` outputs fed back as `past_key_values.*`). The attention mask covers the
tokens so far; position ids, when the graph takes them, count them. One window is held
at a time, so memory does not grow with the number of windows.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnxq.calibrate.session import DATA_FAILURES, refusal
from onnxq.errors import CalibrationDataError
from onnxq.graph.folder import GENAI_CONFIG, genai_settings
from onnxq.graph.wire import read_structure

PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PRESENT = re.compile(r"^present[._]")  # the cache outputs (present.N.key, present_key_values.N...)
LOGITS = "logits"  # the scores of the next token, as onnxruntime-genai names that output
# Decode steps observed after each prefill, where activations are calibrated: their ranges
# are the deployed ones. A weight-only recipe observes prefills alone: its algorithms' input
# statistics (GPTQ's Hessians) gain nothing from the few decode rows, and each step is one
# more pass of the model (SmolLM2-135M GPTQ b128, 16 windows of 256 tokens: 311 s and
# perplexity 18.96 with 4 steps, 71 s and 18.72 without).
DECODE_STEPS = 4
NUMPY = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def result_outputs(output_names: Iterable[str], input_names: Iterable[str]) -> list[str]:
    """The outputs that are results (compare and analyze measure them): a KV-cache
    decoder's `present.*` are the cache handed on to the next step, not a result."""
    names = list(output_names)
    return [n for n in names if not PRESENT.match(n)] if is_decoder(input_names) else names


def is_decoder(input_names: Iterable[str]) -> bool:
    """Whether a graph with these inputs is a decoder with a KV cache: token ids and
    `past_key_values.*` (an LLM as deployed, one decode step at a time)."""
    names = set(input_names)
    return "input_ids" in names and any(PAST.match(n) for n in names)


@dataclass(frozen=True)
class CacheInput:
    """One `past_key_values.<layer>.<key|value>` input and the output that feeds it back."""

    name: str
    present: str
    kv_heads: int
    head_size: int
    dtype: type
    # Positions of the empty cache a prefill starts from: 0, or the window of a
    # GroupQueryAttention that keeps a sliding-window cache (`sliding_caches`).
    capacity: int = 0


@dataclass(frozen=True)
class DecoderInputs:
    """What a KV-cache decoder graph takes: token ids, attention mask, position ids (if
    any) and its cache inputs, each with the output that feeds it back."""

    ids: str
    mask: str | None
    positions: str | None
    cache: tuple[CacheInput, ...]

    @classmethod
    def of(cls, model: onnx.ModelProto, head_size: int | None = None) -> DecoderInputs | None:
        """The decoder inputs of `model`, or None when it is no KV-cache decoder.
        `head_size`: the cache's last dimension where the graph leaves it symbolic (the
        model builder's `kv_cache_dim`; genai_config.json's `decoder.head_size`)."""
        inputs = {v.name: v for v in model.graph.input}
        outputs = {v.name for v in model.graph.output}
        if not is_decoder(inputs):
            return None
        cache = []
        windows = sliding_caches(model)
        for name, value in inputs.items():
            found = PAST.match(name)
            if not found:
                continue
            present = f"present.{found.group(1)}.{found.group(2)}"
            dims = value.type.tensor_type.shape.dim
            size = dims[3].dim_value or head_size if len(dims) == 4 else None
            if present in outputs and len(dims) == 4 and dims[1].dim_value and not size:
                raise CalibrationDataError(
                    f"decoder input {name} has a symbolic head_size, and no genai_config.json beside the model "
                    "gives decoder.head_size: keep the model in its onnxruntime-genai folder, genai_config.json "
                    "included, or pass calibration feeds with every input")
            if present not in outputs or len(dims) != 4 or not dims[1].dim_value:
                raise CalibrationDataError(
                    f"decoder input {name} needs output {present} and a [batch, kv_heads, past, head_size] shape "
                    "with kv_heads fixed and head_size fixed or in genai_config.json (decoder.head_size); pass "
                    "calibration feeds with every input instead")
            dtype = NUMPY.get(value.type.tensor_type.elem_type, np.float32)
            cache.append(CacheInput(name, present, dims[1].dim_value, size, dtype, windows.get(name, 0)))
        return cls("input_ids", "attention_mask" if "attention_mask" in inputs else None,
                   "position_ids" if "position_ids" in inputs else None, tuple(cache))


def sliding_caches(model: onnx.ModelProto) -> dict[str, int]:
    """Cache inputs read by a GroupQueryAttention with `sliding_window_cache` (the model
    builder writes it on Gemma2's local-attention layers) -> its window. onnxruntime (1.32)
    refuses such a cache shorter than the window, where onnxruntime-genai hands it a buffer
    of its maximum length; a prefill on a zero-filled cache of the window's length, the
    attention mask covering the tokens alone, gives the logits of one with no sliding
    cache (tested on a random Gemma2 folder: identical)."""
    found: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        window = int(attrs.get("local_window_size", -1))
        if attrs.get("sliding_window_cache", 0) and window > 0:
            found.update({name: window for name in node.input[3:5] if name})
    return found


class DecoderFeeds:
    """A calibration data reader (`get_next()`, `rewind()`) over token windows for a
    KV-cache decoder (module doc). `model`: the float model's path, run in onnxruntime
    to compute each decode step's cache."""

    def __init__(self, model: str | Path, windows: np.ndarray, decode_steps: int = DECODE_STEPS,
                 providers: list[str] | None = None, inputs: DecoderInputs | None = None) -> None:
        windows = np.asarray(windows)
        if windows.ndim != 2 or not np.issubdtype(windows.dtype, np.integer):
            raise CalibrationDataError(f"token windows must be integers of shape [windows, tokens], got "
                                       f"{windows.dtype} {list(windows.shape)}; save them as input_ids in an .npz")
        if windows.shape[1] <= decode_steps:
            raise CalibrationDataError(f"token windows of {windows.shape[1]} tokens leave no prefill before "
                                       f"{decode_steps} decode steps; use windows longer than {decode_steps}")
        self.inputs = inputs if inputs is not None else decoder_inputs(model)
        if self.inputs is None:
            raise CalibrationDataError("token windows calibrate a decoder with a KV cache (inputs input_ids and "
                                       "past_key_values.*); for this model pass feeds of every input")
        if not len(windows):
            raise CalibrationDataError("the token windows hold no window (input_ids of shape "
                                       f"{list(windows.shape)}); give at least one window of token ids")
        _check_token_ids(windows, Path(model))
        _check_context(windows, Path(model))
        self.model, self.windows, self.decode_steps = model, windows.astype(np.int64), decode_steps
        self.providers = providers or ["CPUExecutionProvider"]
        self._session: ort.InferenceSession | None = None
        self._feeds: Iterator[dict[str, np.ndarray]] | None = None

    def _open(self) -> ort.InferenceSession:
        if self._session is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self._session = ort.InferenceSession(str(self.model), options, providers=self.providers)
        return self._session

    def _feed(self, ids: np.ndarray, past: dict[str, np.ndarray], seen: int) -> dict[str, np.ndarray]:
        batch, new = ids.shape
        feed = {self.inputs.ids: ids}
        if self.inputs.mask is not None:
            feed[self.inputs.mask] = np.ones((batch, seen + new), np.int64)
        if self.inputs.positions is not None:
            feed[self.inputs.positions] = np.broadcast_to(np.arange(seen, seen + new, dtype=np.int64), (batch, new)).copy()
        return {**feed, **past}

    def _window(self, window: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        prefill = len(window) - self.decode_steps
        past = {c.name: np.zeros((1, c.kv_heads, c.capacity, c.head_size), c.dtype) for c in self.inputs.cache}
        feed = self._feed(window[None, :prefill], past, 0)
        for step in range(self.decode_steps + 1):
            yield feed
            if step == self.decode_steps:
                return
            names = [c.present for c in self.inputs.cache]
            try:
                presents = self._open().run(names, feed)
            except DATA_FAILURES as exc:
                raise CalibrationDataError(f"the float model cannot run a window of {len(window)} tokens: "
                                           f"{refusal(str(exc))}; give shorter windows, of tokens it takes") from None
            past = {c.name: value for c, value in zip(self.inputs.cache, presents)}
            feed = self._feed(window[None, prefill + step:prefill + step + 1], past, prefill + step)

    def _all(self) -> Iterator[dict[str, np.ndarray]]:
        for window in self.windows:
            yield from self._window(window)
        self._session = None  # the float session is not held between reads

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._feeds is None:
            self._feeds = self._all()
        return next(self._feeds, None)

    def rewind(self) -> None:
        self._feeds = None

    def __len__(self) -> int:
        """Feeds per read: a prefill and the decode steps of each window."""
        return len(self.windows) * (self.decode_steps + 1)


def decoder_inputs(model: str | Path) -> DecoderInputs | None:
    """The decoder inputs of the model at path `model` (its weights are not read)."""
    return DecoderInputs.of(read_structure(model), genai_head_size(Path(model)))


def genai_head_size(model: Path) -> int | None:
    """`decoder.head_size` of the genai_config.json beside `model`, if there is one."""
    decoder = genai_settings(model.parent).get("decoder")
    try:
        return int(decoder["head_size"])
    except (KeyError, TypeError, ValueError):
        return None


def vocabulary_size(model: Path) -> int | None:
    """Rows of the model's token table: `genai_config.json`'s vocab_size, else the table a
    Gather reads `input_ids` from, an initializer or the Transpose of one (a tied LM head),
    or a tensor of static shape (its weights are not read: `read_structure`)."""
    size = genai_settings(model.parent).get("vocab_size")
    if isinstance(size, int):
        return size
    try:
        graph = read_structure(model).graph
    except Exception:  # noqa: BLE001  an unreadable model gets its own error when it is loaded
        return None
    tables = {t.name: tuple(t.dims) for t in graph.initializer}  # and the tensors typed with a static shape
    tables.update({v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in graph.value_info
                   if v.type.tensor_type.shape.dim and all(d.dim_value > 0 for d in v.type.tensor_type.shape.dim)})
    for node in graph.node:
        if node.op_type == "Transpose" and node.input[0] in tables:  # a tied table: the LM head's weight turned
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            dims = tables[node.input[0]]
            tables.setdefault(node.output[0], tuple(dims[i] for i in perm) if perm else dims[::-1])
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == "input_ids" \
                and len(tables.get(node.input[0], ())) == 2:
            return int(tables[node.input[0]][0])
    return None


def _check_token_ids(windows: np.ndarray, model: Path) -> None:
    """Every token id is a row of the model's token table (onnxruntime's Gather would fail
    deep inside a calibration pass otherwise)."""
    if not windows.size:
        return
    low, high, size = int(windows.min()), int(windows.max()), vocabulary_size(model)
    if low < 0:  # padding or an ignored label (-100), not a token
        raise CalibrationDataError(f"token windows hold id {low}, below 0: padding or ignored labels are not tokens; "
                                   "give windows of real token ids only (all of one length; quantize also takes plain text: "
                                   "--calib-text FILE)")
    if size is not None and high >= size:
        raise CalibrationDataError(f"token windows hold id {high}, beyond the vocabulary of {size}: they were not made "
                                   f"with {model.name}'s tokenizer; tokenize with the model's own tokenizer (quantize "
                                   "also takes plain text: --calib-text FILE)")


def _check_context(windows: np.ndarray, model: Path) -> None:
    """Windows fit the model's context length (genai_config.json's `context_length`): the
    rotary caches of a longer one are too short, deep inside onnxruntime's attention."""
    context = genai_settings(model.parent).get("context_length")
    if isinstance(context, int) and context > 0 and windows.shape[1] > context:
        raise CalibrationDataError(f"token windows of {windows.shape[1]} tokens are beyond the model's context length "
                                   f"{context} ({GENAI_CONFIG}); cut them to at most {context} tokens")


# What a file of token windows may hold: the ids, and the all-ones mask a tokenizer returns
# beside them (onnxq builds the mask, position ids and cache itself).
TOKEN_KEYS = frozenset({"input_ids", "attention_mask"})
Parts = list[tuple[str, dict[str, Any]]]  # (where, arrays or loaders) per file, in order


def _npz_part(path: Path) -> dict[str, Any] | None:
    """The token arrays of an .npz holding only them (read when called), else None."""
    try:
        with np.load(path) as arrays:
            keys = set(arrays.files)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None  # read as usual: a broken file gets the usual error
    if "input_ids" not in keys or not keys <= TOKEN_KEYS:
        return None
    def read(key: str) -> np.ndarray:
        with np.load(path) as arrays:
            return arrays[key]

    return {key: (lambda key=key: read(key)) for key in keys}


def _npy_part(path: Path) -> dict[str, Any] | None:
    """A .npy of integer windows [windows, tokens] as input_ids, else None."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError):
        return None
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        return None
    return {"input_ids": lambda: np.load(path)}


def _window_parts(data: Any) -> Parts | None:
    """`data` as token-window parts, where its form can be windows: an .npz of input_ids
    (and an attention mask), a .npy of integer windows, a folder of them, or a dict of
    those arrays; None for any other form (read as feeds of every input)."""
    if isinstance(data, dict):
        return [("the data", dict(data))] if "input_ids" in data and set(data) <= TOKEN_KEYS else None
    if not isinstance(data, str | Path):
        return None
    path = Path(data)
    readers = {".npz": _npz_part, ".npy": _npy_part}
    if path.is_file():
        part = readers[path.suffix](path) if path.suffix in readers else None
        return [(path.name, part)] if part is not None else None
    if not path.is_dir():
        return None
    parts: Parts = []
    for file in sorted(p for p in path.iterdir() if p.suffix in readers):  # the order the arrays reader takes
        part = readers[file.suffix](file)
        if part is None:  # a folder of images stops at its first file
            return None
        parts.append((file.name, part))
    return parts or None


def _windows(parts: Parts) -> np.ndarray:
    """The windows of `parts`, one array; a mask with padding, or windows of different
    lengths, refused (each window is cut from running text, all of one length)."""
    found = []
    for where, part in parts:
        read = {key: np.asarray(value() if callable(value) else value) for key, value in part.items()}
        ids = read["input_ids"]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise CalibrationDataError(f"{where}: token windows must be integers of shape [windows, tokens], got "
                                       f"{ids.dtype} {list(ids.shape)}")
        mask = read.get("attention_mask")
        if mask is not None and (mask.shape != ids.shape or not np.all(mask == 1)):
            raise CalibrationDataError(f"{where}: attention_mask marks padding (zeros) or has another shape than "
                                       "input_ids; give full windows of input_ids alone, all of one length (onnxq "
                                       "builds the attention mask and the KV cache itself)")
        found.append((where, ids))
    lengths = {ids.shape[-1] for _, ids in found}
    if len(lengths) > 1:
        raise CalibrationDataError(f"token windows of different lengths ({', '.join(map(str, sorted(lengths)))} "
                                   "tokens) across the files; cut them all to one length")
    return found[0][1] if len(found) == 1 else np.concatenate([ids for _, ids in found])


def decoder_feeds(model: Any, data: Any, providers: list[str] | None = None, decode_steps: int = DECODE_STEPS) -> Any:
    """`data` as decoder feeds when it is token windows (`_window_parts`: input_ids in an
    .npz, a .npy, a folder of them or a dict) for a KV-cache decoder at path `model`; else
    `data` unchanged."""
    if not isinstance(model, str | Path) or not str(model).endswith(".onnx"):
        return data
    parts = _window_parts(data)
    if parts is None:
        return data
    inputs = decoder_inputs(model)
    if inputs is None:
        return data
    return DecoderFeeds(model, _windows(parts), decode_steps, providers, inputs)
