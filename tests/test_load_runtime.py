"""Load takes what onnxruntime takes: ops onnx's checker does not know but onnxruntime runs
(contrib ops registered in the default domain, as in onnxruntime-genai models), and
external data reached through symbolic or hard links (a model folder sharing its weights
with a cache). What neither knows is still refused in one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as nh
import onnx_ir as ir
import pytest
from helpers import cosine, run, sqnr_db

import onnxq
import onnxq.graph.external_data as external_data
from onnxq.cli import main
from onnxq.graph.load import read_model
from onnxq.notes import Topic, of

RNG = np.random.default_rng(0)


def decoder_block(norm: str = "SimplifiedLayerNormalization") -> onnx.ModelProto:
    """MatMul -> RMS norm (an onnxruntime contrib op in the default domain) -> MatMul."""
    w1 = nh.from_array((RNG.standard_normal((64, 64)) * 0.1).astype(np.float32), "w1")
    gamma = nh.from_array((1 + 0.1 * RNG.standard_normal(64)).astype(np.float32), "gamma")
    w2 = nh.from_array((RNG.standard_normal((64, 32)) * 0.1).astype(np.float32), "w2")
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
             oh.make_node(norm, ["a", "gamma"], ["n"], name="norm", axis=-1, epsilon=1e-5),
             oh.make_node("MatMul", ["n", "w2"], ["y"], name="mm2")]
    graph = oh.make_graph(nodes, "block", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 64])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 32])], [w1, gamma, w2])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


CALIB = {"x": RNG.standard_normal((64, 64)).astype(np.float32)}
EVAL = {"x": RNG.standard_normal((16, 64)).astype(np.float32)}


def test_a_contrib_op_in_the_default_domain_loads_and_quantizes(tmp_path):
    model = decoder_block()
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered for SimplifiedLayerNormalization"):
        onnx.checker.check_model(model)
    out = tmp_path / "block.int8.onnx"
    result = onnxq.quantize(model, out, "U8S8", CALIB, progress=False)
    (checked,) = [n for n in of(result.summary.notes, Topic.LOAD) if "onnx.checker does not know" in n.text]
    assert "SimplifiedLayerNormalization x1" in checked.text and "onnxruntime runs them" in checked.text
    assert result.summary.quantized_by_op == {"MatMul": 2}
    assert result.summary.float_nodes["norm"][0] == "SimplifiedLayerNormalization"
    read_model(out)  # the output passes the same check (onnx.checker, the contrib op by onnxruntime's kernels)
    assert sqnr_db(run(model, EVAL), run(str(out), EVAL)) > 25


def test_an_op_neither_knows_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "unknown.onnx"
    onnx.save(decoder_block("NoSuchNormalization"), path)
    assert main(["quantize", str(path), str(tmp_path / "out.onnx"), "--calib-data", str(_npz(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "No Op registered for NoSuchNormalization" in err and "re-export the model" in err


def _npz(folder: Path) -> Path:
    path = folder / "calib.npz"
    np.savez(path, **CALIB)
    return path


def _saved_with_data(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(decoder_block("LayerNormalization"), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)
    return path


@pytest.mark.parametrize("link", ["copy", "symlink", "hardlink"])
@pytest.mark.parametrize("mapped", [False, True], ids=["inlined", "mapped"])
def test_external_data_through_a_link_is_read(tmp_path, monkeypatch, link, mapped):
    if mapped:  # weights left in their file, read when used (the small ones too, at save)
        monkeypatch.setattr(external_data, "INLINE_LIMIT", 0)
    real = _saved_with_data(tmp_path / "cache")
    shared = tmp_path / "folder"
    shared.mkdir()
    shutil.copy(real, shared / "model.onnx")
    target = real.with_name("model.onnx.data")
    {"copy": shutil.copy, "symlink": os.symlink, "hardlink": os.link}[link](target, shared / "model.onnx.data")
    before = target.read_bytes()
    out = tmp_path / "out" / "model.int8.onnx"
    out.parent.mkdir()
    result = onnxq.quantize(str(shared / "model.onnx"), str(out), "U8S8", CALIB, progress=False)
    assert result.summary.quantized_by_op == {"MatMul": 2}
    onnx.checker.check_model(str(out), full_check=True)
    assert cosine(run(str(real), EVAL), run(str(out), EVAL)) > 0.999
    assert target.read_bytes() == before  # the shared data is never written


def test_external_data_outside_the_folder_is_refused(tmp_path, capsys):
    path = _saved_with_data(tmp_path / "m")
    proto = onnx.load(path, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../elsewhere/model.onnx.data"
    onnx.save(proto, path)
    assert main(["quantize", str(path), str(tmp_path / "out.onnx"), "--calib-data", str(_npz(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert "outside the model's folder" in err and len(err.splitlines()) == 1


def test_weight_only_kernels_already_there_stay_and_the_rest_is_quantized():
    """A model whose builder left some MatMuls as MatMulNBits (int4): those stay as they
    are, the float MatMuls are quantized, and the summary names the ones kept."""
    model = decoder_block("LayerNormalization")
    partly = onnxq.quantize(model, None, onnxq.compose_config("W4_GROUP128", None, {"exclude": ["mm2"]}),
                            progress=False).model
    assert [n.op_type for n in partly.graph.node].count("MatMulNBits") == 1
    result = onnxq.quantize(partly, None, "W8_GROUP128", progress=False)
    bits = {n.name: oh.get_node_attr_value(n, "bits") for n in result.model.graph.node if n.op_type == "MatMulNBits"}
    assert sorted(bits.values()) == [4, 8]  # the int4 one kept, the float one now int8
    (kept,) = [n for n in of(result.summary.notes, Topic.FLOAT) if n.text.startswith("already quantized")]
    assert len(kept.nodes) == 1 and bits[kept.nodes[0]] == 4
    assert sqnr_db(run(model, EVAL), run(result.model, EVAL)) > 15
    # A model quantized another way (Q/DQ) is still refused: quantizing it again quantizes twice.
    qdq = onnxq.quantize(model, None, "U8S8", CALIB, progress=False).model
    with pytest.raises(onnxq.OnnxqError, match="is already quantized"):
        onnxq.quantize(qdq, None, "U8S8", CALIB, progress=False)


@pytest.mark.parametrize("ir_version, noted", [(8, True), (3, False)])
def test_weights_listed_as_inputs_become_constants_and_the_summary_says_so(ir_version, noted):
    """A weight also listed as a graph input (from IR 4 an overridable default) is quantized
    from its value and leaves the inputs: the summary names it. Before IR 4 every weight was
    listed so: nothing to say."""
    model = decoder_block()
    listed = ["w1"] if noted else [t.name for t in model.graph.initializer]  # IR 3: every one, as it must
    model.graph.input.extend(oh.make_tensor_value_info(t.name, onnx.TensorProto.FLOAT, list(t.dims))
                             for t in model.graph.initializer if t.name in listed)
    model.ir_version = ir_version
    result = onnxq.quantize(model, None, None, CALIB)
    assert [i.name for i in result.model.graph.input] == ["x"]
    said = [n for n in result.summary.note_texts if "default value" in n]
    assert bool(said) == noted
    if noted:
        assert "w1" in said[0] and "feeding others at run time is not possible" in said[0]


def test_a_matmul_after_a_contrib_op_gets_its_activation_quantized():
    """onnx's inference leaves a com.microsoft op's outputs untyped; their types come from the
    op's schema (onnxruntime's), so the MatMul reading BiasGelu's output is quantized
    statically, as after a Tanh (it was silently weight-only). SkipLayerNormalization's mean
    output takes the one type its parameter allows."""
    from onnxq.graph.load import load_model

    w = nh.from_array((RNG.standard_normal((32, 8)) * 0.2).astype(np.float32), "w")
    b = nh.from_array((RNG.standard_normal(32) * 0.1).astype(np.float32), "b")
    gamma = nh.from_array(np.ones(32, np.float32), "gamma")
    nodes = [oh.make_node("SkipLayerNormalization", ["x", "x", "gamma"], ["n", "mean"], domain="com.microsoft",
                          name="norm"),
             oh.make_node("BiasGelu", ["n", "b"], ["a"], domain="com.microsoft", name="act"),
             oh.make_node("MatMul", ["a", "w"], ["y"], name="mm")]
    graph = oh.make_graph(nodes, "fused", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 32])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])], [w, b, gamma])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    loaded, _ = load_model(model)
    values = {o.name: o for node in loaded.graph for o in node.outputs}
    assert values["a"].dtype == values["mean"].dtype == values["n"].dtype == ir.DataType.FLOAT
    data = {"x": RNG.standard_normal((32, 32)).astype(np.float32)}
    result = onnxq.quantize(model, None, "U8S8", data)
    assert result.summary.calibrated_tensors >= 1
    mm = next(n for n in result.model.graph.node if n.op_type == "MatMul")
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert producers[mm.input[0]] == "DequantizeLinear"  # a static int8 activation
    assert sqnr_db(run(model, data), run(result.model, data)) > 30


def test_a_loop_with_scalar_inputs_and_a_contrib_op_in_its_body():
    """A Loop (scalar trip count, condition and counter inputs) whose body holds a
    com.microsoft Gelu: its outputs are not given the first carried value's type (its
    variadic parameter is heterogeneous; the float output became int64 and onnxruntime
    refused the model), and scalar inputs are fed a sample at a time (they cannot stack)."""
    from onnxq.graph.load import load_model

    body = oh.make_graph(
        [oh.make_node("Identity", ["cond_in"], ["cond_out"]), oh.make_node("Add", ["cnt_in", "one"], ["cnt_out"]),
         oh.make_node("Gelu", ["x_in"], ["x_out"], domain="com.microsoft")], "body",
        [oh.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         oh.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         oh.make_tensor_value_info("cnt_in", onnx.TensorProto.INT64, []),
         oh.make_tensor_value_info("x_in", onnx.TensorProto.FLOAT, None)],
        [oh.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []), oh.make_empty_tensor_value_info("cnt_out"),
         oh.make_empty_tensor_value_info("x_out")], [oh.make_tensor("one", onnx.TensorProto.INT64, [], [1])])
    w = nh.from_array((RNG.standard_normal((4, 3)) * 0.5).astype(np.float32), "w")
    graph = oh.make_graph(
        [oh.make_node("Loop", ["M", "c", "cnt0", "x"], ["cnt", "h"], body=body),
         oh.make_node("MatMul", ["h", "w"], ["y0"]), oh.make_node("MatMul", ["x", "w"], ["y1"]),
         oh.make_node("Add", ["y0", "y1"], ["y"]), oh.make_node("Identity", ["cnt"], ["cnt_o"])], "loop",
        [oh.make_tensor_value_info("M", onnx.TensorProto.INT64, []),
         oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
         oh.make_tensor_value_info("cnt0", onnx.TensorProto.INT64, []),
         oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor_value_info("cnt_o", onnx.TensorProto.INT64, []),
         oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])], [w])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    loaded, _ = load_model(model)
    loop = next(n for n in loaded.graph if n.op_type == "Loop")
    assert loop.outputs[1].dtype in (None, ir.DataType.FLOAT)
    feeds = [{"M": np.array(2, np.int64), "c": np.array(True), "cnt0": np.array(0, np.int64),
              "x": RNG.standard_normal((2, 4)).astype(np.float32)} for _ in range(4)]
    result = onnxq.quantize(model, None, None, feeds)
    assert result.summary.calibrated_tensors >= 1
    for feed in feeds:
        assert run(result.model, feed, 0) == run(model, feed, 0) == 2  # the counter, exact
        assert sqnr_db(run(model, feed, 1), run(result.model, feed, 1)) > 25
