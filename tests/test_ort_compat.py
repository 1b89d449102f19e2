"""A script written for onnxruntime.quantization, run by onnxq with one import line changed
(`onnxq.ort_compat`): the same arguments and enums mean the same recipe
(`config/ort_options.py`), and the model is onnxq's, measured against onnxruntime's own on
the same arguments and data."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import sqnr_db
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
)
from onnxruntime.quantization import quantize_static as ort_quantize_static

from onnxq.cli import main
from onnxq.config import save_config
from onnxq.errors import ConfigError
from onnxq.ort_compat import ort_config, quantize, quantize_dynamic, quantize_static

MODELS = Path(__file__).resolve().parent.parent / "models"
MODEL = str(MODELS / "digits_cnn.onnx")
CALIB = np.load(MODELS / "digits_calib.npz")["input"]
EVAL = np.load(MODELS / "digits_eval.npz")


class Reader(CalibrationDataReader):
    """An onnxruntime user's reader: one sample per get_next, rewind to start again."""

    def __init__(self) -> None:
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(CALIB):
            return None
        self.i += 1
        return {"input": CALIB[self.i - 1:self.i]}

    def rewind(self) -> None:
        self.i = 0


def _outputs(path: str | Path) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": EVAL["input"]})[0]


def _quantized_ops(path: Path) -> set[str]:
    """Op types that read a quantized weight (a DequantizeLinear of an initializer)."""
    model = onnx.load(str(path))
    weights = {i.name for i in model.graph.initializer}
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights for o in n.output}
    return {n.op_type for n in model.graph.node if set(n.input) & dq}


@pytest.mark.parametrize("arguments", [{}, {"per_channel": True}, {"per_channel": True, "reduce_range": True}])
def test_the_same_arguments_give_a_valid_model_closer_to_float_than_onnxruntimes(tmp_path, arguments):
    """Digits CNN, evaluation images: onnxq's model from onnxruntime's arguments passes the
    checker, runs in a default session, keeps top-1 within a point of float and its logits'
    SQNR at least onnxruntime's own model's on the same arguments (measured: 37.1 / 38.9 /
    35.0 dB against 32.2 / 34.3 / 28.8)."""
    quantize_static(MODEL, tmp_path / "onnxq.onnx", Reader(), **arguments)
    logging.disable(logging.WARNING)  # onnxruntime's pre-processing advice
    try:
        ort_quantize_static(MODEL, str(tmp_path / "ort.onnx"), Reader(), **arguments)
    finally:
        logging.disable(logging.NOTSET)
    onnx.checker.check_model(str(tmp_path / "onnxq.onnx"), full_check=True)
    float_out, ours, theirs = _outputs(MODEL), _outputs(tmp_path / "onnxq.onnx"), _outputs(tmp_path / "ort.onnx")
    labels = EVAL["labels"]
    assert np.mean(ours.argmax(1) == labels) >= np.mean(float_out.argmax(1) == labels) - 0.01
    assert sqnr_db(float_out, ours) >= sqnr_db(float_out, theirs)
    assert sqnr_db(float_out, ours) > 30


def test_enums_and_their_names_are_the_same_recipe(tmp_path):
    enums = quantize_static(MODEL, tmp_path / "a.onnx", Reader(), quant_format=QuantFormat.QOperator,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.Percentile, per_channel=True)
    names = quantize_static(MODEL, tmp_path / "b.onnx", Reader(), quant_format="QOperator", activation_type="quint8",
                            weight_type="QInt8", calibrate_method="percentile", per_channel=True)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert enums.config.quant_format.value == "qoperator" == names.config.quant_format.value
    ops = {n.op_type for n in onnx.load(str(tmp_path / "a.onnx")).graph.node}
    assert "QLinearConv" in ops


def test_each_argument_means_what_onnxruntime_documents():
    assert ort_config(MODEL, calibrate_method="Percentile", extra_options={"CalibPercentile": 99.9}
                      ).global_quant_config.input_tensors.percentile == 99.9
    c = ort_config(MODEL)  # onnxruntime's defaults: QInt8 asymmetric activations, per-tensor symmetric weights
    g = c.global_quant_config
    assert (g.input_tensors.dtype.value, g.input_tensors.symmetric) == ("int8", False)
    assert (g.weight.dtype.value, g.weight.symmetric, g.weight.qscheme.value) == ("int8", True, "per_tensor")
    assert c.reduce_range is None and c.quant_format.value == "qdq"
    c = ort_config(MODEL, per_channel=True, reduce_range=True, weight_type=QuantType.QUInt8,
                   activation_type=QuantType.QUInt16, calibrate_method=CalibrationMethod.Entropy,
                   extra_options={"ActivationSymmetric": True, "OpTypesToExcludeOutputQuantization": ["Gemm"],
                                  "QDQOpTypePerChannelSupportToAxis": {"Gemm": 0}, "UseQDQContribOps": True,
                                  "QDQKeepRemovableActivations": True, "SmoothQuant": True, "SmoothQuantAlpha": 0.7})
    g = c.global_quant_config
    assert (g.weight.dtype.value, g.weight.symmetric, g.weight.qscheme.value) == ("uint8", False, "per_channel")
    assert (g.input_tensors.dtype.value, g.input_tensors.symmetric, g.input_tensors.calib_method) == (
        "uint16", True, "entropy")
    assert c.reduce_range is True and c.qdq_domain == "com.microsoft" and c.fuse_activations is False
    assert c.layer_type_quant_config["Gemm"].output_tensors.dtype.value == "float32"
    assert c.layer_type_quant_config["Gemm"].weight.ch_axis == 0
    assert c.pre_quant_opt_config == [{"name": "smoothquant", "alpha": 0.7}]
    with pytest.raises(ConfigError, match="did you mean 'per_channel'"):
        ort_config(MODEL, per_chanel=True)


def test_op_types_and_nodes_to_quantize_leave_the_rest_float(tmp_path):
    quantize_static(MODEL, tmp_path / "conv.onnx", Reader(), op_types_to_quantize=["Conv"])
    assert _quantized_ops(tmp_path / "conv.onnx") == {"Conv"}
    gemm = next(n.name for n in onnx.load(MODEL).graph.node if n.op_type == "Gemm")
    quantize_static(MODEL, tmp_path / "gemm.onnx", Reader(), nodes_to_quantize=[gemm])
    assert _quantized_ops(tmp_path / "gemm.onnx") == {"Gemm"}
    conv = next(n.name for n in onnx.load(MODEL).graph.node if n.op_type == "Conv")
    result = quantize_static(MODEL, tmp_path / "ex.onnx", Reader(), nodes_to_exclude=[conv])
    assert conv in result.config.exclude
    for path in ("conv.onnx", "gemm.onnx", "ex.onnx"):
        assert sqnr_db(_outputs(MODEL), _outputs(tmp_path / path)) > 30


@pytest.mark.parametrize(("arguments", "words"), [
    ({"extra_options": {"ActivationSymetric": True}}, ["ActivationSymetric", "ActivationSymmetric"]),
    ({"extra_options": {"CalibMovingAverage": True}}, ["CalibMovingAverage", "Percentile"]),
    ({"extra_options": {"EnableSubgraph": True}}, ["EnableSubgraph", "main graph"]),
    ({"calibrate_method": CalibrationMethod.Distribution}, ["Distribution", "MinMax"]),
    ({"extra_options": {"CalibPercentile": 99.9}}, ["CalibPercentile", "Percentile"]),
    ({"activation_type": "QInt3"}, ["activation_type", "qint8"]),
    ({"nodes_to_quantize": ["no_such_node"]}, ["no_such_node", "onnxq inspect"]),
    ({"nodes_to_exclude": ["no_such_node"]}, ["no_such_node"]),
    ({"calibration_cache_path": "cache.json"}, ["calibration_cache_path", "load_ranges"]),
])
def test_what_has_no_counterpart_is_one_line_naming_what_to_use(tmp_path, arguments, words):
    with pytest.raises(ConfigError) as caught:
        quantize_static(MODEL, tmp_path / "q.onnx", Reader(), **arguments)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and all(w in message for w in words), message
    assert not (tmp_path / "q.onnx").exists()


def test_options_onnxq_needs_no_setting_for_are_said(tmp_path):
    result = quantize_static(MODEL, tmp_path / "q.onnx", Reader(),
                             extra_options={"CalibMaxIntermediateOutputs": 8, "DedicatedQDQPair": True,
                                            "AddQDQPairToWeight": False, "MatMulConstBOnly": False})
    said = [n for n in result.summary.note_texts if n.startswith("extra_options")]
    assert [s.split(":")[0] for s in said] == ["extra_options CalibMaxIntermediateOutputs",
                                               "extra_options DedicatedQDQPair"]


def test_quantize_dynamic_keeps_conv_float_unless_listed(tmp_path):
    default = quantize_dynamic(MODEL, tmp_path / "d.onnx")
    assert "Conv" in default.config.float_op_types
    table = default.config.layer_type_quant_config["Gather"].weight  # as onnxruntime: like an activation
    assert (table.dtype.value, table.symmetric) == ("uint8", False)
    listed = quantize_dynamic(MODEL, tmp_path / "c.onnx", op_types_to_quantize=["Conv", "Gemm"], per_channel=True)
    assert listed.config.layer_type_quant_config["Conv"].input_tensors.is_dynamic
    for path in ("d.onnx", "c.onnx"):
        onnx.checker.check_model(str(tmp_path / path))
        assert sqnr_db(_outputs(MODEL), _outputs(tmp_path / path)) > 25
    with pytest.raises(ConfigError, match="QInt8 or QUInt8"):
        quantize_dynamic(MODEL, tmp_path / "x.onnx", weight_type=QuantType.QInt4)


def test_the_recipe_saved_runs_the_same_from_the_command_line(tmp_path):
    """ort_config's Config saved as YAML gives the CLI the same bytes as quantize_static."""
    arguments = {"per_channel": True, "activation_type": QuantType.QUInt8,
                 "extra_options": {"WeightSymmetric": True, "OpTypesToExcludeOutputQuantization": ["Gemm"]}}
    quantize_static(MODEL, tmp_path / "py.onnx", Reader(), **arguments)
    save_config(ort_config(MODEL, **arguments), tmp_path / "recipe.yaml")
    np.savez(tmp_path / "calib.npz", input=CALIB)
    assert main(["quantize", MODEL, str(tmp_path / "cli.onnx"), "--config", str(tmp_path / "recipe.yaml"),
                 "--calib-data", str(tmp_path / "calib.npz"), "--quiet"]) == 0
    assert (tmp_path / "py.onnx").read_bytes() == (tmp_path / "cli.onnx").read_bytes()


def test_a_reader_onnxruntime_already_read_is_rewound_or_named(tmp_path):
    """The reader a script handed onnxruntime's quantizer first: onnxq rewinds it before its
    first read (it got no sample before); one without rewind() is a one-line error saying so."""
    reader = Reader()
    while reader.get_next() is not None:
        pass
    result = quantize_static(MODEL, tmp_path / "q.onnx", reader)
    assert result.summary.calibration_samples == len(CALIB)

    class Once:
        def __init__(self) -> None:
            self.batches = iter(np.split(CALIB, 8))

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {"input": batch}

    once = Once()
    while once.get_next() is not None:
        pass
    from onnxq.errors import CalibrationDataError

    with pytest.raises(CalibrationDataError, match="already read to its end.*rewind"):
        quantize_static(MODEL, tmp_path / "r.onnx", once)
    assert not (tmp_path / "r.onnx").exists()


def test_onnxruntimes_quant_config_objects(tmp_path):
    """onnxruntime's quantize(model, out, StaticQuantConfig | DynamicQuantConfig): the same
    bytes as the keyword form."""
    from onnxruntime.quantization import DynamicQuantConfig, StaticQuantConfig

    quantize(MODEL, tmp_path / "s.onnx", StaticQuantConfig(Reader(), per_channel=True,
                                                          activation_type=QuantType.QUInt8))
    quantize_static(MODEL, tmp_path / "k.onnx", Reader(), per_channel=True, activation_type=QuantType.QUInt8)
    assert (tmp_path / "s.onnx").read_bytes() == (tmp_path / "k.onnx").read_bytes()
    quantize(MODEL, tmp_path / "d.onnx", DynamicQuantConfig(per_channel=True))
    quantize_dynamic(MODEL, tmp_path / "dk.onnx", per_channel=True)
    assert (tmp_path / "d.onnx").read_bytes() == (tmp_path / "dk.onnx").read_bytes()
    with pytest.raises(ConfigError, match="StaticQuantConfig"):
        quantize(MODEL, tmp_path / "x.onnx", {"per_channel": True})


def test_get_qdq_configs_none_options_keep_onnxruntimes_defaults(tmp_path):
    """onnxruntime's get_qdq_config writes WeightSymmetric: None ("from the type"): int8
    weights stay symmetric (they got zero points -18..44 when None read as False)."""
    from onnxruntime.quantization import get_qdq_config

    logging.disable(logging.WARNING)
    try:
        config = get_qdq_config(onnx.load(MODEL), Reader())
    finally:
        logging.disable(logging.NOTSET)
    assert config.extra_options.get("WeightSymmetric", "absent") is None
    quantize(MODEL, tmp_path / "q.onnx", config)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    zeros = [numpy_helper.to_array(i) for i in quantized.graph.initializer
             if i.name.endswith("weight_zero_point") or (i.name.endswith("_zero_point") and "weight" in i.name)]
    assert zeros and all(not z.any() for z in zeros)


def test_either_activation_symmetry_flag_and_quantize_bias():
    for extra in ({"CalibTensorRangeSymmetric": True, "ActivationSymmetric": False},
                  {"ActivationSymmetric": False, "CalibTensorRangeSymmetric": True}):
        assert ort_config(MODEL, extra_options=extra).global_quant_config.input_tensors.symmetric is True
    assert ort_config(MODEL, extra_options={"QuantizeBias": False}).global_quant_config.bias.dtype.value == "float32"
    with pytest.raises(ConfigError, match="BlockSize=32 has no onnxq counterpart: onnxq's blocked weights are per_group"):
        ort_config(MODEL, extra_options={"BlockSize": 32})


def test_a_model_without_node_names(tmp_path):
    """op_types_to_quantize reads every node's type (unnamed ones shared one key and the
    others' types were lost: Add and MaxPool got quantized); naming nodes to leave float
    needs names, so nodes_to_quantize on unnamed nodes is one line."""
    model = onnx.load(MODEL)
    for node in model.graph.node:
        node.name = ""
    quantize_static(model, tmp_path / "conv.onnx", Reader(), op_types_to_quantize=["Conv"])
    assert _quantized_ops(tmp_path / "conv.onnx") == {"Conv"}
    with pytest.raises(ConfigError, match="have no name.*op_types_to_quantize"):
        quantize_static(model, tmp_path / "x.onnx", Reader(), nodes_to_quantize=["conv1"])


def test_errors_name_the_callers_parameters(tmp_path):
    """quantize_static(nodes_to_exclude=[typo]) said 'exclude entry', and
    ModelQuantizer.quantize_model without data 'pass calibration_data': parameters those
    callers never used (API trial)."""
    import onnxq
    from onnxq.errors import CalibrationDataError

    with pytest.raises(ConfigError, match=r"^nodes_to_exclude entry 'conv_1' matches no node.*did you mean 'conv1'"):
        quantize_static(MODEL, tmp_path / "q.onnx", Reader(), nodes_to_exclude=["conv_1"])
    with pytest.raises(CalibrationDataError, match="pass calibration_data_reader"):
        onnxq.ModelQuantizer(onnxq.get_preset("U8S8")).quantize_model(MODEL, tmp_path / "m.onnx")


def test_summary_notes_name_the_callers_parameters(tmp_path):
    """A note that says what to pass names the caller's parameter too: ModelQuantizer's
    `calibration_data_reader`, where the output check asked for had no samples to run."""
    import onnxq

    config = onnxq.get_preset("W8_DYNAMIC")
    config.calibration.check_samples = 8
    result = onnxq.ModelQuantizer(config).quantize_model(MODEL, tmp_path / "m.onnx")
    texts = [text for text in result.summary.note_texts if "output check skipped" in text]
    assert texts and all("pass calibration_data_reader" in text for text in texts), result.summary.note_texts
    assert "pass calibration_data_reader" in onnxq.format_summary(result.summary)


def test_op_types_and_switches_are_checked_as_onnxq_checks_its_own(tmp_path):
    """op_types_to_quantize=['Convv'] left every node float; ActivationSymmetric='false'
    read as true (configuration trial). A real op type the model lacks stays accepted."""
    with pytest.raises(ConfigError, match="op_types_to_quantize names 'Convv'.*did you mean 'Conv'"):
        quantize_static(MODEL, tmp_path / "q.onnx", Reader(), op_types_to_quantize=["Convv"])
    with pytest.raises(ConfigError, match="extra_options ActivationSymmetric must be True or False, got 'false'"):
        quantize_static(MODEL, tmp_path / "q.onnx", Reader(), extra_options={"ActivationSymmetric": "false"})
    result = quantize_static(MODEL, tmp_path / "q.onnx", Reader(), op_types_to_quantize=["Conv", "Attention", "LSTM",
                                                                                          "Softmax"],
                             extra_options={"ActivationSymmetric": np.True_, "WeightSymmetric": 1,
                                            "OpTypesToExcludeOutputQuantization": ["LSTM"]})
    assert _quantized_ops(tmp_path / "q.onnx") == {"Conv"}
    assert not any("has no effect" in t for t in result.summary.note_texts), result.summary.note_texts


def test_op_types_to_quantize_brings_a_default_float_op_type_in():
    """onnxq keeps Softmax float by default; listed in op_types_to_quantize, it is
    quantized, as onnxruntime does."""
    config = ort_config(_softmax_model(), op_types_to_quantize=["MatMul", "Softmax"])
    from onnxq.config.resolve import resolve_node_config
    assert resolve_node_config(config, "sm", "Softmax") is not None
    assert resolve_node_config(ort_config(_softmax_model(), op_types_to_quantize=["MatMul"]), "sm", "Softmax") is None


def _softmax_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                               helper.make_node("Softmax", ["h"], ["y"], name="sm")], "s",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
