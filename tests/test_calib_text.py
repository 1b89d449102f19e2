"""Calibration text for an onnxruntime-genai folder (`--calib-text`, `calibration.text`): the
folder's own tokenizer gives transformers' ids, the text calibrates exactly as an .npz of the
same token windows does (CLI, YAML config and Python API alike), and each mistake is one
line and exit status 2.

The tiny folder gets a byte-level BPE tokenizer (GPT-2's byte alphabet for newline and
printable ASCII, 30 merges: 129 ids of the model's 256) whose tokenizer_config.json names
transformers 5's `TokenizersBackend`, which onnxruntime-extensions 0.15 refuses (so the
stand-in class is what reads it). `EXPECTED` is what transformers 5.24 gives for `TEXT`
(`AutoTokenizer.from_pretrained(folder)(TEXT, add_special_tokens=False)`).

`test_a_real_folder_reads_as_onnxruntime_genai_does` runs on a real folder where
$ONNXQ_GENAI_DIR names one (../shared/tools/llm/genai_smollm2.py writes it) and skips
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from genai_model import build_genai_folder

import onnxq
from onnxq.calibrate.text import DEFAULT_WINDOWS, text_windows
from onnxq.calibrate.tokenizer import READERS, load_tokenizer, stand_in_class
from onnxq.cli import main
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError
from onnxq.notes import Topic, of

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ("<|endoftext|>", "<s>", "</s>")  # ids 0, 1, 2: the genai config's BOS 1 and EOS 2
# Each merge reaches its token the way BPE training would have (onnxruntime-extensions takes
# a whole word found in the vocabulary as one token, as trained merges always give it).
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("a", "n"), ("o", "n"),
          ("r", "e"), ("Ġ", "s"), ("e", "d"), ("n", "d"), ("Ġa", "nd"), ("Ġ", "w"), ("o", "u"), ("Ġ", "o"),
          ("in", "g"), ("Ġ", "b"), ("Ġ", "c"), ("a", "t"), ("e", "n"), ("Ġ", "h"), ("o", "r"), ("Ġo", "f"),
          ("Ġ", "m"), ("Ġ", "f"), ("l", "l"), ("a", "r"), ("Ġt", "o"), ("Ġ", "d")]
TEXT = ("The keeper of the harbour light walked the stone stairs at dusk and at dawn, and in all the years "
        "he kept it the lamp never failed.\nOn stormy nights he sat beside it and wrote letters to his sister.")
EXPECTED = [
    56, 100, 4, 79, 73, 73, 84, 103, 122, 101, 120, 126, 70, 113, 86, 4, 80, 77, 75, 76, 88, 112, 69, 80, 79,
    109, 101, 108, 88, 106, 73, 108, 88, 69, 77, 86, 87, 104, 88, 128, 89, 87, 79, 111, 104, 88, 128, 69, 91,
    82, 16, 111, 4, 102, 104, 125, 101, 4, 93, 73, 126, 87, 4, 100, 4, 79, 73, 84, 88, 4, 77, 88, 101, 4, 80,
    69, 81, 84, 4, 82, 73, 90, 103, 124, 69, 77, 80, 109, 18, 3, 51, 82, 108, 88, 121, 81, 93, 4, 82, 77, 75,
    76, 88, 87, 4, 100, 108, 118, 116, 73, 87, 77, 72, 73, 4, 77, 88, 111, 112, 86, 83, 88, 73, 4, 80, 73, 88,
    88, 103, 87, 127, 120, 77, 87, 108, 77, 87, 88, 103, 18,
]
WINDOWS, LENGTH = 3, 16  # --max-samples, --sequence-length: the first 48 of the 140 tokens
# GPTQ (weight-only: prefills alone) in blocks of 32, as the toy's hidden size of 64 wants.
FLAGS = ["--preset", "W4_GROUP128", "--algorithm", "gptq", "--per-group", "32", "--quiet"]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(folder: Path, tokenizer_class: str | None = "TokenizersBackend") -> Path:
    """tokenizer.json (byte-level BPE, module doc) and tokenizer_config.json naming
    `tokenizer_class` (None: no tokenizer_config.json) into `folder`."""
    chars = _byte_chars()
    pieces = [chars[b] for b in (0x0A, *range(0x20, 0x7F))] + [a + b for a, b in MERGES]
    vocab = {token: i for i, token in enumerate([*SPECIALS, *pieces])}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIALS)],
        "pre_tokenizer": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [list(m) for m in MERGES]},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    if tokenizer_class is not None:
        config = {"tokenizer_class": tokenizer_class, "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<|endoftext|>", "model_max_length": 128}
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tokenizer(build_genai_folder(tmp_path_factory.mktemp("genai")))


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "keeper.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.mark.parametrize("tokenizer_class, reader", [
    ("TokenizersBackend", "onnxruntime-extensions, tokenizer_class 'TokenizersBackend' read as 'GPT2Tokenizer'"),
    ("GPT2Tokenizer", "onnxruntime-extensions"),
    (None, "onnxruntime-extensions, no tokenizer_config.json read as 'GPT2Tokenizer'"),
])
def test_the_folder_tokenizer_gives_transformers_ids(tmp_path, tokenizer_class, reader):
    tokenizer = load_tokenizer(write_tokenizer(tmp_path, tokenizer_class))
    assert tokenizer.reader == reader
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int64 and ids.tolist() == EXPECTED


@pytest.mark.parametrize("vocabulary, stand_in", [
    ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}, "GPT2Tokenizer"),
    ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}}, "LlamaTokenizer"),
    ({"model": {"type": "BPE"}, "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}},
     "LlamaTokenizer"),
    ({"model": {"type": "BPE", "byte_fallback": True}}, "LlamaTokenizer"),
    ({"model": {"type": "Unigram"}}, "T5Tokenizer"),
    ({"model": {"type": "WordPiece"}}, None),
])
def test_the_stand_in_class_follows_the_tokenizer_model(vocabulary, stand_in):
    assert stand_in_class(vocabulary) == stand_in


def test_onnxruntime_genai_reads_it_the_same(folder):
    pytest.importorskip("onnxruntime_genai")
    read = dict(READERS)["onnxruntime-genai"]
    encode, reader = read(folder)
    assert reader == "onnxruntime-genai" and encode(TEXT).tolist() == EXPECTED


def test_text_calibrates_as_its_token_windows(folder, text, tmp_path):
    """--calib-text, a YAML config's calibration.text and the Python API give the model the
    .npz of the same windows gives, byte for byte."""
    windows = tmp_path / "windows.npz"
    np.savez(windows, input_ids=np.array(EXPECTED[:WINDOWS * LENGTH]).reshape(WINDOWS, LENGTH))
    assert main(["quantize", str(folder), str(tmp_path / "npz"), "--calib-data", str(windows), *FLAGS]) == 0
    assert main(["quantize", str(folder), str(tmp_path / "cli"), "--calib-text", str(text), "--max-samples",
                 str(WINDOWS), "--sequence-length", str(LENGTH), *FLAGS]) == 0
    calibration = {"text": str(text), "max_samples": WINDOWS, "sequence_length": LENGTH}
    config = tmp_path / "text.yaml"
    config.write_text(yaml.safe_dump({"calibration": calibration}))
    assert main(["quantize", str(folder), str(tmp_path / "yaml"), "--config", str(config), *FLAGS]) == 0
    api = onnxq.compose_config("W4_GROUP128", None, {
        "calibration": calibration, "algo_config": [{"name": "gptq"}],
        "global_quant_config": {"weight": {"qscheme": "per_group", "group_size": 32}}})
    result = onnxq.quantize(str(folder), str(tmp_path / "api"), api, progress=False)
    expected = (tmp_path / "npz" / "model.onnx").read_bytes()
    for run in ("cli", "yaml", "api"):
        assert (tmp_path / run / "model.onnx").read_bytes() == expected, run
    text_note, windows_note = [n.text for n in of(result.summary.notes, Topic.CALIBRATION)][:2]
    assert text_note == (f"calibration text: keeper.txt, {len(EXPECTED)} tokens (onnxruntime-extensions, "
                         "tokenizer_class 'TokenizersBackend' read as 'GPT2Tokenizer'), cut into 3 windows of 16 tokens")
    assert windows_note.startswith("calibration data: 3 token windows of 16 tokens")


def test_calibrate_writes_the_statistics_of_the_windows(folder, text, tmp_path):
    """`onnxq calibrate --calib-text` (static U8S8: prefills and decode steps) saves the
    statistics the .npz of its 8 windows of 16 tokens gives."""
    windows = tmp_path / "windows.npz"
    np.savez(windows, input_ids=np.array(EXPECTED[:8 * LENGTH]).reshape(8, LENGTH))
    model = str(folder / "model.onnx")
    assert main(["calibrate", model, "--calib-data", str(windows), "--stats", str(tmp_path / "npz.npz"),
                 "--preset", "U8S8", "--quiet"]) == 0
    assert main(["calibrate", model, "--calib-text", str(text), "--sequence-length", str(LENGTH), "--stats",
                 str(tmp_path / "text.npz"), "--preset", "U8S8", "--quiet"]) == 0
    with np.load(tmp_path / "npz.npz") as a, np.load(tmp_path / "text.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)


def test_windows_default_to_the_context_length_and_every_whole_window(folder, text, tmp_path):
    """Without sequence_length the windows are 256 tokens or the context length if shorter
    (the toy's 128); without max_samples, every whole window up to 64."""
    cut = text_windows(folder / "model.onnx", CalibrationConfig(text=str(text)), None)
    assert cut.windows.shape == (1, 128) and cut.windows[0].tolist() == EXPECTED[:128]
    cut = text_windows(folder / "model.onnx", CalibrationConfig(text=str(text), sequence_length=32), None)
    assert cut.windows.shape == (4, 32) and cut.tokens == len(EXPECTED)
    cut = text_windows(folder / "model.onnx", CalibrationConfig(text=str(text), sequence_length=2), None)
    assert cut.windows.shape == (DEFAULT_WINDOWS, 2) == (64, 2)
    with pytest.raises(CalibrationDataError, match="both calibration text"):
        onnxq.quantize(str(folder), str(tmp_path / "out"), {"calibration": {"text": str(text)}}, {"input_ids": [[1]]})


def _no_tokenizer(folder: Path, root: Path) -> Path:
    bare = root / "bare"
    shutil.copytree(folder, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    return bare


def _word_level(folder: Path, root: Path) -> Path:
    """A tokenizer model the readers do not read (WordLevel): refused before any native
    reader sees it (they read it now and then, or crashed on unknown models)."""
    odd = root / "word_level"
    shutil.copytree(folder, odd)
    (odd / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}))
    return odd


# (what is wrong, the arguments after `quantize` given the fixtures, what the one line says)
BAD = {
    "no tokenizer": (lambda f, t, r: [str(_no_tokenizer(f, r)), "--calib-text", str(t)],
                     "has no tokenizer.json, so calibration text cannot be tokenized"),
    "unreadable tokenizer": (lambda f, t, r: [str(_word_level(f, r)), "--calib-text", str(t)],
                             "cannot load the tokenizer in"),
    "too short": (lambda f, t, r: [str(f), "--calib-text", str(_write(r / "short.txt", "Short.")),
                                   "--sequence-length", "16"],
                  "gives 5 tokens, fewer than one window of 16; give more text or shorter windows"),
    "empty": (lambda f, t, r: [str(f), "--calib-text", str(_write(r / "empty.txt", "\n"))],
              "empty.txt is empty; give a plain text file"),
    "missing": (lambda f, t, r: [str(f), "--calib-text", str(r / "nowhere.txt")],
                "calibration text not found"),
    "a directory": (lambda f, t, r: [str(f), "--calib-text", str(t.parent)],
                    "is a directory; pass one plain text file"),
    "not a decoder": (lambda f, t, r: [str(ROOT / "models" / "digits_cnn.onnx"), "--calib-text", str(t)],
                      "which digits_cnn.onnx is not; pass --calib-data instead"),
    "both": (lambda f, t, r: [str(f), "--calib-text", str(t), "--calib-data", str(r / "w.npz")],
             "both calibration text (--calib-text, calibration.text) and calibration data (--calib-data)"),
    "beyond the context": (lambda f, t, r: [str(f), "--calib-text", str(t), "--sequence-length", "129"],
                           "sequence_length 129 (--sequence-length) is beyond the model's context length 128"),
    "zero length": (lambda f, t, r: [str(f), "--calib-text", str(t), "--sequence-length", "0"],
                    "invalid --sequence-length 0 in calibration"),
    "ids beyond the vocabulary": (lambda f, t, r: [str(f), "--gptq", "--calib-data", str(_ids(r, 300))],
                                  "token windows hold id 300, beyond the vocabulary of 256: they were not made with"),
    "negative ids": (lambda f, t, r: [str(f), "--gptq", "--calib-data", str(_ids(r, -1))],
                     "token windows hold id -1, below 0: padding or ignored labels are not tokens"),
    "ids beyond the token table (no vocab_size)": (
        lambda f, t, r: [str(_no_vocab_size(f, r)), "--gptq", "--calib-data", str(_ids(r, 256))],
        "token windows hold id 256, beyond the vocabulary of 256: they were not made with"),
}


def _no_vocab_size(folder: Path, root: Path) -> Path:
    """The folder with genai_config.json naming no vocab_size: the token table's rows count."""
    bare = root / "no_vocab_size"
    shutil.copytree(folder, bare)
    settings = json.loads((bare / "genai_config.json").read_text())
    del settings["model"]["vocab_size"]
    (bare / "genai_config.json").write_text(json.dumps(settings))
    return bare


def _ids(folder: Path, token: int) -> Path:
    """Token windows (.npz of input_ids) with one `token` among valid ids."""
    windows = np.ones((2, 16), np.int64)
    windows[1, 5] = token
    np.savez(folder / "ids.npz", input_ids=windows)
    return folder / "ids.npz"


def _write(path: Path, content: str) -> Path:
    path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_mistake_is_one_line_and_exit_2(folder, text, tmp_path, capsys, case):
    arguments, says = BAD[case]
    model, *flags = arguments(folder, text, tmp_path)
    out = tmp_path / "out"
    np.savez(tmp_path / "w.npz", input_ids=np.ones((2, 16), np.int64))
    assert main(["quantize", model, str(out), *flags, "--preset", "W4_GROUP128", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxq: error: ") and says in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_real_folder_reads_as_onnxruntime_genai_does():
    """On a real onnxruntime-genai folder ($ONNXQ_GENAI_DIR, e.g. SmolLM2-135M, whose
    tokenizer_config.json names TokenizersBackend): onnxq's tokenizer gives the ids the
    folder deploys with (onnxruntime-genai's reader) on a few paragraphs of prose."""
    folder = Path(os.environ.get("ONNXQ_GENAI_DIR", "/nonexistent"))
    if not (folder / "tokenizer.json").is_file() or not (folder / "genai_config.json").is_file():
        pytest.skip("no real onnxruntime-genai folder: set $ONNXQ_GENAI_DIR to one with its tokenizer")
    pytest.importorskip("onnxruntime_genai")
    prose = "\n\n".join([TEXT, (ROOT / "README.md").read_text(encoding="utf-8")[:4000], "Café, naïve, 12,345 — “quoted”."])
    ours = load_tokenizer(folder).encode(prose)
    deployed, _ = dict(READERS)["onnxruntime-genai"](folder)
    assert ours.tolist() == deployed(prose).tolist()
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    assert len(ours) > 500 and int(ours.max()) < vocab
