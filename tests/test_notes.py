"""Notes are records: a program reads what each is about and the nodes it names; the
printed summary is their text, in the order the stages wrote them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from helpers import run, sqnr_db

import onnxq
from onnxq.notes import Topic, of

MODELS = Path(__file__).resolve().parents[1] / "models"


def quantize_digits(**data_extra: np.ndarray) -> onnxq.QuantizationResult:
    data = dict(np.load(MODELS / "digits_eval.npz"))
    data = {k: v[:64] for k, v in data.items()}
    data.update(data_extra)
    return onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, "U8S8", data, progress=False)


def test_each_stage_writes_notes_of_its_topic():
    result = quantize_digits()
    notes = result.summary.notes
    # The labels array is no model input: the calibration note names it.
    (left_out,) = of(notes, Topic.CALIBRATION)
    assert left_out.nodes == ("labels",)
    # The default BatchNorm fold finds none and says nothing; the target's bias correction
    # reports as an algorithm.
    assert of(notes, Topic.PASS) == []
    asked = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, {"preset": "U8S8", "pre_quant_opt_config": [
        {"name": "fold_batchnorm"}]}, str(MODELS / "digits_calib.npz"), progress=False)
    assert [n.text for n in of(asked.summary.notes, Topic.PASS)] == ["fold_batchnorm: no BatchNormalization"]
    assert [n.source for n in of(notes, Topic.TARGET)] == ["bias_correction"]
    (corrected,) = of(notes, Topic.ALGORITHM, "bias_correction")
    assert "biases corrected" in corrected.text
    assert all(isinstance(n.topic, Topic) and n.text for n in notes)


def test_the_summary_prints_every_note_text_in_order():
    result = quantize_digits()
    printed = onnxq.format_summary(result.summary).splitlines()
    lines = [line.removeprefix("  note: ") for line in printed if line.startswith("  note: ")]
    assert lines == result.summary.note_texts
    assert len(lines) == len(result.summary.notes) >= 3


def test_unquantizable_ranges_name_their_tensors():
    """A masking constant (float min) in the data gives a range no integer grid holds:
    the tensors stay float, the note names them, and the model stays close to float."""
    data = dict(np.load(MODELS / "digits_eval.npz"))
    images = data["input"][:64].copy()
    images[0, 0, 0, 0] = -3.0e38
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, "U8S8", {"input": images}, progress=False)
    (kept,) = of(result.summary.notes, Topic.FLOAT)
    assert "input" in kept.nodes and "range beyond" in kept.text
    # The float model turns that sample into NaN downstream, so bias correction's input
    # means are unusable: it skips the layers and says why, instead of writing NaN biases.
    (corrected,) = of(result.summary.notes, Topic.ALGORITHM, "bias_correction")
    assert "input mean beyond +-1e+30: a masking value in the data" in corrected.text
    onnx.checker.check_model(result.model, full_check=True)
    feed = {"input": data["input"][64:96]}
    assert sqnr_db(run(str(MODELS / "digits_cnn.onnx"), feed), run(result.model, feed)) > 30


def test_an_opset_upgrade_is_said_once():
    data = {k: v[:16] for k, v in np.load(MODELS / "digits_eval.npz").items() if k != "labels"}
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, "A16W8", data, progress=False)
    text = onnxq.format_summary(result.summary)
    assert result.summary.opset == (17, 21) and text.count("17 -> 21") == 1, text


def test_calibration_data_of_one_value_is_a_warning():
    """All-zero calibration data fits every range to nothing real, and the output check on
    those samples looks fine: the summary warns; real data gives no such warning."""
    data = {k: np.zeros_like(v[:16]) for k, v in np.load(MODELS / "digits_calib.npz").items()}
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), None, "U8S8", data, progress=False)
    (warned,) = [n for n in result.summary.notes if "holds one value" in n.text]
    assert warned.topic is Topic.WARNING and warned.nodes == ("input",)
    assert not any("holds one value" in n for n in quantize_digits().summary.note_texts)


def test_an_override_the_plan_cannot_use_is_said():
    """An absorbed Relu's own output spec and a MaxPool's output spec change nothing (the
    Relu runs inside the Conv, the MaxPool's output reuses its input's parameters): the
    summary says so instead of writing the same model in silence."""
    data = {k: v[:32] for k, v in np.load(MODELS / "digits_calib.npz").items()}
    model = str(MODELS / "digits_cnn.onnx")
    for config, says in (({"layer_quant_config": {"relu3": {"output_tensors": {"dtype": "int16"}}}},
                          "layer_quant_config: relu3 has no effect: it runs inside the op before it"),
                         ({"layer_type_quant_config": {"Relu": {"output_tensors": {"dtype": "uint16"}}}},
                          "layer_type_quant_config: Relu has no effect on relu1, relu2, relu3"),
                         ({"layer_quant_config": {"maxpool": {"output_tensors": {"dtype": "int16"}}}},
                          "layer_quant_config: maxpool output_tensors has no effect: a data-movement op's output "
                          "reuses")):
        result = onnxq.quantize(model, None, config, data, progress=False)
        assert any(n.topic is Topic.CONFIG and n.text.startswith(says) for n in result.summary.notes), says
    assert not any("has no effect" in n for n in quantize_digits().summary.note_texts)


def test_overrides_that_cannot_apply_are_said():
    """A weight spec on a Relu or a MaxPool, an op-type override for an op type the model
    lacks, a node override on an excluded node: each was accepted in silence
    (configuration trial)."""
    data = {k: v[:32] for k, v in np.load(MODELS / "digits_calib.npz").items()}
    model = str(MODELS / "digits_cnn.onnx")
    for config, says in (({"layer_quant_config": {"relu1": {"weight": {"dtype": "int4"}}}},
                          "layer_quant_config: relu1 weight has no effect: a Relu has no weight"),
                         ({"layer_type_quant_config": {"MaxPool": {"weight": {"dtype": "int4"}}}},
                          "layer_type_quant_config: MaxPool weight has no effect on maxpool: a MaxPool has no weight"),
                         ({"layer_type_quant_config": {"LSTM": {"weight": {"dtype": "int4"}}}},
                          "layer_type_quant_config: LSTM has no effect: the model has no LSTM node"),
                         ({"exclude": ["conv3"], "layer_quant_config": {"conv3": {"weight": {"qscheme": "per_tensor"}}}},
                          "layer_quant_config: conv3 has no effect: the node is excluded")):
        result = onnxq.quantize(model, None, config, data, progress=False)
        assert any(n.topic is Topic.CONFIG and n.text.startswith(says) for n in result.summary.notes), \
            (says, result.summary.note_texts)


def test_grid_settings_on_a_float_cast_are_said_where_no_weight_took_them():
    """FP16 with --per-tensor changed nothing and said nothing (configuration trial): the
    summary now says so; where an integer override puts some weight on a grid, the setting
    may reach it and nothing is said; the FP16 preset alone says nothing."""
    model = str(MODELS / "digits_cnn.onnx")
    per_tensor = {"preset": "FP16", "global_quant_config": {"weight": {"qscheme": "per_tensor"}}}
    result = onnxq.quantize(model, None, per_tensor, None, progress=False)
    said = [n.text for n in result.summary.notes if "has no effect" in n.text]
    assert said == ["global_quant_config weight qscheme per_tensor has no effect: float16 weights are cast, not put "
                    "on a grid of scales (--per-tensor, --per-channel, --per-group and the other grid settings are "
                    "for integer and float8 weights)"], result.summary.note_texts
    plain = onnxq.quantize(model, None, "FP16", None, progress=False)
    assert not any("has no effect" in n for n in plain.summary.note_texts)
    inherited = onnxq.quantize(model, None, {"preset": "FP16", "layer_type_quant_config": {
        "Conv": {"weight": {"qscheme": "per_tensor"}}}}, None, progress=False)  # float16 from the level below
    assert any(n.startswith("layer_type_quant_config: Conv weight qscheme per_tensor has no effect")
               for n in inherited.summary.note_texts), inherited.summary.note_texts
    data = {k: v[:16] for k, v in np.load(MODELS / "digits_calib.npz").items()}
    mixed = onnxq.quantize(model, None, {**per_tensor, "layer_type_quant_config": {"Conv": {
        "input_tensors": {"dtype": "uint8"}, "output_tensors": {"dtype": "uint8"},
        "weight": {"dtype": "int8", "symmetric": True}}}}, data, progress=False)
    assert not any("has no effect" in n for n in mixed.summary.note_texts), mixed.summary.note_texts


def test_a_weight_spec_on_a_static_gathers_table_is_said_and_the_fix_works(tmp_path):
    """A static recipe quantizes an embedding Gather's table as its input (the activation it
    passes on), so `Gather: {weight: {dtype: float32}}` changed nothing, without a word
    (encoder trial). The note names what does apply, and following it keeps the table float."""
    from helpers import GraphBuilder

    b = GraphBuilder(0)
    ids = b.input("ids", ["batch", 6], dtype=onnx.TensorProto.INT64)
    table = b.const("table", b.small((50, 16), 1.0))
    model = b.build([b.matmul(b.node("Gather", [table, ids]), 16, 8)], name="embed_mlp")
    embed = next(n.name for n in model.graph.node if n.op_type == "Gather")
    data = {"ids": np.random.default_rng(0).integers(0, 50, (16, 6))}
    said = onnxq.quantize(model, None, {"layer_type_quant_config": {"Gather": {"weight": {"dtype": "float32"}}}},
                          data, progress=False).summary.note_texts
    assert any(n.startswith(f"layer_type_quant_config: Gather weight has no effect on {embed}: a static recipe "
                            "quantizes a Gather's table as its input") for n in said), said
    followed = onnxq.quantize(model, None, {"layer_type_quant_config": {"Gather": {
        "weight": {"dtype": "float32"}, "input_tensors": {"dtype": "float32"}}}}, data, progress=False)
    assert embed in followed.plan.float_nodes and not any("has no effect" in n for n in followed.summary.note_texts)
    # a Gather of an activation (CLS pooling) has no table: not told to set input_tensors (review)
    b = GraphBuilder(1)
    x = b.input("x", ["batch", 4, 16])
    pooled = b.node("Gather", [b.matmul(x, 16, 16), b.const("first", np.array(0, np.int64))], axis=1)
    pooling = b.build([b.matmul(pooled, 16, 8)], name="cls_pool")
    said = onnxq.quantize(pooling, None, {"layer_type_quant_config": {"Gather": {"weight": {"dtype": "float32"}}}},
                          {"x": np.random.default_rng(1).standard_normal((16, 4, 16)).astype(np.float32)},
                          progress=False).summary.note_texts
    assert not any("quantizes a Gather's table" in n for n in said), said
