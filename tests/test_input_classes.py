"""Input classes that used to break: non-tensor values, old PRelu slopes, training graphs,
and calibration arrays for inputs with a fixed shape.

Accuracy metric throughout: SQNR (10*log10 of signal over error power) of the quantized
model's outputs against the float model's, >= 25 dB for every tensor output and for every
element of a sequence output, on evaluation data not used for calibration.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.calibrate.data import iter_batches, model_inputs, sample_rows
from onnxq.cli import main
from onnxq.errors import CalibrationDataError, ModelError, OnnxqError, UnsupportedModelError
from onnxq.graph.load import load_model

MIN_SQNR_DB = 25.0
TRAINING = "ai.onnx.preview.training"


def weight(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    """He-normal float32 weight, fan-in on axis 0 (MatMul) or the product of axes 1: (Conv)."""
    fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
    return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), name)


def make_model(nodes, inputs, outputs, inits, opset: int, ir_version: int = 8, extra_opsets=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    onnx.checker.check_model(model, full_check=True)
    return model


def default_session(model: onnx.ModelProto | str | Path) -> ort.InferenceSession:
    """onnxruntime with its default session options (full graph optimization)."""
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def assert_close_to_float(reference: list, quantized: list) -> None:
    """Tensor outputs, and sequence outputs element by element, within MIN_SQNR_DB."""
    assert len(reference) == len(quantized)
    for ref, got in zip(reference, quantized):
        if isinstance(ref, list):
            assert isinstance(got, list) and len(got) == len(ref)
            for r, g in zip(ref, got):
                assert sqnr_db(r, g) >= MIN_SQNR_DB
        else:
            assert sqnr_db(ref, got) >= MIN_SQNR_DB


def value_kinds(model: onnx.ModelProto) -> dict[str, str]:
    """Type kind ('tensor_type', 'sequence_type', ...) of every typed value in the graph."""
    g = model.graph
    return {v.name: v.type.WhichOneof("value") for v in [*g.input, *g.value_info, *g.output]}


# ---------------------------------------------------------------------------------------
# 1. sequence and optional values keep their types


def sequence_model(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """MatMuls around SequenceConstruct/SequenceAt/ConcatFromSequence, SplitToSequence and
    Optional/OptionalGetElement; outputs: a tensor, a sequence and an optional."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["a_relu"]),
        helper.make_node("MatMul", ["x", "w2"], ["b"]),
        helper.make_node("SequenceConstruct", ["a_relu", "b"], ["seq"]),
        helper.make_node("SequenceAt", ["seq", "one"], ["seq_1"]),
        helper.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=1),
        helper.make_node("MatMul", ["cat", "w3"], ["y"]),
        helper.make_node("Add", ["seq_1", "a_relu"], ["z"]),
        helper.make_node("SplitToSequence", ["z"], ["z_parts"], axis=1, keepdims=1),
        helper.make_node("Optional", ["y"], ["y_opt"]),
        helper.make_node("OptionalGetElement", ["y_opt"], ["y_out"]),
        helper.make_node("Optional", ["b"], ["b_opt"]),
    ]
    inits = [weight(rng, "w1", 16, 16), weight(rng, "w2", 16, 16), weight(rng, "w3", 32, 8),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    outputs = [
        helper.make_tensor_value_info("y_out", TensorProto.FLOAT, ["N", 8]),
        helper.make_tensor_sequence_value_info("z_parts", TensorProto.FLOAT, ["N", 1]),
        helper.make_value_info("b_opt", helper.make_optional_type_proto(
            helper.make_tensor_type_proto(TensorProto.FLOAT, ["N", 16]))),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                      outputs, inits, opset)


def feeds_x(seed: int, rows: int, cols: int = 16) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)}


def test_load_keeps_sequence_and_optional_types():
    model, _ = load_model(sequence_model())
    values = {o.name: o for node in model.graph for o in node.outputs}
    assert isinstance(values["seq"].type, ir.SequenceType)
    assert isinstance(values["z_parts"].type, ir.SequenceType)
    assert isinstance(values["y_opt"].type, ir.OptionalType)
    assert isinstance(values["b_opt"].type, ir.OptionalType)
    # Shape inference still types the tensors around them.
    assert isinstance(values["seq_1"].type, ir.TensorType) and list(values["seq_1"].shape)[1] == 16
    assert isinstance(values["cat"].type, ir.TensorType)


def test_sequence_model_quantizes_end_to_end(tmp_path):
    model = sequence_model()
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, calibration_data=feeds_x(1, 256))
    saved = onnx.load(str(out))
    onnx.checker.check_model(saved, full_check=True)
    kinds = value_kinds(saved)
    assert kinds["z_parts"] == "sequence_type"
    assert kinds["b_opt"] == "optional_type"
    assert kinds.get("seq", "sequence_type") == "sequence_type"
    assert kinds.get("y_opt", "optional_type") == "optional_type"
    assert result.summary.quantized_by_op.get("MatMul") == 3
    evaluation = feeds_x(2, 64)
    assert_close_to_float(default_session(model).run(None, evaluation),
                          default_session(saved).run(None, evaluation))


def test_sequence_model_at_opset_11_is_upgraded():
    """The opset upgrade (11 -> 13, and -> 21 for 16-bit activations) keeps sequences."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["a_relu"]),
        helper.make_node("SequenceConstruct", ["a_relu", "x"], ["seq"]),
        helper.make_node("SequenceInsert", ["seq", "a_relu"], ["seq3"]),
        helper.make_node("ConcatFromSequence", ["seq3"], ["cat"], axis=1),
        helper.make_node("MatMul", ["cat", "w2"], ["y"]),
        helper.make_node("SplitToSequence", ["y"], ["y_parts"], axis=1, keepdims=1),
    ]
    model = make_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
         helper.make_tensor_sequence_value_info("y_parts", TensorProto.FLOAT, ["N", 1])],
        [weight(rng, "w1", 16, 16), weight(rng, "w2", 48, 8)], opset=11, ir_version=6)
    evaluation = feeds_x(5, 64)
    reference = default_session(model).run(None, evaluation)
    for preset, opset in (("U8S8", 13), ("A16W8", 21)):
        result = onnxq.quantize(model, config=preset, calibration_data=feeds_x(4, 256))
        assert result.summary.opset == (11, opset)
        onnx.checker.check_model(result.model, full_check=True)
        assert value_kinds(result.model)["y_parts"] == "sequence_type"
        assert_close_to_float(reference, default_session(result.model).run(None, evaluation))


def constant_sequence_model() -> onnx.ModelProto:
    """A sequence and an optional built only from initializers: folding must not turn them
    into tensors."""
    rng = np.random.default_rng(6)
    c0 = numpy_helper.from_array(rng.standard_normal((1, 16)).astype(np.float32), "c0")
    c1 = numpy_helper.from_array(rng.standard_normal((1, 16)).astype(np.float32), "c1")
    nodes = [
        helper.make_node("SequenceConstruct", ["c0", "c1"], ["const_seq"]),
        helper.make_node("SequenceAt", ["const_seq", "idx"], ["offset"]),
        helper.make_node("Optional", ["c1"], ["const_opt"]),
        helper.make_node("OptionalGetElement", ["const_opt"], ["c1_again"]),
        helper.make_node("Add", ["x", "offset"], ["shifted"]),
        helper.make_node("Mul", ["shifted", "c1_again"], ["scaled"]),
        helper.make_node("MatMul", ["scaled", "w"], ["y"]),
    ]
    inits = [c0, c1, numpy_helper.from_array(np.array(1, np.int64), "idx"), weight(rng, "w", 16, 8)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], inits, opset=17)


def test_constant_sequences_are_not_folded_into_tensors():
    model = constant_sequence_model()
    loaded, _ = load_model(model)
    ops = {n.op_type for n in loaded.graph}
    assert {"SequenceConstruct", "Optional"} <= ops
    for node in loaded.graph:
        if node.op_type in ("SequenceConstruct", "Optional"):
            assert not isinstance(node.outputs[0].type, ir.TensorType)
    result = onnxq.quantize(model, calibration_data=feeds_x(7, 256))
    onnx.checker.check_model(result.model, full_check=True)
    evaluation = feeds_x(8, 64)
    assert_close_to_float(default_session(model).run(None, evaluation),
                          default_session(result.model).run(None, evaluation))


def test_sequence_graph_input_is_a_clean_calibration_error():
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("ConcatFromSequence", ["xs"], ["cat"], axis=0),
             helper.make_node("MatMul", ["cat", "w"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_sequence_value_info("xs", TensorProto.FLOAT, ["N", 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 8])],
                       [weight(rng, "w", 16, 8)], opset=17)
    xs = [rng.standard_normal((2, 16)).astype(np.float32) for _ in range(3)]
    with pytest.raises(CalibrationDataError, match="'xs' is a sequence"):
        onnxq.quantize(model, calibration_data=[{"xs": xs}])
    # Dynamic quantization needs no data and keeps the sequence input.
    result = onnxq.quantize(model, config="W8_DYNAMIC")
    onnx.checker.check_model(result.model, full_check=True)
    assert value_kinds(result.model)["xs"] == "sequence_type"
    assert_close_to_float(default_session(model).run(None, {"xs": xs}),
                          default_session(result.model).run(None, {"xs": xs}))


def zipmap_model() -> onnx.ModelProto:
    """A classifier whose probabilities also leave as ZipMap's seq(map(int64, float))."""
    rng = np.random.default_rng(10)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
             helper.make_node("ZipMap", ["probabilities"], ["labelled"], domain="ai.onnx.ml",
                              classlabels_int64s=[0, 1, 2])]
    map_type = helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    outputs = [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 3]),
               helper.make_value_info("labelled", helper.make_sequence_type_proto(map_type))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])], outputs,
                      [weight(rng, "w", 8, 3)], opset=17, extra_opsets=[("ai.onnx.ml", 3)])


def test_map_typed_output_is_refused_in_one_line(tmp_path, capsys):
    model = zipmap_model()
    default_session(model)  # valid: onnxruntime runs it
    with pytest.raises(UnsupportedModelError, match="'labelled' has a map type") as info:
        onnxq.quantize(model, calibration_data=feeds_x(0, 8, cols=8))
    assert "zipmap=False" in str(info.value) and "\n" not in str(info.value)
    path = tmp_path / "zipmap.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "calib.npz", **feeds_x(0, 8, cols=8))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(path), str(out), "--calib-data", str(tmp_path / "calib.npz")]) == 2
    assert_one_error_line(capsys.readouterr().err, ("zipmap.onnx", "'labelled'", "map type"))
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# 2. PRelu slopes of old opsets


def conv_prelu(opset: int, channels: int = 4, width: int = 6, slope_shape: tuple = (4,),
               slope_input: bool = False, seed: int = 11) -> tuple[onnx.ModelProto, np.ndarray]:
    """Conv -> PRelu on x [1,3,W,W]; returns the model and the slope values.

    Below IR 4 (opset < 9 era) initializers are also graph inputs, as exporters wrote them.
    With `slope_input` the slope is a real graph input instead of a constant.
    """
    rng = np.random.default_rng(seed)
    slope = rng.uniform(0.05, 0.5, channels).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("PRelu", ["c", "slope"], ["y"])]
    inits = [weight(rng, "w", channels, 3, 3, 3)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, width, width])]
    if slope_input:
        inputs.append(helper.make_tensor_value_info("slope", TensorProto.FLOAT, list(slope_shape)))
    else:
        inits.append(numpy_helper.from_array(slope.reshape(slope_shape), "slope"))
    ir_version = 3 if opset < 9 else 8
    if ir_version < 4:
        inputs += [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, width, width])]
    return make_model(nodes, inputs, outputs, inits, opset, ir_version), slope


def per_channel_reference(model: onnx.ModelProto, slope: np.ndarray, feeds: dict) -> np.ndarray:
    """The float result with the slope applied per channel: the same Conv at opset 13, with
    PRelu written out as max(c, 0) + slope[C,1,1] * min(c, 0) in numpy."""
    graph = model.graph
    inits = [i for i in graph.initializer if i.name == "w"]
    nodes = [n for n in graph.node if n.op_type == "Conv"]
    conv = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, None, None])],
                      [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, None, None, None])], inits,
                      opset=13)
    c = default_session(conv).run(None, {"x": feeds["x"]})[0]
    return np.maximum(c, 0) + slope.reshape(-1, 1, 1) * np.minimum(c, 0)


def calib_images(seed: int, n: int, width: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 1, 3, width, width)).astype(np.float32)


@pytest.mark.parametrize("width", [6, 4])  # 4: the last axis happens to equal C
def test_opset6_prelu_slope_becomes_per_channel(width):
    model, slope = conv_prelu(opset=6, width=width)
    loaded, report = load_model(model)
    prelu = next(n for n in loaded.graph if n.op_type == "PRelu")
    assert list(prelu.inputs[1].const_value.shape) == [4, 1, 1]
    assert any("PRelu" in note for note in report.notes)
    result = onnxq.quantize(model, calibration_data={"x": calib_images(12, 32, width)})
    onnx.checker.check_model(result.model, full_check=True)
    for i, image in enumerate(calib_images(13, 4, width)):
        feeds = {"x": image}
        got = default_session(result.model).run(None, feeds)[0]
        assert sqnr_db(per_channel_reference(model, slope, feeds), got) >= MIN_SQNR_DB, i


def test_opset6_prelu_slope_graph_input_gets_a_reshape():
    model, slope = conv_prelu(opset=6, slope_input=True)
    loaded, _ = load_model(model)
    prelu = next(n for n in loaded.graph if n.op_type == "PRelu")
    reshape = prelu.inputs[1].producer()
    assert reshape is not None and reshape.op_type == "Reshape"
    assert reshape.inputs[0].is_graph_input()
    images = calib_images(14, 32)
    result = onnxq.quantize(model, calibration_data={"x": images, "slope": np.tile(slope, (32, 1))})
    onnx.checker.check_model(result.model, full_check=True)
    feeds = {"x": calib_images(15, 1)[0], "slope": slope}
    got = default_session(result.model).run(None, feeds)[0]
    assert sqnr_db(per_channel_reference(model, slope, feeds), got) >= MIN_SQNR_DB


def test_opset7_broadcastable_slope_is_left_alone():
    """At opset 7+ a [C] slope against [..., C] broadcasts on the last axis by design."""
    model, _ = conv_prelu(opset=13, width=4)
    loaded, report = load_model(model)
    prelu = next(n for n in loaded.graph if n.op_type == "PRelu")
    assert list(prelu.inputs[1].const_value.shape) == [4]
    assert not any("PRelu" in note for note in report.notes)
    result = onnxq.quantize(model, calibration_data={"x": calib_images(16, 32, 4)})
    feeds = {"x": calib_images(17, 1, 4)[0]}
    assert_close_to_float(default_session(model).run(None, feeds),
                          default_session(result.model).run(None, feeds))


# ---------------------------------------------------------------------------------------
# 3. training graphs are refused


def training_model(kind: str) -> onnx.ModelProto:
    """A MatMul inference graph plus a Gradient or an Adam node of the training domain."""
    rng = np.random.default_rng(18)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]
    inits = [weight(rng, "w", 4, 4)]
    if kind == "gradient":
        nodes.append(helper.make_node("Gradient", ["x", "w"], ["dw"], name="grad", domain=TRAINING,
                                      xs=["w"], y="y"))
        outputs.append(helper.make_tensor_value_info("dw", TensorProto.FLOAT, [4, 4]))
    else:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("g", "v", "h")]
        inits += [numpy_helper.from_array(np.array(0.01, np.float32), "lr"),
                  numpy_helper.from_array(np.array(1, np.int64), "step")]
        nodes.append(helper.make_node("Adam", ["lr", "step", "w", "g", "v", "h"], ["w_new", "v_new", "h_new"],
                                      name="adam", domain=TRAINING))
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("w_new", "v_new", "h_new")]
    return make_model(nodes, inputs, outputs, inits, opset=17, extra_opsets=[(TRAINING, 1)])


def assert_one_error_line(err: str, words: tuple[str, ...]) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("onnxq: error: ")
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.parametrize("kind", ["gradient", "adam"])
def test_training_graph_is_refused(kind, tmp_path, capsys):
    model = training_model(kind)
    with pytest.raises(UnsupportedModelError) as info:
        onnxq.quantize(model, calibration_data={"x": np.ones((2, 1, 4), np.float32)})
    assert isinstance(info.value, ModelError) and "\n" not in str(info.value)
    path = tmp_path / "train.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 1, 4), np.float32))
    out = tmp_path / "out" / "q.onnx"
    before = path.read_bytes()
    rc = main(["quantize", str(path), str(out), "--calib-data", str(tmp_path / "calib.npz")])
    assert rc == 2
    op = "Gradient" if kind == "gradient" else "Adam"
    assert_one_error_line(capsys.readouterr().err, ("train.onnx", op, TRAINING, "export the inference graph"))
    assert path.read_bytes() == before
    assert not out.exists()


def test_training_node_in_a_subgraph_is_refused():
    inner = training_model("gradient").graph
    branch = helper.make_graph(list(inner.node), "branch", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                              [1, 4])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y2"])], "other", [],
                              [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("If", ["flag"], ["out"], then_branch=branch, else_branch=other)]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
                                       helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4])], list(inner.initializer)),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)], ir_version=8)
    with pytest.raises(UnsupportedModelError, match="'grad' \\(Gradient\\)"):
        load_model(model)


def test_unused_training_opset_import_is_fine():
    """Only nodes of the training domain make a training graph, not the import alone."""
    rng = np.random.default_rng(19)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                       [weight(rng, "w", 4, 4)], opset=17, extra_opsets=[(TRAINING, 1)])
    result = onnxq.quantize(model, calibration_data=feeds_x(20, 64, cols=4))
    assert result.summary.quantized_by_op == {"MatMul": 1}


# ---------------------------------------------------------------------------------------
# 4. calibration arrays for inputs with a fixed shape


def fixed_input_matmul(shape: list[int], seed: int = 21) -> onnx.ModelProto:
    """x (fixed `shape`) @ w [shape[-1], 4], Relu: x is calibrated directly."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape[:-1] + [4])],
                      [weight(rng, "w", shape[-1], 4)], opset=17)


def batches(model: onnx.ModelProto, source, max_samples: int | None = None, batch_size: int = 8):
    inputs = model_inputs(load_model(model)[0])
    return [b["x"] for b in iter_batches(source, inputs, batch_size, max_samples)], inputs


def samples(shape, n: int | None, seed: int) -> np.ndarray:
    full = list(shape) if n is None else [n, *shape]
    return np.random.default_rng(seed).standard_normal(full).astype(np.float32)


FIXED_SHAPES = [[3, 32, 32], [2, 8], [1, 3, 8, 8]]


@pytest.mark.parametrize("shape", FIXED_SHAPES, ids=str)
def test_array_of_the_input_shape_is_one_sample(shape):
    model = fixed_input_matmul(shape)
    x = samples(shape, None, 22)
    for source in ({"x": x}, [{"x": x}]):
        for max_samples in (None, 1):
            got, inputs = batches(model, source, max_samples)
            assert len(got) == 1 and np.array_equal(got[0], x)
            assert sum(len(b) for b in got) == sample_rows(inputs)["x"] == shape[0]
    result = onnxq.quantize(model, calibration_data={"x": x})
    assert result.ranges["x"] == (float(x.min()), float(x.max()))


@pytest.mark.parametrize("shape", FIXED_SHAPES, ids=str)
def test_stack_of_input_shapes_is_n_samples(shape, tmp_path):
    model = fixed_input_matmul(shape)
    x = samples(shape, 5, 23)
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, sample in enumerate(x):
        np.save(folder / f"{i}.npy", sample)
    np.savez(tmp_path / "stack.npz", x=x)
    sources = {"dict": {"x": x}, "npz": tmp_path / "stack.npz", "list_of_stacks": [{"x": x[:2]}, {"x": x[2:]}],
               "npy_dir": folder, "list_of_samples": [{"x": s} for s in x]}
    for name, source in sources.items():
        got, inputs = batches(model, source)
        assert len(got) == 5, name
        for sample, batch in zip(x, got):
            assert np.array_equal(batch, sample), name
        got, _ = batches(model, source, max_samples=3)
        assert len(got) == 3 and all(np.array_equal(b, s) for b, s in zip(got, x)), name
    result = onnxq.quantize(model, calibration_data={"x": x})
    assert result.ranges["x"] == (float(x.min()), float(x.max()))
    result = onnxq.quantize(model, calibration_data={"x": samples(shape, 64, 29)})
    evaluation = {"x": samples(shape, None, 24)}
    assert_close_to_float(default_session(model).run(None, evaluation),
                          default_session(result.model).run(None, evaluation))


@pytest.mark.parametrize("source", ["samples_of_one_row", "array_of_two_rows", "npz_of_two_rows"])
def test_fixed_batch_larger_than_the_data_is_a_clear_error(source, tmp_path):
    model = fixed_input_matmul([4, 3, 8, 8])
    rows = samples([3, 8, 8], 2, 25)[:, None]  # two [1,3,8,8] samples
    np.savez(tmp_path / "two.npz", x=rows[:, 0])
    data = {"samples_of_one_row": [{"x": r} for r in rows], "array_of_two_rows": {"x": rows[:, 0]},
            "npz_of_two_rows": tmp_path / "two.npz"}[source]
    with pytest.raises(CalibrationDataError) as info:
        onnxq.quantize(model, calibration_data=data)
    message = str(info.value)
    assert "\n" not in message
    for word in ("'x'", "fixed batch of 4", "[4,3,8,8]", "after 2 rows", "dynamic batch"):
        assert word in message, (word, message)


def test_fixed_batch_error_through_the_cli(tmp_path, capsys):
    model_path = tmp_path / "fixed.onnx"
    onnx.save(fixed_input_matmul([4, 3, 8, 8]), str(model_path))
    np.savez(tmp_path / "two.npz", x=samples([3, 8, 8], 2, 26))
    out = tmp_path / "q.onnx"
    rc = main(["quantize", str(model_path), str(out), "--calib-data", str(tmp_path / "two.npz")])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("'x'", "fixed batch of 4", "[4,3,8,8]"))
    assert not out.exists()


def test_fixed_batch_whole_inputs_and_rows_agree():
    """[4,3,8,8]: two whole inputs, their stack, and their eight rows are the same data."""
    model = fixed_input_matmul([4, 3, 8, 8])
    x = samples([4, 3, 8, 8], 2, 27)
    rows = x.reshape(8, 3, 8, 8)
    reference, _ = batches(model, {"x": x})
    assert len(reference) == 2 and all(np.array_equal(b, s) for b, s in zip(reference, x))
    for source in ([{"x": s} for s in x], {"x": rows}, [{"x": r[None]} for r in rows]):
        got, _ = batches(model, source)
        assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, reference))
    # 10 rows: the two rows that fill no whole input are dropped, not run as a partial batch.
    got, _ = batches(model, {"x": np.concatenate([rows, rows[:2]])})
    assert len(got) == 2


def test_stack_with_a_wrong_dimension_is_still_a_shape_error():
    model = fixed_input_matmul([3, 32, 32])
    # a stack of unbatched inputs: the axis that differs, not the rank (detection trial)
    with pytest.raises(CalibrationDataError, match=r"samples of shape \[3, 32, 31\], expected float32 \[3,32,32\] "
                                                   r"\(axis 2 must be 32\)") as info:
        onnxq.quantize(model, calibration_data={"x": samples([3, 32, 31], 5, 28)})
    assert isinstance(info.value, OnnxqError)


@pytest.mark.parametrize("preset", ["U8S8", "FP8_E4M3"])
def test_clip_bounds_given_as_one_element_tensors(preset):
    """Clip's min/max as [1]-shaped constants (valid ONNX; some exporters write them):
    quantize read them as scalars and crashed; now they are read like scalar bounds."""
    from helpers import GraphBuilder, random_feeds

    b = GraphBuilder(2)
    x = b.input("x", ["N", 4, 8, 8])
    lo, hi = b.const("lo", np.array([0.0], np.float32)), b.const("hi", np.array([6.0], np.float32))
    model = b.build([b.conv(b.node("Clip", [b.conv(x, 4, 8), lo, hi]), 8, 4)], name="clip_1d_bounds")
    result = onnxq.quantize(model, None, preset, random_feeds(model, 16, seed=0))
    onnx.checker.check_model(result.model, full_check=True)
    assert result.summary.fidelity.sqnr_db > 15  # measured 32 (U8S8) and 23 (FP8) dB
