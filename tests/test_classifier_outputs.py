"""A classifier as sklearn exports it: its first output the predicted labels (class names,
strings), its second the probabilities. `compare`, `analyze`, `--report` and the accuracy
search had raised "could not convert string to float" on the labels; they now compare the
labels for equality and score the first float output (`graph/selection.scored_index`)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.analyze import analyze_models
from onnxq.evaluate import compare_models, format_comparison

CLASSES = ("setosa", "versicolor", "virginica")


def named_classifier(seed: int = 0) -> onnx.ModelProto:
    """x [N, 6] -> MatMul -> Softmax probabilities [N, 3]; ArgMax -> LabelEncoder -> names [N]."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((6, len(CLASSES))).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["index"], axis=1, keepdims=0),
        helper.make_node("LabelEncoder", ["index"], ["label"], domain="ai.onnx.ml",
                         keys_int64s=list(range(len(CLASSES))), values_strings=list(CLASSES), default_string="?"),
    ]
    graph = helper.make_graph(nodes, "named_classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("label", TensorProto.STRING, ["N"]),
                               helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", len(CLASSES)])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)],
                             ir_version=8)


@pytest.fixture(scope="module")
def quantized():
    model = named_classifier()
    rng = np.random.default_rng(1)
    calib = {"x": rng.standard_normal((64, 6)).astype(np.float32)}
    held_out = {"x": rng.standard_normal((48, 6)).astype(np.float32)}
    result = onnxq.quantize(model, None, calibration_data=calib, progress=False)
    return model, result.model, held_out


def test_compare_checks_class_names_by_equality_and_scores_the_probabilities(quantized):
    model, quant, held_out = quantized
    labels = run(model, held_out, output=1).argmax(1)
    compared = compare_models(model.SerializeToString(), quant.SerializeToString(), held_out, labels=labels)
    by_name = {m.name: m for m in compared.outputs}
    assert by_name["label"].equal is not None and by_name["label"].equal > 0.9
    probabilities = by_name["probabilities"]
    assert probabilities.sqnr_db == pytest.approx(sqnr_db(run(model, held_out, output=1), run(quant, held_out, output=1)),
                                                  abs=0.01)
    assert compared.float_accuracy == 1.0 and compared.quant_accuracy > 0.9  # scored on the probabilities
    assert "label: " in format_comparison(compared) and "not a float output" in format_comparison(compared)


def test_analyze_and_the_accuracy_search_score_the_probabilities(quantized, tmp_path):
    model, quant, held_out = quantized
    analysis = analyze_models(model, quant, held_out, progress=False)
    assert [o.name for o in analysis.outputs] == ["probabilities"]

    path = tmp_path / "eval.npz"
    np.savez(path, **held_out)
    result = onnxq.quantize(model, None, {"mixed_precision": {"target": "sqnr>=60", "eval_data": str(path)}},
                            calibration_data=held_out, progress=False)
    search = result.summary.mixed_precision
    assert "output 'probabilities'" in search.scored_on
    assert search.final_score >= 60.0
    assert sqnr_db(run(model, held_out, output=1), run(result.model, held_out, output=1)) >= 60.0


def test_a_string_input_takes_numpy_strings(tmp_path):
    """A pipeline with a categorical string column (sklearn's OneHot/LabelEncoder): an .npz
    of numpy strings (dtype <U, what np.array(texts) gives) had been refused ('convert it
    with .astype(object)', after which numpy could not load the file without unpickling)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    nodes = [
        helper.make_node("LabelEncoder", ["color"], ["code"], domain="ai.onnx.ml", keys_strings=["red", "green", "blue"],
                         values_int64s=[0, 1, 2], default_int64=-1),
        helper.make_node("Cast", ["code"], ["code_f"], to=TensorProto.FLOAT),
        helper.make_node("Concat", ["x", "code_f"], ["features"], axis=1),
        helper.make_node("MatMul", ["features", "w"], ["scores"], name="fc"),
    ]
    graph = helper.make_graph(nodes, "categorical", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                                     helper.make_tensor_value_info("color", TensorProto.STRING, ["N", 1])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)],
                              ir_version=8)
    data = {"x": rng.standard_normal((40, 4)).astype(np.float32),
            "color": np.array([["red", "green", "blue", "red"][i % 4] for i in range(40)])[:, None]}
    assert data["color"].dtype.kind == "U"
    path = tmp_path / "calib.npz"
    np.savez(path, **data)
    result = onnxq.quantize(model, None, calibration_data=str(path), progress=False)
    feeds = {"x": data["x"], "color": data["color"].astype(object)}
    assert sqnr_db(run(model, feeds), run(result.model, feeds)) > 30.0
    assert compare_models(model.SerializeToString(), result.model.SerializeToString(), str(path)).samples == 40

    np.savez(tmp_path / "objects.npz", **{**data, "color": data["color"].astype(object)})
    with pytest.raises(onnxq.errors.CalibrationDataError, match="object arrays, which onnxq does not unpickle"):
        onnxq.quantize(model, None, calibration_data=str(tmp_path / "objects.npz"), progress=False)
