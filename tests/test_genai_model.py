"""The tiny random onnxruntime-genai folder (tests/genai_model.py) is a working decoder LLM.

Its KV cache is wired right (a decode step over the presents equals a longer prefill), and
onnxruntime-genai loads the folder and generates what a plain onnxruntime greedy loop does.
"""

from __future__ import annotations

import json

import genai_model
import numpy as np
import onnx
import pytest
from genai_model import EOS_TOKEN_ID, build_genai_folder, build_genai_model, genai_generate
from helpers import session

LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 16
PROMPT = [5, 17, 200, 3, 99, 42]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_genai_folder(tmp_path_factory.mktemp("genai"), layers=LAYERS, kv_heads=KV_HEADS)


def _empty_cache():
    return {f"past_key_values.{i}.{kind}": np.zeros((1, KV_HEADS, 0, HEAD_SIZE), np.float32)
            for i in range(LAYERS) for kind in ("key", "value")}


def _step(sess, tokens, past):
    """One forward over `tokens` after the cached `past`: (last-position logits, presents)."""
    total = len(tokens) + next(iter(past.values())).shape[2]
    feeds = {"input_ids": np.array([tokens], np.int64),
             "attention_mask": np.ones((1, total), np.int64), **past}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    presents = {name: out[name.replace("past_key_values", "present")] for name in past}
    return out["logits"][0, -1], presents


def _greedy(sess, prompt, new_tokens):
    """Greedy decoding with the KV cache, stopping after EOS as onnxruntime-genai does."""
    tokens, feed, past = [], list(prompt), _empty_cache()
    for _ in range(new_tokens):
        logits, past = _step(sess, feed, past)
        feed = [int(logits.argmax())]
        tokens += feed
        if feed[0] == EOS_TOKEN_ID:
            break
    return tokens


def test_folder_layout(folder):
    assert sorted(p.name for p in folder.iterdir()) == ["genai_config.json", "model.onnx",
                                                        "model.onnx.data"]
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"]) == (LAYERS, KV_HEADS)


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_folder_is_what_onnx_save_writes(tmp_path, monkeypatch, tied):
    """`build_genai_folder` writes each weight as it is drawn (the 1.1B benchmark's 4.4 GB
    in a few hundred MB), in slices of rows: the bytes `onnx.save_model` writes for the
    whole model."""
    monkeypatch.setattr(genai_model, "DRAW_CHUNK", 1000)  # every big weight drawn in several slices
    streamed = build_genai_folder(tmp_path / "streamed", tie_embeddings=tied)
    whole = tmp_path / "whole"
    whole.mkdir()
    monkeypatch.setattr(genai_model, "DRAW_CHUNK", 1 << 30)
    onnx.save_model(build_genai_model(tie_embeddings=tied), whole / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    for name in ("model.onnx", "model.onnx.data"):
        assert (streamed / name).read_bytes() == (whole / name).read_bytes()


def test_decode_step_matches_longer_prefill(folder):
    sess = session(folder / "model.onnx", threads=1)
    _, presents = _step(sess, PROMPT[:5], _empty_cache())
    assert presents["past_key_values.0.key"].shape == (1, KV_HEADS, 5, HEAD_SIZE)
    decoded, _ = _step(sess, PROMPT[5:], presents)
    prefilled, _ = _step(sess, PROMPT, _empty_cache())
    np.testing.assert_allclose(decoded, prefilled, atol=1e-4, rtol=0)
    assert prefilled.std() > 0.3  # random, not degenerate, logits


def test_genai_generates_what_onnxruntime_does(folder):
    prompt, new_tokens = PROMPT[:5], 8
    generated = genai_generate(folder, prompt, new_tokens)

    assert generated == _greedy(session(folder / "model.onnx", threads=1), prompt, new_tokens)
    assert len(set(generated)) > 2  # the cache and the layers steer it: not one repeated token
