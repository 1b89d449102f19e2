"""An onnxruntime-genai folder in, a smaller folder out, with every weight-only algorithm:
the output keeps the genai ops, loads and generates in onnxruntime-genai, and its logits on
a prefill stay close to the float model's. GPTQ and AWQ calibrate on token windows (an
.npz of input_ids): onnxq builds the attention mask and KV cache and observes decode
steps too."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from genai_model import build_genai_folder, genai_generate
from helpers import session, sqnr_db

import onnxq
from onnxq.calibrate.decoder import DecoderFeeds
from onnxq.notes import Topic, of

LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 16
PROMPT = [5, 17, 200, 3, 99, 42, 7, 64]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_genai_folder(tmp_path_factory.mktemp("genai"), layers=LAYERS, kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "windows.npz"
    np.savez(path, input_ids=np.random.default_rng(3).integers(0, 256, (6, 16)))
    return path


def prefill_logits(model_path) -> np.ndarray:
    feeds = {"input_ids": np.array([PROMPT], np.int64), "attention_mask": np.ones((1, len(PROMPT)), np.int64),
             **{f"past_key_values.{i}.{kind}": np.zeros((1, KV_HEADS, 0, HEAD_SIZE), np.float32)
                for i in range(LAYERS) for kind in ("key", "value")}}
    return session(model_path, threads=1).run(["logits"], feeds)[0]


# (preset, algorithm entry, calibration windows?, logits SQNR floor in dB). Random weights
# carry each int4 layer's ~20 dB error through the layers to 5-8 dB at the logits (int8:
# about 30 dB); a broken lowering or cache gives 0 dB or less.
CASES = {
    "rtn": ("W4_GROUP128", None, False, 4.0),
    "hqq": ("W4_GROUP128", "hqq", False, 4.0),
    "gptq": ("W4_GROUP128", "gptq", True, 4.0),
    "awq": ("W4_GROUP128", "awq", True, 4.0),
    "int8": ("W8_GROUP128", None, False, 25.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_algorithm_gives_a_folder_that_generates(folder, windows, tmp_path, case):
    preset, algorithm, calibrated, floor = CASES[case]
    # Blocks of 32, as the model builder's int4 default: this toy's hidden size is 64.
    overrides = {"layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}
    config = onnxq.compose_config(preset, None, {**overrides, "algo_config": [{"name": algorithm}] if algorithm else []})
    out = tmp_path / "out"
    result = onnxq.quantize(str(folder), str(out), config, str(windows) if calibrated else None, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["genai_config.json", "model.onnx"]
    assert json.loads((out / "genai_config.json").read_text()) == json.loads((folder / "genai_config.json").read_text())
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") >= 4 * LAYERS and ops.count("GroupQueryAttention") == LAYERS
    assert result.summary.size_after < 0.5 * result.summary.size_before
    if algorithm:
        (note,) = of(result.summary.notes, Topic.ALGORITHM, algorithm)
        assert "quantized" in note.text or "scaled" in note.text
    if calibrated:
        (windows_note,) = [n for n in of(result.summary.notes, Topic.CALIBRATION) if "token windows" in n.text]
        # weight-only: the prefills alone (decode steps would add time, not accuracy)
        assert "6 token windows of 16 tokens, each a prefill (weight-only" in windows_note.text
    assert sqnr_db(prefill_logits(folder / "model.onnx"), prefill_logits(out / "model.onnx")) > floor
    generated = genai_generate(out, PROMPT, 8)
    assert len(generated) == 8 and all(0 <= t < 256 for t in generated)


def test_token_windows_feed_prefill_and_decode_steps(folder):
    feeds = DecoderFeeds(folder / "model.onnx", np.arange(24).reshape(2, 12), decode_steps=3)
    shapes = []
    while (feed := feeds.get_next()) is not None:
        shapes.append((feed["input_ids"].shape[1], feed["attention_mask"].shape[1],
                       feed["past_key_values.0.key"].shape[2]))
    # Per window: a prefill of 9 tokens on an empty cache, then 3 single tokens on the growing cache.
    assert shapes == [(9, 9, 0), (1, 10, 9), (1, 11, 10), (1, 12, 11)] * 2
    feeds.rewind()
    assert feeds.get_next()["input_ids"].shape == (1, 9)


def test_static_activations_observe_the_decode_steps(folder, windows, tmp_path):
    """Where activations are calibrated, their ranges come from prefills and decode steps
    alike: the decode activations are the deployed ones."""
    result = onnxq.quantize(str(folder), str(tmp_path / "u8"), "U8S8", str(windows), progress=False)
    (note,) = [n for n in of(result.summary.notes, Topic.CALIBRATION) if "token windows" in n.text]
    assert "each a prefill and 4 decode steps with the KV cache" in note.text
    assert result.summary.calibration_samples == 6 * 5  # a prefill and 4 steps per window
    assert sqnr_db(prefill_logits(folder / "model.onnx"), prefill_logits(tmp_path / "u8" / "model.onnx")) > 10
