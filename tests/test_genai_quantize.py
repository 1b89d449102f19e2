"""An onnxruntime-genai folder in, a smaller folder out, with every weight-only algorithm:
the output keeps the genai ops, loads and generates in onnxruntime-genai, and its logits on
a prefill stay close to the float model's. GPTQ and AWQ calibrate on token windows (an
.npz of input_ids): onnxq builds the attention mask and KV cache and observes decode
steps too."""

from __future__ import annotations

import json
import re

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


def test_bad_token_windows_are_one_line_errors(folder, tmp_path):
    """Windows past the context length (128 here) and an empty set stop before any work,
    with the fix; before, the first ran into onnxruntime's rotary cache (a traceback) and
    the second gave GPTQ nothing and a model rounded to nearest."""
    from onnxq.cli import main

    long, empty = tmp_path / "long.npz", tmp_path / "empty.npz"
    np.savez(long, input_ids=np.zeros((2, 200), np.int64))
    np.savez(empty, input_ids=np.zeros((0, 16), np.int64))
    for data, words in ((long, "token windows of 200 tokens are beyond the model's context length 128"),
                        (empty, "the token windows hold no window")):
        with pytest.raises(onnxq.OnnxqError, match=words):
            onnxq.quantize(str(folder), str(tmp_path / "out"), {"preset": "W4_GROUP128",
                                                                 "algo_config": [{"name": "gptq"}]},
                           str(data), progress=False)
    assert not (tmp_path / "out").exists()
    assert main(["quantize", str(folder), str(tmp_path / "o"), "--preset", "W4_GROUP128", "--gptq", "--awq",
                 "--calib-data", str(empty)]) == 2


def test_token_windows_evaluate_as_they_calibrate(folder, windows, tmp_path, capsys):
    """The windows quantize reads also serve compare, the HTML report and an accuracy
    target (each builds the mask and the empty cache); compare reports the logits, not
    the KV cache handed on; a report with no data is refused before anything is written."""
    from onnxq.cli import main

    out = tmp_path / "w4"
    assert main(["quantize", str(folder), str(out), "--preset", "W4_GROUP128", "--per-group", "32",
                 "--calib-data", str(windows), "--report", str(tmp_path / "r.html"), "--quiet"]) == 0
    assert (tmp_path / "r.html").stat().st_size > 1000
    assert main(["compare", str(folder), str(out), "--data", str(windows)]) == 0
    shown = capsys.readouterr().out
    assert "logits: SQNR" in shown and "present." not in shown and "next-token perplexity on 90 tokens" in shown
    # run too (it stopped on 'missing input attention_mask'; second new-user trial)
    assert main(["run", str(out), "--data", str(windows)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("logits: float32 [6, 16,") and "present." not in shown, shown
    from onnxq.evaluate import compare_models

    same = compare_models(str(folder / "model.onnx"), str(folder / "model.onnx"), str(windows))
    base, quant = same.next_token  # the float model against itself: the same perplexity, every token agreed
    assert base.tokens == 6 * 15 and quant.perplexity() == base.perplexity() > 1 and quant.agreement() == 1.0
    target = onnxq.quantize(str(folder), None, {"preset": "W4_GROUP128", "layer_type_quant_config": {
        "MatMul": {"weight": {"group_size": 32}}}, "mixed_precision": {"target": "sqnr>=0"}}, str(windows),
        progress=False)
    assert target.summary.mixed_precision.met
    assert main(["quantize", str(folder), str(tmp_path / "none"), "--preset", "W4_GROUP128",
                 "--report", str(tmp_path / "r2.html")]) == 2
    err = capsys.readouterr().err
    assert "the report measures the quantized model on data" in err
    assert "pass --eval-data PATH or --calib-data PATH; for an LLM, token windows or --calib-text FILE" in err
    assert not (tmp_path / "none").exists()


def test_the_windows_note_counts_what_was_read(folder, windows, tmp_path):
    """max_samples caps the windows read, and the note says so; windows nothing reads
    (the decoder default, no output check) get no note describing them."""
    capped = onnxq.quantize(str(folder), None, {"preset": "W4_GROUP128", "algo_config": [{"name": "gptq"}],
                                                "calibration": {"max_samples": 2}}, str(windows), progress=False)
    assert "calibration data: 2 of 6 token windows (max_samples 2) of 16 tokens" in " ".join(capped.summary.note_texts)
    unread = onnxq.quantize(str(folder), str(tmp_path / "w8"), {"calibration": {"check_samples": 0}},
                            str(windows), progress=False)  # no output check reads them either
    texts = " ".join(unread.summary.note_texts)
    assert "calibration data (--calib-data, --calib-text) not needed" in texts and "(unused)" in texts
    assert "token windows of" not in texts


def test_the_model_file_of_a_folder_and_flag_words(folder, tmp_path, capsys):
    """A genai folder's model.onnx given alone: an output ending in a separator is refused
    (it became a file of that name), an existing folder as output names the folder input
    that gives a folder out, and a file output gets a note that the genai files were not
    copied. Switch flags and per-tensor weights are named as the user gave them."""
    from onnxq.cli import main

    model = str(folder / "model.onnx")
    assert main(["quantize", model, str(tmp_path / "o") + "/"]) == 2
    assert "ends in a separator" in capsys.readouterr().err and not (tmp_path / "o").exists()
    (tmp_path / "d").mkdir()
    assert main(["quantize", model, str(tmp_path / "d")]) == 2
    assert f"pass the model's folder {folder}" in capsys.readouterr().err
    result = onnxq.quantize(model, str(tmp_path / "m.onnx"), None, progress=False)
    assert any("only the model was written, without genai_config.json" in t for t in result.summary.note_texts)
    assert not any("fold_batchnorm" in t for t in result.summary.note_texts)  # a default pass with nothing to do
    assert main(["quantize", str(folder), str(tmp_path / "dy"), "--dynamic"]) == 2
    assert "error: --dynamic has no activations to apply to" in capsys.readouterr().err
    flat = onnxq.quantize(str(folder), None, {"preset": "W4_GROUP128", "global_quant_config": {
        "weight": {"qscheme": "per_tensor"}}}, progress=False)
    assert "the weights are per-tensor, not in blocks" in " ".join(flat.summary.note_texts)
    assert main(["inspect", str(folder), "--preset", "W4_GROUP128"]) == 0
    printed = capsys.readouterr().out
    cache = [line for line in printed.splitlines() if "past_key_values." in line or "present." in line]
    assert len(cache) == 2 and "4 KV-cache inputs" in cache[0]  # one line each way, not one per layer
    assert "tied: " in printed and "one copy, blocks of 32" in printed


def test_a_sliding_window_cache_is_fed_a_cache_of_the_window(tmp_path, windows):
    """The model builder writes `sliding_window_cache` on Gemma2's local-attention GQA,
    and onnxruntime refuses such a cache shorter than the window: prefills on an empty
    cache stopped GPTQ with a traceback and skipped the check without a word. The feeds
    now start from a zero cache of the window's length (the logits of a model without a
    sliding cache, to the bit), and every recipe runs, checks and generates."""
    folder = build_genai_folder(tmp_path / "sliding", layers=LAYERS, kv_heads=KV_HEADS)
    model = onnx.load(str(folder / "model.onnx"))
    plain = tmp_path / "plain.onnx"  # no sliding cache: the reference logits
    onnx.save(model, str(plain))
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    for attribute in gqa.attribute:
        if attribute.name == "local_window_size":
            attribute.i = 32
    gqa.attribute.append(onnx.helper.make_attribute("sliding_window_cache", 1))
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    feeds = DecoderFeeds(folder / "model.onnx", np.arange(24).reshape(2, 12), decode_steps=1)
    first = feeds.get_next()
    assert first["past_key_values.0.key"].shape == (1, KV_HEADS, 32, HEAD_SIZE)
    assert first["past_key_values.1.key"].shape == (1, KV_HEADS, 0, HEAD_SIZE)
    reference = {**first, **{k: v[:, :, :0] for k, v in first.items() if k.startswith("past_")}}
    want = session(plain, threads=1).run(["logits"], reference)[0]
    assert np.array_equal(session(folder / "model.onnx", threads=1).run(["logits"], first)[0], want)
    config = onnxq.compose_config("W4_GROUP128", None, {
        "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}, "algo_config": [{"name": "gptq"}]})
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), config, str(windows), progress=False)
    assert result.summary.fidelity is not None and result.summary.fidelity.sqnr_db > 4


def test_a_folder_without_its_genai_config_says_so(folder, windows, tmp_path):
    """The graph leaves the caches' head size symbolic and genai_config.json gives it; a
    folder missing that file said only 'needs ... head_size fixed or in genai_config.json
    ...; pass calibration feeds with every input' (new-user trial)."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "genai_config.json").unlink()
    model = onnx.load(str(bare / "model.onnx"), load_external_data=False)
    past = next(v for v in model.graph.input if v.name.startswith("past_key_values"))
    if past.type.tensor_type.shape.dim[3].dim_value:
        pytest.skip("this toy folder's caches have a fixed head size")
    config = {"preset": "W4_GROUP128", "algo_config": [{"name": "gptq"}],
              "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}
    with pytest.raises(onnxq.OnnxqError, match="symbolic head_size, and no genai_config.json beside the model"):
        onnxq.quantize(str(bare), str(tmp_path / "out"), config, str(windows), progress=False)


def test_a_genai_config_that_is_not_json_is_said_so(folder, tmp_path):
    """A truncated genai_config.json had been said to "name no model file" (LLM trial)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "genai_config.json").write_text('{"model": {"decoder": ')
    with pytest.raises(onnxq.ModelError, match=r"genai_config.json is not valid JSON \(Expecting value: line 1"):
        onnxq.quantize(str(broken), str(tmp_path / "out"), "W4_GROUP128", progress=False)
    assert not (tmp_path / "out").exists()


def test_token_windows_in_every_form_the_data_flags_take(folder, windows, tmp_path, capsys):
    """`--calib-data` takes .npz, .npy or a folder of them: token windows in each form (and
    an .npz holding a tokenizer's all-ones attention_mask beside them) give the model one
    .npz of input_ids gives; a mask with padding and windows of two lengths are one-line
    errors naming the fix (LLM trial: each had asked for the KV cache as an input)."""
    from onnxq.cli import main

    ids = np.load(windows)["input_ids"]
    forms = tmp_path / "forms"
    (forms / "folder").mkdir(parents=True)
    np.savez(forms / "folder" / "a.npz", input_ids=ids[:3])
    np.save(forms / "folder" / "b.npy", ids[3:])
    np.save(forms / "ids.npy", ids)
    np.savez(forms / "masked.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    config = {"preset": "W4_GROUP128", "algo_config": [{"name": "gptq"}]}
    onnxq.quantize(str(folder), str(tmp_path / "ref"), config, str(windows), progress=False)
    expected = (tmp_path / "ref" / "model.onnx").read_bytes()
    for data in ("folder", "ids.npy", "masked.npz"):
        onnxq.quantize(str(folder), str(tmp_path / data), config, str(forms / data), progress=False)
        assert (tmp_path / data / "model.onnx").read_bytes() == expected, data
    padded, uneven = forms / "padded.npz", forms / "uneven"
    mask = np.ones_like(ids)
    mask[0, -3:] = 0
    np.savez(padded, input_ids=ids, attention_mask=mask)
    uneven.mkdir()
    np.save(uneven / "a.npy", ids)
    np.save(uneven / "b.npy", ids[:, :8])
    mixed = forms / "mixed"
    mixed.mkdir()
    np.savez(mixed / "a.npz", input_ids=ids)
    np.savez(mixed / "b.npz", input_ids=ids[0])  # one window without its axis: a traceback had followed (review)
    for data, words in ((padded, "attention_mask marks padding"), (uneven, "different lengths \\(8, 16 tokens\\)"),
                        (mixed, "b.npz: token windows must be integers of shape \\[windows, tokens\\]")):
        capsys.readouterr()
        assert main(["quantize", str(folder), str(tmp_path / "x"), "--preset", "W4_GROUP128", "--gptq",
                     "--calib-data", str(data)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(words, err), err
    assert main(["compare", str(folder), str(tmp_path / "ref"), "--data", str(forms / "ids.npy")]) == 0


def test_the_summary_says_what_read_the_data_and_what_fitted(folder, windows, tmp_path, monkeypatch):
    """LLM trial: round-to-nearest with data said how the windows were cut and nothing of
    their not being read (the output came out byte-identical); a check cut short by the
    float outputs' memory cap said "2 samples" for 4 asked; an algorithm with nothing to
    do (an already-int4 folder) was said to have fitted the model; the report called
    round-to-nearest's data "fitted to"; "calibration: none" read as no data."""
    import onnxq.emit.fidelity as fidelity

    rtn = onnxq.quantize(str(folder), str(tmp_path / "rtn"), {"preset": "W4_GROUP128",
                                                              "calibration": {"check_samples": 0}},
                         str(windows), progress=False)
    assert any(n.startswith("the calibration data was not read") for n in rtn.summary.note_texts)
    assert "calibration: no activation ranges" in onnxq.format_summary(rtn)
    gptq = {"preset": "W4_GROUP128", "algo_config": [{"name": "gptq"}]}
    fitted = onnxq.quantize(str(folder), str(tmp_path / "gptq"), gptq, str(windows), progress=False)
    assert not any(n.startswith("the calibration data was not read") for n in fitted.summary.note_texts)
    assert fitted.summary.fidelity.fitted_by == ("gptq",)
    again = onnxq.quantize(str(tmp_path / "gptq"), str(tmp_path / "again"), gptq, str(windows), progress=False,
                           report=str(tmp_path / "again.html"))
    assert any("no MatMul lowered" in n for n in again.summary.note_texts)
    assert again.summary.fidelity.fitted_by == () and "fitted" not in again.summary.fidelity.line()
    assert any("nothing in this recipe was fitted to it" in n for n in again.summary.note_texts)  # the report's too
    timed = onnxq.quantize(str(folder), str(tmp_path / "timed"), {"preset": "W4_GROUP128", "calibration": {
        "check_samples": 0, "measure_latency": True}}, str(windows), progress=False)
    assert timed.summary.latency is not None  # the latency read the data (review)
    assert not any(n.startswith("the calibration data was not read") for n in timed.summary.note_texts)
    monkeypatch.setattr(fidelity, "REFERENCE_BYTES", 1)  # every sample's outputs past the cap: one is held
    capped = onnxq.quantize(str(folder), str(tmp_path / "capped"), {"preset": "W4_GROUP128",
                                                                     "calibration": {"check_samples": 4}},
                            str(windows), progress=False)
    assert capped.summary.fidelity.samples == 1
    assert "check on 1 calibration samples of the 4 asked: the float outputs" in capped.summary.fidelity.line()
    monkeypatch.undo()
    reported = onnxq.quantize(str(folder), str(tmp_path / "reported"), "W4_GROUP128", str(windows), progress=False,
                              report=str(tmp_path / "r.html"))
    assert any("nothing in this recipe was fitted to it" in n for n in reported.summary.note_texts)


def test_what_the_output_folder_held_is_said(folder, tmp_path):
    """LLM trial: a user's own genai_config.json in the output folder was replaced, and an
    output named like a model file became a folder, both without a word. A rerun into the
    same folder replaces nothing new, and says nothing of it."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "genai_config.json").write_text("{}")
    (busy / "notes.txt").write_text("keep me")
    said = onnxq.quantize(str(folder), str(busy), "W4_GROUP128", progress=False).summary.note_texts
    assert "replaced 1 file the output folder held with the input folder's: genai_config.json" in said
    assert any(n.startswith("the output folder also holds 1 file") and "notes.txt" in n for n in said)
    assert (busy / "notes.txt").read_text() == "keep me"
    again = onnxq.quantize(str(folder), str(busy), "W4_GROUP128", progress=False).summary.note_texts
    assert not any(n.startswith("replaced") for n in again)
    named = tmp_path / "int4.onnx"
    said = onnxq.quantize(str(folder), str(named), "W4_GROUP128", progress=False).summary.note_texts
    assert f"the input is a model folder, so the output {named} is a folder too: its model is " \
           f"{named / 'model.onnx'}" in said
    assert (named / "model.onnx").is_file()


def test_inspect_shows_each_kv_cache_shape(folder, tmp_path, capsys):
    """Gemma2's sliding-window layers take a cache of another length (past_sliding_length):
    inspect had shown every layer with the first one's shape (families trial)."""
    from onnxq.cli import main

    model = onnx.load(str(folder / "model.onnx"))
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.0.", "present.0.")):
            value.type.tensor_type.shape.dim[2].dim_param = "sliding_length"
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data")
    assert main(["inspect", str(path)]) == 0
    cache = [line for line in capsys.readouterr().out.splitlines() if "KV-cache" in line]
    assert len(cache) == 4, cache  # inputs and outputs: a line per shape
    assert "past_key_values.0.key ... past_key_values.0.value: 2 KV-cache inputs" in cache[0]
    assert "sliding_length" in cache[0] and "sliding_length" not in cache[1]
