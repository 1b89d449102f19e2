"""The output check every quantization ends with: the emitted model against the float one
on the first `check_samples` calibration samples, in a default onnxruntime session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import gemm, random_feeds, residual, save

import onnxq
from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.errors import ConfigError
from onnxq.evaluate import compare_models
from onnxq.notes import Topic, of

CLIPPED = {"global_quant_config": {
    "input_tensors": {"calib_method": "percentile", "percentile": 50.0},
    "output_tensors": {"calib_method": "percentile", "percentile": 50.0}}}


def test_check_matches_compare_on_the_same_samples(tmp_path):
    """The figures are the ones `compare` gives on those samples (deployed session)."""
    model = residual()
    calib = random_feeds(model, 24, seed=1)
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, "U8S8", calib)
    check = result.summary.fidelity
    assert check.samples == 8 and check.output == model.graph.output[0].name
    first = {k: np.concatenate([f[k] for f in calib[:8]]) for k in calib[0]}
    measured = compare_models(save(model, tmp_path / "m.onnx"), out, first)
    assert check.sqnr_db == pytest.approx(measured.outputs[0].sqnr_db, abs=0.01)
    assert check.cosine == pytest.approx(measured.outputs[0].cosine, abs=1e-4)
    text = onnxq.format_summary(result.summary)
    assert f"SQNR {check.sqnr_db:.1f} dB" in text and "warning: output" not in text
    assert check.sqnr_db > 25  # U8S8 on this model: 32 dB


def test_a_recipe_far_from_float_is_a_warning():
    """Ranges clipped at the median (percentile 50) wreck the model: the summary says so."""
    model = residual()
    result = onnxq.quantize(model, None, compose_config("U8S8", None, CLIPPED), random_feeds(model, 24, seed=1))
    assert result.summary.fidelity.sqnr_db < 5
    text = onnxq.format_summary(result.summary)
    assert "warning: output" in text and "far from the float model" in text and "onnxq analyze" in text


def test_class_scores_get_top1_agreement_and_the_model_does_not_change():
    model = gemm()
    calib = random_feeds(model, 12, seed=3)
    checked = onnxq.quantize(model, None, "U8S8", calib)
    unchecked = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": 0}}), calib)
    assert checked.model.SerializeToString() == unchecked.model.SerializeToString()
    assert unchecked.summary.fidelity is None and "check on" not in onnxq.format_summary(unchecked.summary)
    assert checked.summary.fidelity.top1_agreement is not None
    assert 0.0 <= checked.summary.fidelity.top1_agreement <= 1.0


def test_no_check_without_replayable_data_or_samples():
    model = residual()
    feeds = random_feeds(model, 12, seed=1)
    once = onnxq.quantize(model, None, "U8S8", iter(feeds))  # a one-shot iterator: read by calibration only
    assert once.summary.fidelity is None
    assert any(n.startswith("output check skipped: the calibration data") and "read only once" in n
               for n in once.summary.note_texts), once.summary.note_texts  # said, not silently dropped
    off = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": 0}}),
                         iter(feeds))
    assert not any(n.startswith("output check skipped") for n in off.summary.note_texts)  # turned off: nothing to say
    few = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": 3}}), feeds)
    assert few.summary.fidelity.samples == 3
    dataless = onnxq.quantize(model, None, compose_config("W8_DYNAMIC", None, {"calibration": {"check_samples": 3}}))
    assert dataless.summary.fidelity is None and any(  # asked for with no data: said
        "calibration.check_samples 3 runs on calibration samples, and none were given" in n
        for n in dataless.summary.note_texts), dataless.summary.note_texts


def test_check_samples_from_every_source(tmp_path, capsys):
    model = residual()
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", **{k: np.concatenate([f[k] for f in random_feeds(model, 6, seed=1)])
                                    for k in random_feeds(model, 1, seed=1)[0]})
    argv = ["quantize", str(src), str(tmp_path / "q.onnx"), "--calib-data", str(tmp_path / "c.npz")]
    assert main(argv + ["--check-samples", "2"]) == 0
    assert "check on 2 calibration samples" in capsys.readouterr().out
    assert main(argv + ["--check-samples", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid --check-samples -1" in err
    with pytest.raises(ConfigError, match="check_samples"):
        onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": -3}}))


def test_nothing_quantized_is_a_warning_with_the_config_level_named():
    """W8_DYNAMIC keeps convolutions float by its Conv override: on a convolution-only
    model nothing is quantized, and the summary says so and why."""
    model = residual()
    result = onnxq.quantize(model, None, "W8_DYNAMIC", random_feeds(model, 8, seed=1))
    assert not result.summary.quantized_by_op
    (warning,) = of(result.summary.notes, Topic.WARNING)
    assert warning.text.startswith("warning: nothing was quantized")
    assert "U8S8, the default, for convolutions; W8_DYNAMIC quantizes MatMul, Gemm and LSTM only" in warning.text
    printed = onnxq.format_summary(result.summary).splitlines()
    assert f"  {warning.text}" in printed and not any("note: warning:" in line for line in printed)
    reasons = {why for op, why in result.summary.float_nodes.values() if op == "Conv"}
    assert reasons == {"kept float by the config's Conv override (layer_type_quant_config)"}
    fp16 = onnxq.quantize(model, None, "FP16", random_feeds(model, 8, seed=1))  # weights stored in float16
    assert not any("nothing was quantized" in n for n in fp16.summary.note_texts)
    # an empty Config on the bundled model: its rewritten graph is 95% of the float file's
    # size, which had passed for a smaller model (third trial)
    digits = Path(__file__).resolve().parents[1] / "models"
    empty = onnxq.quantize(str(digits / "digits_cnn.onnx"), None, onnxq.Config(), str(digits / "digits_calib.npz"))
    assert any(n.startswith("warning: nothing was quantized") for n in empty.summary.note_texts)


def test_a_model_without_layers_is_not_sent_to_another_recipe(tmp_path):
    """A tree ensemble or a linear classifier (sklearn's ai.onnx.ml ops) has no layer any
    recipe quantizes: the warning says so, where it had advised another recipe."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Scaler", ["x"], ["scaled"], domain="ai.onnx.ml", offset=[0.5] * 4, scale=[2.0] * 4),
             helper.make_node("LinearRegressor", ["scaled"], ["y"], domain="ai.onnx.ml",
                              coefficients=[0.1, 0.2, 0.3, 0.4], intercepts=[0.5])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)],
                              ir_version=8)
    result = onnxq.quantize(model, str(tmp_path / "out.onnx"), calibration_data=random_feeds(model, 8, seed=2))
    (warning,) = of(result.summary.notes, Topic.WARNING)
    assert "the model has no layer onnxq quantizes" in warning.text and "pick a recipe" not in warning.text


def test_weight_only_matmul_with_its_constant_first_says_so():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["W", "x"], ["y"], name="w_at_x")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    result = onnxq.quantize(model, None, "W4_GROUP128")
    assert result.summary.float_nodes["w_at_x"] == (
        "MatMul", "weight-only quantization takes the constant weight as input 1 of MatMul; this node's constant is input 0")


def test_the_check_never_stops_a_run(monkeypatch):
    """A float model the check cannot run leaves the check out; a quantized model that
    loads but fails to run is a warning, and the model is still written as emitted."""
    import importlib

    import onnxq.emit.fidelity as fidelity

    quantize_module = importlib.import_module("onnxq.pipeline.emission")  # where the run opens its output

    model = residual()
    calib = random_feeds(model, 12, seed=1)
    plain = onnxq.quantize(model, None, "U8S8", calib)

    def refuses(*args, **kwargs):
        raise RuntimeError("no session")

    with monkeypatch.context() as m:
        m.setattr(fidelity, "_lean_session", refuses)
        # the reference from the float model, not from calibration (`CapturedOutputs`)
        m.setattr(importlib.import_module("onnxq.pipeline.calibration"), "FLOAT_TYPES", frozenset())
        skipped = onnxq.quantize(model, None, "U8S8", calib)
    assert skipped.summary.fidelity is None
    assert skipped.model.SerializeToString() == plain.model.SerializeToString()

    class Broken:
        def run(self, *args, **kwargs):
            raise RuntimeError("kernel failed\nsecond line")

    monkeypatch.setattr(quantize_module, "open_deployed", lambda model, providers, prepack=True: Broken())
    broken = onnxq.quantize(model, None, "U8S8", calib)
    assert broken.summary.fidelity is None
    assert "warning: the quantized model loads but failed to run on a calibration sample: kernel failed" in \
        broken.summary.note_texts
    assert broken.model.SerializeToString() == plain.model.SerializeToString()


def test_large_models_skip_the_check_unless_asked(monkeypatch):
    """By default the check runs on models up to CHECK_AUTO_BYTES (it opens the float model
    once more); above, the summary says how to ask for it, and asking runs it."""
    import onnxq.emit.fidelity as fidelity

    monkeypatch.setattr(fidelity, "CHECK_AUTO_BYTES", 1000)
    model = residual()
    calib = random_feeds(model, 12, seed=1)
    auto = onnxq.quantize(model, None, "U8S8", calib)
    assert auto.summary.fidelity is None
    assert any(n.startswith("output check skipped") and "calibration.check_samples 8 runs it" in n
               for n in auto.summary.note_texts)
    asked = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": 4}}), calib)
    assert asked.summary.fidelity.samples == 4
    # without data, the note names both things a big model needs (data alone had been said
    # to run it, and then did not: big-model trial)
    no_data = onnxq.quantize(model, None, "W8_DYNAMIC", None)
    (said,) = [n for n in no_data.summary.note_texts if n.startswith("output not checked")]
    assert "pass calibration_data and calibration.check_samples 8" in said and "--" not in said  # the API's words
    from onnxq.cli.flags import in_cli_words

    assert "pass --calib-data PATH and --check-samples 8 (on a model past" in in_cli_words(said)  # the CLI's


def test_outputs_whose_length_depends_on_the_data_are_left_out():
    """Compress keeps the values above a threshold: float and quantized outputs can differ
    in length, which must not stop the run (it crashed the check's comparison)."""
    from helpers import GraphBuilder

    b = GraphBuilder(0)
    x = b.input("x", ["N", 8])
    h = b.relu(b.gemm(b.relu(b.gemm(x, 8, 16)), 16, 16))
    flat = b.node("Reshape", [h, b.const("shape", np.array([-1], np.int64))])
    keep = b.node("Greater", [flat, b.const("t", np.array(0.45, np.float32))])
    model = b.build([b.node("Compress", [flat, keep]), h], name="compress")
    result = onnxq.quantize(model, None, "U8S8", random_feeds(model, 16, seed=1))
    assert result.summary.fidelity is not None and result.summary.fidelity.output == h  # the fixed-shape one


def test_positions_the_attention_mask_hides_are_left_out():
    """Per-position outputs are compared where `attention_mask` keeps the position:
    padding's outputs may move freely; outputs of another shape are compared whole."""
    from onnxq.emit.fidelity import Reference, measure

    class Fixed:  # the quantized model's outputs, given
        def __init__(self, outputs):
            self.outputs = outputs

        def run(self, names, feed):
            return self.outputs

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 6, 4)).astype(np.float32)
    pooled = hidden.mean(axis=1)
    feed = {"attention_mask": np.array([[1, 1, 1, 1, 0, 0]], np.int64)}
    moved = hidden.copy()
    moved[0, 4:] += 100.0  # padding far off
    figures = measure(Fixed([moved, pooled]), Reference([feed], [[hidden, pooled]], ["hidden", "pooled"]))
    assert np.isinf(figures.sqnr_db) or figures.sqnr_db > 100  # both outputs exact where it counts
    moved[0, 1] += 1.0  # a kept position moves: seen
    figures = measure(Fixed([moved, pooled]), Reference([feed], [[hidden, pooled]], ["hidden", "pooled"]))
    assert figures.output == "hidden" and figures.sqnr_db < 20
    # not a 0/1 mask (an additive one), or a 2-D output as long as the mask: compared whole
    scores = rng.standard_normal((1, 6)).astype(np.float32)
    shifted = scores.copy()
    shifted[0, 5] += 100.0
    for mask in (np.array([[0, 0, 0, 0, -1e9, -1e9]], np.float32), feed["attention_mask"]):
        figures = measure(Fixed([shifted]), Reference([{"attention_mask": mask}], [[scores]], ["scores"]))
        assert figures.sqnr_db < 0 and figures.top1_agreement == 0.0


def test_top1_agreement_only_for_class_scores():
    """Rows of unit length are embeddings (sentence_embedding): their largest entry means
    nothing, so no top-1 agreement is reported; class scores get one."""
    from onnxq.evaluate import top1_agreement

    rng = np.random.default_rng(0)
    scores = rng.standard_normal((16, 10)).astype(np.float32)
    assert top1_agreement(scores, scores) == 1.0
    embeddings = scores / np.linalg.norm(scores, axis=1, keepdims=True)
    assert top1_agreement(embeddings, embeddings) is None


def test_an_asked_check_on_data_read_once_says_it_was_skipped():
    """check_samples asked for, calibration data from a generator (read once): no check,
    and the summary says why instead of nothing."""
    from helpers import conv_relu_chain

    import onnxq

    model = conv_relu_chain()
    rng = np.random.default_rng(0)
    batches = ({"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32)} for _ in range(4))
    result = onnxq.quantize(model, None, {"calibration": {"check_samples": 8}}, batches)
    assert result.summary.fidelity is None
    (check,) = of(result.summary.notes, Topic.CHECK)
    assert check.text.startswith("output check skipped: the calibration data can be read only once")
    assert check.text.endswith("(the data is a generator)")


def test_a_decoders_check_reports_its_logits_not_its_cache(tmp_path):
    """A KV-cache decoder's present.* outputs feed its next step; the check's headline is
    the logits, counted among the outputs a user reads."""
    from genai_model import build_genai_folder

    folder = build_genai_folder(tmp_path / "float", layers=2, hidden=64, heads=4, kv_heads=2)
    windows = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int64)
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), compose_config(
        "W4_GROUP128", None, {"calibration": {"check_samples": 2}}), {"input_ids": windows}, progress=False)
    fidelity = result.summary.fidelity
    assert fidelity is not None and fidelity.output == "logits" and fidelity.outputs == 1, fidelity
    assert fidelity.cosine > 0.5  # int4 blocks on random weights: about 0.88


def test_a_scalar_output_is_checked_and_compared(tmp_path):
    """A rank-0 output beside the main one (a ReduceSum with keepdims 0): the check and
    `compare` measure it as one value a batch (both stopped on a raw ValueError)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    weight = helper.make_tensor("w", TensorProto.FLOAT, [16, 8], rng.standard_normal(128).astype(np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
         helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="sum")],
        "scalar", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    calib = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(12)]
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, "U8S8", calib)
    assert result.summary.fidelity is not None and result.summary.fidelity.outputs == 2
    assert result.summary.fidelity.sqnr_db > 25
    measured = compare_models(save(model, tmp_path / "m.onnx"), out, {"x": np.concatenate([f["x"] for f in calib])})
    figures = {o.name: o for o in measured.outputs}
    assert set(figures) == {"y", "total"} and figures["total"].sqnr_db > 25


def test_a_float_model_onnxruntime_refuses_skips_the_check_with_a_note(monkeypatch):
    """Two nodes of one name: onnx-ir renames them and the quantized model loads, but the
    float model as given does not, so where the reference must come from it (not from
    calibration) there is nothing to check against: a note says so (the check line vanished
    without a word). From calibration's outputs, the check runs."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], rng.standard_normal(64).astype(np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="dup"), helper.make_node("Relu", ["h"], ["y"], name="dup")],
        "dup", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    data = [{"x": rng.standard_normal((1, 8)).astype(np.float32)}] * 4
    captured = onnxq.quantize(model, None, "U8S8", data)
    assert captured.summary.fidelity.samples == 4 and captured.summary.fidelity.sqnr_db > 30
    import importlib

    monkeypatch.setattr(importlib.import_module("onnxq.pipeline.calibration"), "FLOAT_TYPES", frozenset())
    result = onnxq.quantize(model, None, "U8S8", data)
    assert result.summary.fidelity is None
    said = [n for n in result.summary.note_texts if n.startswith("output check skipped")]
    assert said and "cannot open the float model" in said[0] and "same node name" in said[0]


def test_the_float_reference_comes_from_calibration(monkeypatch):
    """The calibration session computes the float model's outputs on its first batches: the
    check keeps them instead of opening the float model again, and its figures are those
    of the float model's own session (to float32 rounding)."""
    import importlib

    import onnxq.emit.fidelity as fidelity

    model = residual()
    calib = random_feeds(model, 12, seed=1)
    with monkeypatch.context() as m:
        m.setattr(importlib.import_module("onnxq.pipeline.calibration"), "FLOAT_TYPES", frozenset())
        opened = onnxq.quantize(model, None, "U8S8", calib).summary.fidelity  # from the float model's session

    def refuses(*args, **kwargs):
        raise AssertionError("the float model was opened again")

    monkeypatch.setattr(fidelity, "_lean_session", refuses)
    result = onnxq.quantize(model, None, "U8S8", calib)
    captured = result.summary.fidelity
    assert captured.samples == opened.samples == 8
    assert captured.sqnr_db == pytest.approx(opened.sqnr_db, abs=0.01) and captured.cosine == pytest.approx(
        opened.cosine, abs=1e-5)
    few = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"check_samples": 3}}), calib)
    assert few.summary.fidelity.samples == 3  # a batch of 8 cut to the 3 asked


def test_a_pass_that_changes_the_float_outputs_checks_against_the_users_model():
    """CLE with relu6_to_relu changes the float model on purpose: the calibration model's
    outputs are then no reference, and the check reads the user's model (it read 36 dB
    against the changed model where the user's gave -0.4 dB)."""
    from helpers import GraphBuilder

    b = GraphBuilder(12)
    x = b.input("x", ["N", 3, 8, 8])
    h = b.node("Clip", [b.conv(x, 3, 8), b.const("lo", np.float32(0)), b.const("hi", np.float32(0.5))])
    model = b.build([b.conv(h, 8, 4)], name="clip")
    calib = random_feeds(model, 12, seed=3)
    config = compose_config("U8S8", None, {"pre_quant_opt_config": [{"name": "cle", "relu6_to_relu": True}]})
    result = onnxq.quantize(model, None, config, calib)
    plain = onnxq.quantize(model, None, compose_config("U8S8", None, {}), calib)
    assert result.summary.fidelity.sqnr_db < plain.summary.fidelity.sqnr_db - 3


def test_a_calibration_batch_that_does_not_divide_the_samples_keeps_top1():
    """Batches of 3 hold the 8 checked samples as 3+3+2: the top-1 agreement is over all
    eight (it was dropped where the batches' shapes differed), as from batches of 8."""
    model = gemm()
    calib = random_feeds(model, 16, seed=3)
    three = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"batch_size": 3}}), calib)
    eight = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"batch_size": 8}}), calib)
    assert three.summary.fidelity.samples == eight.summary.fidelity.samples == 8
    assert three.summary.fidelity.top1_agreement is not None
    assert three.summary.fidelity.top1_agreement == eight.summary.fidelity.top1_agreement


def test_a_capture_stopped_by_max_samples_is_not_the_whole_data(monkeypatch):
    """max_samples 4 of 16: the check still runs on the 8 samples it asks (from the float
    model), not on the 4 calibration kept as if they were all the data had."""
    import onnxq.emit.fidelity as fidelity

    model = residual()
    calib = random_feeds(model, 16, seed=3)
    opened = []
    lean = fidelity._lean_session
    monkeypatch.setattr(fidelity, "_lean_session", lambda *a, **k: opened.append(1) or lean(*a, **k))
    four = onnxq.quantize(model, None, compose_config("U8S8", None, {"calibration": {"max_samples": 4}}), calib)
    assert four.summary.fidelity.samples == 8 and opened
    opened.clear()
    few = onnxq.quantize(model, None, "U8S8", calib[:5])
    assert few.summary.fidelity.samples == 5 and not opened  # the data ran out: the capture is all of it


def test_the_capture_holds_its_byte_budget_in_copies_not_views(monkeypatch):
    """A batch past the capture's byte budget is cut to the samples that fit (at least one),
    and the cut is a copy: a view of the batch kept the whole batch alive (a 16 MB-a-sample
    output peaked at 1.6 GB against 0.8 GB)."""
    import onnxq.calibrate.capture as capture

    outputs = np.ones((8, 1000), np.float32)  # 4000 bytes a sample
    feed = {"x": np.ones((8, 10), np.float32)}  # 40 bytes a sample
    monkeypatch.setattr(capture, "CAPTURE_BYTES", 3 * 4040 + 100)
    held = capture.CapturedOutputs(["y"], 8)
    held.add(feed, [outputs], 8, 8)
    assert held.samples == 3 and held.outputs[0][0].shape == (3, 1000) and held.outputs[0][0].base is None
    assert held.held == 3 * 4040 and held.wanting
    held.add(feed, [outputs], 8, 8)  # under a sample's bytes left: one sample still
    assert held.samples == 4 and not held.wanting
    tight = capture.CapturedOutputs(["y"], 8)
    monkeypatch.setattr(capture, "CAPTURE_BYTES", 10)
    tight.add(feed, [outputs], 8, 8)
    assert tight.samples == 1


def test_a_batch_that_cannot_be_cut_ends_the_capture_past_its_budget(monkeypatch):
    """An output not batched on axis 0 cannot be cut to the samples that fit: past the first
    batch (always kept, as the check needs a reference) a batch over the bytes left is not
    held whole; the capture stops there and the check runs the float model for the rest."""
    import onnxq.calibrate.capture as capture

    feed = {"x": np.ones((4, 10), np.float32)}
    sequence_major = np.ones((3, 4, 100), np.float32)  # [time, batch, features]: axis 0 is not the batch
    monkeypatch.setattr(capture, "CAPTURE_BYTES", 6000)
    held = capture.CapturedOutputs(["y"], 16)
    held.add(feed, [sequence_major], 4, 4)
    assert held.samples == 4 and held.held == 160 + 4800 and held.wanting
    held.add(feed, [sequence_major], 4, 4)
    assert held.samples == 4 and held.held == 4960 and not held.wanting and len(held.outputs) == 1
    roomy = capture.CapturedOutputs(["y"], 16)
    monkeypatch.setattr(capture, "CAPTURE_BYTES", 64 << 20)
    roomy.add(feed, [sequence_major], 4, 4)
    roomy.add(feed, [sequence_major], 4, 4)
    assert roomy.samples == 8 and roomy.wanting


def test_a_check_after_a_fitting_algorithm_says_it_reads_the_fit():
    """AdaRound (and GPTQ, AWQ, AdaQuant) fit the model's weights to the calibration
    samples the check runs on: its line names them and points to held-out data; a recipe
    that fits nothing says nothing of the kind."""
    from onnxq.optimize.registry import fits_data

    assert [n for n in ("adaround", "adaquant", "gptq", "awq", "bias_correction", "cle", "smoothquant", "hqq")
            if fits_data(n)] == ["adaround", "adaquant", "gptq", "awq"]
    model = residual()
    calib = random_feeds(model, 16, seed=3)
    fitted = onnxq.quantize(model, None, compose_config("U8S8", None, {"algo_config": [{"name": "adaround"}]}), calib,
                            progress=False)
    assert fitted.summary.fidelity.fitted_by == ("adaround",)
    line = fitted.summary.fidelity.line()
    assert "adaround fitted the model to these samples" in line and "onnxq compare FLOAT QUANT" in line
    plain = onnxq.quantize(model, None, "U8S8", calib, progress=False)
    assert plain.summary.fidelity.fitted_by == () and "fitted" not in plain.summary.fidelity.line()


def test_the_check_sums_batch_by_batch_to_the_figures_of_the_joined_outputs():
    """The check adds each batch's sums as it runs (joined, eight samples of an LM head's
    logits held 700 MB of copies): the figures equal those of the outputs joined, with
    masked positions and non-finite float values left out, batches of different sizes
    counted together for top-1."""
    from onnxq.emit.fidelity import _Tally, _unmasked
    from onnxq.evaluate import cosine, sqnr_db, top1_agreement

    rng = np.random.default_rng(3)
    refs = [rng.standard_normal((n, 7)).astype(np.float32) for n in (3, 5, 1)]
    refs[1][2, 4] = np.nan
    tests = [r + rng.standard_normal(r.shape).astype(np.float32) * 0.6 for r in refs]
    feeds = [{"x": np.zeros(len(r))} for r in refs]
    tally = _Tally()
    for feed, r, t in zip(feeds, refs, tests):
        tally.add(feed, r, t)
    figures = tally.figures("y", 1, 9)
    kept = [_unmasked(f, r, t) for f, r, t in zip(feeds, refs, tests)]
    ref = np.concatenate([r.ravel() for r, _ in kept]).astype(np.float64)
    test = np.concatenate([t.ravel() for _, t in kept]).astype(np.float64)
    finite = np.isfinite(ref)
    assert figures.sqnr_db == pytest.approx(sqnr_db(ref[finite], test[finite]), rel=1e-12)
    assert figures.cosine == pytest.approx(cosine(ref[finite], test[finite]), rel=1e-12)
    joined = [np.concatenate(side) for side in zip(*zip(refs, tests))]
    assert figures.top1_agreement == top1_agreement(*joined) and 0 < figures.top1_agreement < 1
    tally.add(feeds[0], refs[0], tests[0] * np.float32(np.inf))  # the quantized model overflows
    assert tally.figures("y", 1, 12).sqnr_db == -np.inf


def test_a_capture_its_bytes_ended_serves_the_check_without_a_float_session(monkeypatch):
    """Outputs too large for 8 samples in the capture's bytes: the check runs on the samples
    the capture holds. Its own float session would hold no more (the same byte budget), and
    cost the float model and its outputs again (an LM head's logits: 64 MB more)."""
    import onnxq.calibrate.capture as capture
    import onnxq.emit.fidelity as fidelity

    model = residual()
    calib = random_feeds(model, 16, seed=3)
    per_sample = sum(a[:1].nbytes for a in calib[0].values()) + 4 * 12 * 12 * 4  # its feed and its [4, 12, 12] output
    monkeypatch.setattr(capture, "CAPTURE_BYTES", 3 * per_sample + 1)
    opened = []
    lean = fidelity._lean_session
    monkeypatch.setattr(fidelity, "_lean_session", lambda *a, **k: opened.append(1) or lean(*a, **k))
    result = onnxq.quantize(model, None, "U8S8", calib, progress=False)
    assert not opened and 3 <= result.summary.fidelity.samples < 8
    assert result.summary.fidelity.sqnr_db > 20


def test_a_check_cut_short_by_the_memory_cap_says_so(monkeypatch):
    """Fewer samples checked than asked, because the float outputs held for the check
    reached their cap, is said on the check's line, whether the outputs came from the
    calibration pass's capture or from a float session of the check's own (LLM trial:
    "check on 2 calibration samples" for 4 asked; review: the capture's path)."""
    import onnxq.calibrate.capture as capture
    import onnxq.emit.fidelity as fidelity

    model = residual()
    feeds = random_feeds(model, 12, seed=1)
    config = compose_config("U8S8", None, {"calibration": {"check_samples": 6}})
    full = onnxq.quantize(model, None, config, feeds)
    assert full.summary.fidelity.samples == 6 and "asked" not in full.summary.fidelity.line()
    from helpers import run

    sample = sum(np.asarray(v).nbytes for v in feeds[0].values()) + sum(o.nbytes for o in run(model, feeds[0], None))
    cap = int(4.5 * sample)  # four samples are held, under the cap: the capture's last batch is cut to fit
    monkeypatch.setattr(capture, "CAPTURE_BYTES", cap)
    monkeypatch.setattr(fidelity, "REFERENCE_BYTES", cap)
    cut = onnxq.quantize(model, None, config, feeds)
    assert cut.summary.fidelity.samples < 6
    assert f"check on {cut.summary.fidelity.samples} calibration samples of the 6 asked" in cut.summary.fidelity.line()


def test_a_capture_cut_under_its_cap_still_says_how_many_were_asked():
    """The calibration pass's capture cuts its last batch to fit under its byte cap, so it
    can stop just under it: the check's line must read the capture's own word that the
    budget ended it (review), not the bytes it holds."""
    import onnxruntime as ort

    from onnxq.calibrate.capture import CapturedOutputs
    from onnxq.calibrate.data import CalibrationSource
    from onnxq.calibrate.inputs import model_inputs
    from onnxq.emit.fidelity import check_outputs
    from onnxq.graph.load import load_model

    model = residual()
    feeds = random_feeds(model, 8, seed=2)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    captured = CapturedOutputs(names, wanted=8)
    for feed in feeds[:3]:
        captured.feeds.append(feed)
        captured.outputs.append(session.run(names, feed))
    captured.samples, captured.held, captured.spent = 3, 1, True  # far under any cap, ended by the budget
    checked = check_outputs(model, model_inputs(load_model(model)[0]), session, CalibrationSource(feeds), 8,
                            ["CPUExecutionProvider"], captured=captured)
    assert checked.samples == 3 and "check on 3 calibration samples of the 8 asked" in checked.line()


def test_an_algorithm_with_no_layer_is_not_said_to_have_fitted_the_check():
    """FP8_E4M3's AdaRound takes Conv layers; on a transformer it finds none, and the check
    had still said AdaRound fitted the model to its samples (encoder trial)."""
    from helpers import GraphBuilder

    b = GraphBuilder(0)
    x = b.input("x", ["batch", 32])
    model = b.build([b.matmul(b.node("Relu", [b.matmul(x, 32, 64)]), 64, 16)], name="mlp")
    result = onnxq.quantize(model, None, "FP8_E4M3", random_feeds(model, 16, seed=1))
    assert any("adaround: no quantized" in n for n in result.summary.note_texts)
    assert result.summary.fidelity.fitted_by == () and "fitted" not in result.summary.fidelity.line()


def test_an_excluded_integer_node_keeps_its_exclusion_as_the_reason():
    """Nodes with integer outputs share one reason in the summary, except where the user
    excluded them: their reason is the exclusion, as written (review)."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["scores"], name="fc"),
             helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=0, name="argmax"),
             helper.make_node("Shape", ["x"], ["shape"], name="shape")]
    graph = helper.make_graph(nodes, "argmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = onnxq.quantize(model, None, {"exclude": ["argmax"]}, random_feeds(model, 8, seed=4))
    assert result.summary.float_nodes["argmax"] == ("ArgMax", "excluded by the config (exclude: argmax)")
    assert result.summary.float_nodes["shape"][1].startswith("integer or boolean outputs")
