"""Float16 and bfloat16 models are quantized as the float32 models they stand for: float32
inside, their inputs and outputs in their own type, weights left float stored as they were
(`graph/upcast.py`). Before, every DequantizeLinear of a float16 model was refused at the
load check and the whole model stayed float."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, every_kernel, gemm, residual, sqnr_db
from onnx import TensorProto, numpy_helper

import onnxq

HALF = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}


def to_half(model: onnx.ModelProto, elem: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """`model` with every float32 weight, input, output and Cast in the half type `elem`."""
    half = onnx.ModelProto()
    half.CopyFrom(model)
    graph = half.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            array = numpy_helper.to_array(init).astype(HALF[elem])
            tensor = onnx.helper.make_tensor(init.name, elem, array.shape, array.view(np.uint16).tobytes(), raw=True)
            graph.initializer[i].CopyFrom(tensor)
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = elem
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = elem
    del graph.value_info[:]
    return half


def _run(model, feeds):
    session = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session, session.run(None, feeds)[0]


def _types(session):
    return [v.type for v in session.get_inputs()], [v.type for v in session.get_outputs()]


def _producer_ops(model: onnx.ModelProto, op_type: str) -> list[str]:
    made = {o: n.op_type for n in model.graph.node for o in n.output}
    return [made.get(n.input[1], "initializer") for n in model.graph.node if n.op_type == op_type]


def test_a_float16_model_is_quantized_in_float32_with_its_interface_kept(tmp_path):
    elem = TensorProto.FLOAT16
    half = to_half(every_kernel(), elem)
    path = tmp_path / "half.onnx"
    onnx.save(half, path)
    rng = np.random.default_rng(0)
    calib = {"x": rng.standard_normal((32, 4, 8, 8)).astype(HALF[elem])}
    evaluation = {"x": rng.standard_normal((16, 4, 8, 8)).astype(HALF[elem])}
    result = onnxq.quantize(str(path), tmp_path / "q.onnx", None, calib, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized, full_check=True)
    q_session, q_out = _run(str(tmp_path / "q.onnx"), evaluation)
    f_session, f_out = _run(str(path), evaluation)
    kind = "float16"
    assert _types(q_session) == _types(f_session) == ([f"tensor({kind})"], [f"tensor({kind})"])
    assert q_out.dtype == HALF[elem]
    # every Conv and the Gemm read a dequantized int8 weight: nothing left float but the boundary
    assert set(_producer_ops(quantized, "Conv") + _producer_ops(quantized, "Gemm")) == {"DequantizeLinear"}
    assert sqnr_db(f_out.astype(np.float32), q_out.astype(np.float32)) > 25
    assert any(n.startswith(f"{kind} model: quantized as float32") for n in result.summary.note_texts)
    assert set(result.summary.float_nodes) == {"x_to_float32", f"{half.graph.output[0].name}_to_{kind}"}
    first = (tmp_path / "q.onnx").read_bytes()
    onnxq.quantize(str(path), tmp_path / "q2.onnx", None, calib, progress=False)
    assert hashlib.sha256((tmp_path / "q2.onnx").read_bytes()).digest() == hashlib.sha256(first).digest()
    assert path.read_bytes() == half.SerializeToString() or onnx.load(str(path)) == half  # the input is untouched


def test_weights_left_float_are_stored_half_again(tmp_path):
    """An excluded layer's weight goes back to float16 behind a Cast: the file does not
    grow where layers stay float, and the layer computes what it computed."""
    half = to_half(residual())
    path = tmp_path / "half.onnx"
    onnx.save(half, path)
    rng = np.random.default_rng(1)
    calib = {"x": rng.standard_normal((32, 3, 12, 12)).astype(np.float16)}
    last = [n.name for n in half.graph.node if n.op_type == "Conv"][-1]
    config = onnxq.compose_config("U8S8", None, {"exclude": [last]})
    result = onnxq.quantize(str(path), tmp_path / "q.onnx", config, calib, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized)
    conv = next(n for n in quantized.graph.node if n.name == last)
    made = {o: n for n in quantized.graph.node for o in n.output}
    cast = made[conv.input[1]]
    assert cast.op_type == "Cast"
    stored = next(i for i in quantized.graph.initializer if i.name == cast.input[0])
    assert stored.data_type == TensorProto.FLOAT16
    original = next(i for i in half.graph.initializer if i.name == conv.input[1])
    np.testing.assert_array_equal(numpy_helper.to_array(stored), numpy_helper.to_array(original))
    assert any("weights left float stored as float16 again" in n and not n.split("; ")[1].startswith("0 ")
               for n in result.summary.note_texts)
    _, f_out = _run(str(path), calib)
    _, q_out = _run(str(tmp_path / "q.onnx"), calib)
    assert sqnr_db(f_out.astype(np.float32), q_out.astype(np.float32)) > 25


def test_casts_to_half_inside_a_float32_model_are_removed(tmp_path):
    """A float32 model that runs a stretch in float16 (a mixed-precision export) is
    quantized through that stretch: its Casts, now float32 to float32, are gone."""
    b = GraphBuilder(3)
    x = b.input("x", ["N", 3, 12, 12])
    h = b.relu(b.conv(x, 3, 8))
    h16 = b.node("Cast", [h], to=TensorProto.FLOAT16)
    w = np.random.default_rng(3).standard_normal((8, 8, 3, 3)).astype(np.float16) * np.float16(0.2)
    y16 = b.node("Conv", [h16, b.const("w16", w)], pads=[1, 1, 1, 1])
    model = b.build([b.node("Cast", [y16], to=TensorProto.FLOAT)], name="mixed")
    path = tmp_path / "mixed.onnx"
    onnx.save(model, path)
    calib = {"x": np.random.default_rng(4).standard_normal((16, 3, 12, 12)).astype(np.float32)}
    onnxq.quantize(str(path), tmp_path / "q.onnx", None, calib, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized)
    assert not [n for n in quantized.graph.node if n.op_type == "Cast" and n.output[0] != quantized.graph.output[0].name]
    assert set(_producer_ops(quantized, "Conv")) == {"DequantizeLinear"}
    _, f_out = _run(str(path), calib)
    _, q_out = _run(str(tmp_path / "q.onnx"), calib)
    assert q_out.dtype == np.float32 and sqnr_db(f_out, q_out) > 25


def test_a_float16_subgraph_is_made_float32_too(tmp_path):
    """An If whose branches compute in float16: the branches become float32 with the rest,
    and the output is valid and runs."""
    from onnx import helper

    rng = np.random.default_rng(5)

    def branch(name: str, scale: float) -> onnx.GraphProto:
        k = helper.make_tensor(f"k_{name}", TensorProto.FLOAT16, [1], np.array([scale], np.float16).view(np.uint16)
                               .tobytes(), raw=True)
        return helper.make_graph([helper.make_node("Mul", ["h", f"k_{name}"], [f"o_{name}"])], name, [],
                                 [helper.make_tensor_value_info(f"o_{name}", TensorProto.FLOAT16, ["N", 8, 8, 8])], [k])

    w = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1], name="conv"),
         helper.make_node("If", ["flag"], ["y"], then_branch=branch("then", 2.0), else_branch=branch("else", -1.0),
                          name="if")],
        "sub", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 3, 8, 8]),
                helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 8, 8, 8])], [w])
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    feeds = {"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float16), "flag": np.array(True)}
    onnxq.quantize(str(path), tmp_path / "q.onnx", None, feeds, progress=False)
    onnx.checker.check_model(onnx.load(str(tmp_path / "q.onnx")))
    for flag in (True, False):
        feed = {**feeds, "flag": np.array(flag)}
        _, f_out = _run(str(path), feed)
        _, q_out = _run(str(tmp_path / "q.onnx"), feed)
        assert q_out.dtype == np.float16 and sqnr_db(f_out.astype(np.float32), q_out.astype(np.float32)) > 25


def test_bfloat16_inside_is_quantized_and_a_bfloat16_interface_is_refused(tmp_path, capsys):
    """bfloat16 weights and Casts inside a float32 model are quantized as float32 (onnxruntime's
    CPU has no bfloat16 Gemm: the model did not even open). bfloat16 inputs or outputs cannot
    be fed or read through onnxruntime's Python API: one line, exit 2, nothing written."""
    from onnxq.cli import main

    inner = to_half(gemm(), TensorProto.BFLOAT16)
    graph = inner.graph
    graph.node.insert(0, onnx.helper.make_node("Cast", ["x32"], ["x"], to=TensorProto.BFLOAT16, name="in"))
    out = graph.output[0].name
    for node in graph.node:
        node.output[:] = [f"{out}_bf" if o == out else o for o in node.output]
    graph.node.append(onnx.helper.make_node("Cast", [f"{out}_bf"], [out], to=TensorProto.FLOAT, name="out"))
    graph.input[0].name = "x32"
    graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    path = tmp_path / "inside.onnx"
    onnx.save(inner, path)
    rng = np.random.default_rng(6)
    calib = {"x32": rng.standard_normal((32, 32)).astype(np.float32)}
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):  # the float model does not run on the CPU
        _run(str(path), calib)
    result = onnxq.quantize(str(path), tmp_path / "q.onnx", None, calib, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized)
    assert set(_producer_ops(quantized, "Gemm")) == {"DequantizeLinear"}
    _, q_out = _run(str(tmp_path / "q.onnx"), calib)
    bf16_model = to_half(gemm(), TensorProto.BFLOAT16)  # the float32 model it stands for: its weights as stored
    reference_model = gemm()
    for i, init in enumerate(bf16_model.graph.initializer):
        reference_model.graph.initializer[i].CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    _, reference = _run(reference_model, {"x": calib["x32"]})
    assert sqnr_db(reference, q_out) > 25
    assert any(n.startswith("bfloat16 model: quantized as float32") for n in result.summary.note_texts)

    onnx.save(to_half(gemm(), TensorProto.BFLOAT16), tmp_path / "bf_io.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 32)).astype(np.float32))
    capsys.readouterr()
    assert main(["quantize", str(tmp_path / "bf_io.onnx"), str(tmp_path / "bad.onnx"), "--calib-data",
                 str(tmp_path / "calib.npz")]) == 2
    err = capsys.readouterr().err
    assert "input or output 'x' is bfloat16" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad.onnx").exists()


def test_weight_only_blocks_keep_a_float16_decoder_half_and_quantize_other_models_in_float32(tmp_path):
    """A KV-cache decoder under W4_GROUP128 stays float16 (MatMulNBits takes float16
    activations as they are; a GPU genai folder's attention kernels take float16 only), with
    float16 block scales and no Casts. Any other float16 model is quantized as float32, so
    its Gemm and embedding are quantized too (float16 DequantizeLinear was refused)."""
    rng = np.random.default_rng(7)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
         onnx.helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="cache")], "fp16",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 128]),
         onnx.helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", 1]),
         onnx.helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT16, ["N", 2, "P", 8])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 32]),
         onnx.helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT16, ["N", 2, "P", 8])],
        [numpy_helper.from_array(rng.standard_normal((128, 32)).astype(np.float16), "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    result = onnxq.quantize(model, tmp_path / "q.onnx", onnxq.get_preset("W4_GROUP128"), None, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    assert [n.op_type for n in quantized.graph.node] == ["MatMulNBits", "Identity"]
    node = quantized.graph.node[0]
    assert node.input[0] == "x"
    assert next(i for i in quantized.graph.initializer if i.name == node.input[2]).data_type == TensorProto.FLOAT16
    assert not any("model: quantized as float32" in n for n in result.summary.note_texts)

    plain = to_half(gemm())
    onnxq.quantize(plain, tmp_path / "g.onnx", onnxq.get_preset("W4_GROUP128"), None, progress=False)
    gemms = onnx.load(str(tmp_path / "g.onnx"))
    assert set(_producer_ops(gemms, "Gemm")) == {"DequantizeLinear"}
    x = np.random.default_rng(8).standard_normal((8, 32)).astype(np.float16)
    _, f_out = _run(plain, {"x": x})
    _, q_out = _run(str(tmp_path / "g.onnx"), {"x": x})
    assert q_out.dtype == np.float16 and sqnr_db(f_out.astype(np.float32), q_out.astype(np.float32)) > 12


@pytest.mark.parametrize("case", ["input returned", "initializer returned", "names taken"])
def test_half_boundaries_that_are_not_plain(tmp_path, case):
    """A float16 graph input or initializer also returned as an output keeps its type there
    (the input's pass-through was a traceback, the initializer came out float32), and the
    names onnxq adds avoid the model's own (a tensor named x_float32 was a duplicate)."""
    from onnx import helper

    half = TensorProto.FLOAT16
    rng = np.random.default_rng(9)
    w = numpy_helper.from_array((rng.standard_normal((32, 32)) * 0.2).astype(np.float16), "w")
    y = helper.make_tensor_value_info("y", half, ["N", 32])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    outputs = [y]
    if case == "input returned":
        outputs.append(helper.make_tensor_value_info("x", half, ["N", 32]))
    elif case == "initializer returned":
        outputs.append(helper.make_tensor_value_info("w", half, [32, 32]))
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["x_float32"], name="mm"),
                 helper.make_node("Relu", ["x_float32"], ["y_float32"], name="x_to_float32"),
                 helper.make_node("MatMul", ["y_float32", "w"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", half, ["N", 32])], outputs, [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    calib = {"x": rng.standard_normal((16, 32)).astype(np.float16)}
    onnxq.quantize(model, tmp_path / "q.onnx", None, calib, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized, full_check=True)
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [(o.name, o.type) for o in session.get_outputs()] == [(o.name, o.type) for o in reference.get_outputs()]
    assert set(_producer_ops(quantized, "MatMul")) == {"DequantizeLinear"}  # every weight still a constant
    got, want = session.run(None, calib), reference.run(None, calib)
    assert sqnr_db(want[0].astype(np.float32), got[0].astype(np.float32)) > 25
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(a, b)  # the pass-through output: exactly the float model's


def test_analyze_takes_a_float16_model_and_its_quantized_form(tmp_path, capsys):
    """`onnxq analyze` quantizes the float model's tensors one by one: a float16 float model
    is made float32 inside for it too (float16 QuantizeLinear was refused: one error line)."""
    from onnxq.cli import main

    half = to_half(every_kernel())
    onnx.save(half, tmp_path / "half.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(10).standard_normal((16, 4, 8, 8)).astype(np.float16))
    assert main(["quantize", str(tmp_path / "half.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(tmp_path / "calib.npz"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "half.onnx"), str(tmp_path / "q.onnx"), "--data",
                 str(tmp_path / "calib.npz")]) == 0
    out = capsys.readouterr().out
    assert "tensors, worst first" in out and "x_float32" in out


def test_a_subgraphs_float16_weight_left_float_is_stored_half_again(tmp_path):
    """A weight inside an If branch that stays float goes back to float16 behind a Cast in
    its branch, as the main graph's do (it stayed float32: twice the bytes)."""
    from onnx import helper

    rng = np.random.default_rng(6)
    inner = numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float16), "w_inner")
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "w_inner"], ["t"], name="then_mm")], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT16, ["N", 8])], [inner])
    else_g = helper.make_graph([helper.make_node("Identity", ["h"], ["e"], name="else_id")], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT16, ["N", 8])])
    w = numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 8]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 8])], [w])
    path = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    data = [{"x": rng.standard_normal((1, 8)).astype(np.float16), "c": np.array(True)} for _ in range(8)]
    onnxq.quantize(str(path), tmp_path / "q.onnx", None, data, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized)
    branch = next(a.g for n in quantized.graph.node if n.op_type == "If" for a in n.attribute if a.name == "then_branch")
    stored = {i.name: i for i in branch.initializer}
    half = [i for i in stored.values() if i.data_type == TensorProto.FLOAT16]
    assert len(half) == 1 and not [i for i in stored.values() if i.data_type == TensorProto.FLOAT]
    np.testing.assert_array_equal(numpy_helper.to_array(half[0]), numpy_helper.to_array(inner))
    for flag in (True, False):
        feed = {**data[0], "c": np.array(flag)}
        _, f_out = _run(str(path), feed)
        _, q_out = _run(str(tmp_path / "q.onnx"), feed)
        assert q_out.dtype == np.float16 and sqnr_db(f_out.astype(np.float32), q_out.astype(np.float32)) > 25


@pytest.mark.parametrize("preset", ["FP16", "BF16"])
def test_a_float_cast_of_a_half_model_says_there_is_nothing_to_convert(preset):
    """FP16/BF16 on a float16 model printed 'quantized nodes: 0', a float-cast line of zeros
    and 'nothing was quantized (see 'left in float'); pick U8S8', with no such section
    (format trial): the note and the warning say the model has no float32 op to cast."""
    model = to_half(residual())
    result = onnxq.quantize(model, None, preset, None, progress=False)
    texts = result.summary.note_texts
    assert any(t.startswith("float cast: nothing to convert") for t in texts), texts
    assert "warning: nothing was converted: no op of the model computes in float32 (see the float cast note)" in texts
    assert not any("left in float" in t or "U8S8" in t for t in texts), texts
