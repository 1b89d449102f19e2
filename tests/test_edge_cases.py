"""Edge cases a review of the calibration-statistics and float8-centring changes found:
each failed before its fix."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, conv_bn_relu, random_feeds, stack_feeds
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.analyze import analyze_models
from onnxq.analyze.qgraph import layers
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.graph.load import load_model


def _attention(seed: int = 0) -> onnx.ModelProto:
    """One attention head over a dynamic sequence: softmax(x Wq (x Wk)^T) x Wv."""
    rng = np.random.default_rng(seed)
    w = {n: numpy_helper.from_array((rng.standard_normal((8, 8)) / 3).astype(np.float32), n) for n in "qkv"}
    nodes = [helper.make_node("MatMul", ["x", n], [f"{n}_out"]) for n in "qkv"]
    nodes += [helper.make_node("Transpose", ["k_out"], ["kt"], perm=[0, 2, 1]),
              helper.make_node("MatMul", ["q_out", "kt"], ["scores"]),
              helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v_out"], ["y"])]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 8])], list(w.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _tokens(batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, length, 8)).astype(np.float32)}


def test_float8_model_runs_at_any_sequence_length():
    """Channel offsets are constants: no centring along an axis whose size varies (the
    attention probabilities' key axis), and calibration batches of different lengths
    (per-channel extremes of varying size) are fine."""
    model = _attention()
    result = onnxq.quantize(model, None, "FP8_E4M3", [_tokens(4, 6, 1), _tokens(4, 9, 2)])
    onnx.checker.check_model(result.model)
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for length in (3, 6, 11):
        feed = _tokens(2, length, 5)
        got, want = session.run(None, feed)[0], reference.run(None, feed)[0]
        assert got.shape == want.shape
        assert 10 * np.log10(np.sum(want ** 2) / np.sum((want - got) ** 2)) > 15


def test_a_channel_mean_of_a_rank1_tensor_keeps_its_channels():
    """Reduce* over no axis would reduce the channel axis too: rank-1 tensors are reduced
    in numpy, per channel."""
    b = GraphBuilder(3)
    x = b.input("x", [16])
    model_proto = b.build([b.node("Relu", [x])], name="flat")
    model, _ = load_model(model_proto)
    feeds = [{"x": np.random.default_rng(i).standard_normal(16).astype(np.float32)} for i in range(4)]
    stats = [Statistic("x", "mean", 0), Statistic("x", "max", 0)]
    found = collect(model, stats, feeds, CalibrationConfig(batch_size=1))
    assert found[stats[0]].shape == (16,) and found[stats[1]].shape == (16,)


def test_analyze_keeps_a_models_own_sub_before_a_quantizer():
    """A model's Sub of a constant before a QuantizeLinear is not float8 centring: analyze
    measures the Sub's output, not its input against the shifted grid."""
    b = GraphBuilder(4)
    x = b.input("x", ["N", 3, 8, 8])
    centred = b.node("Sub", [x, b.const("mean", np.full((1, 3, 1, 1), 0.5, np.float32))])
    model = b.build([b.conv(b.relu(b.conv(centred, 3, 8)), 8, 4)], name="sub_first")
    data = stack_feeds(random_feeds(model, 16, seed=1))
    quant = onnxq.quantize(model, None, "U8S8", data).model
    analysis = analyze_models(model, quant, data, progress=False)
    report = next(t for t in analysis.tensors if t.name == model.graph.node[0].output[0])
    assert report.sqnr_db > 30


def test_batchnorm_folding_is_not_taken_for_equalization():
    """Folding a BatchNormalization scales its Conv's rows like equalization does; analyze
    must not warn about rescaling for it."""
    model = conv_bn_relu()
    data = stack_feeds(random_feeds(model, 16, seed=2))
    quant = onnxq.quantize(model, None, "U8S8", data).model
    analysis = analyze_models(model, quant, data, progress=False)
    assert not any("rescaled per channel" in n for n in analysis.notes)


def _relu_cnn(factor: float) -> onnx.ModelProto:
    """Conv-Relu-Conv-Relu-pool-Gemm whose every activation is `factor` times the unit
    network's (a ReLU network with its first weights and every bias scaled by `factor`)."""
    b = GraphBuilder(4)
    x = b.input("x", ["N", 3, 12, 12])
    h = b.relu(b.conv(x, 3, 8))
    h = b.relu(b.conv(h, 8, 8))
    y = b.gemm(b.node("Flatten", [b.node("GlobalAveragePool", [h])]), 8, 10)
    model = b.build([y], name="tiny")
    first = model.graph.node[0].input[1]
    for init in model.graph.initializer:
        if init.name == first or "_b_" in init.name:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), init.name))
    return model


def test_a_network_whose_activations_vanish_quantizes_as_one_at_unit_scale():
    """A random-weight network can compute in tiny numbers (a freshly initialised
    EfficientNet's activations shrink to 1e-13 at its head). Quantization is
    scale-equivariant, so those keep the unit network's SQNR, down to 1e-30; a scale floor
    of 2^-40 zeroed every tensor under 2e-10 (0 dB, where onnxruntime's quantizer kept 21 dB)."""
    feeds = {"x": np.random.default_rng(5).standard_normal((16, 3, 12, 12)).astype(np.float32)}
    scores = []
    for factor in (1.0, 1e-13, 1e-30):
        model = _relu_cnn(factor)
        result = onnxq.quantize(model, None, None, feeds, progress=False)
        onnx.checker.check_model(result.model)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        got = ort.InferenceSession(result.model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.abs(want).max() > 1e-12 * factor
        scores.append(10 * np.log10(np.sum(want.astype(np.float64) ** 2) / np.sum((want - got).astype(np.float64) ** 2)))
    assert scores[0] > 25 and min(scores[1:]) > scores[0] - 1, scores


def test_a_relu6_of_tiny_values_survives_onnxruntimes_clip_fusion():
    """S8S8 (A16W8) keeps a ReLU6 (Clip 0..6) before a symmetric int8 (int16) QuantizeLinear. Under values
    of 1e-8 that grid's negative half lies within float32's epsilon of 0, and onnxruntime's
    Clip+QuantizeLinear fusion removed the Clip in a default session: 0.1 dB there, 34 dB
    with its optimisations off. The range is widened so the Clip stays, and a note says so."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.zeros(8, np.float32), "b2"),
             numpy_helper.from_array(np.array(0, np.float32), "lo"), numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph([
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], pads=[1, 1, 1, 1])],
        "relu6", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": (rng.normal(0, 1, (16, 3, 16, 16)) * 1e-8).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for preset in ("S8S8", "A16W8"):  # onnxruntime fuses 16-bit QuantizeLinear too (A16W8 read -0.0 dB)
        result = onnxq.quantize(model, None, preset, feeds, progress=False)
        got = ort.InferenceSession(result.model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        sqnr = 10 * np.log10(np.sum(want.astype(np.float64) ** 2) / np.sum((want - got).astype(np.float64) ** 2))
        assert sqnr > 20, (preset, sqnr)
        assert any("Clip outputs' ranges widened to keep their Clip" in n for n in result.summary.note_texts)
    at_unit = onnxq.quantize(model, None, "S8S8", {"x": feeds["x"] * np.float32(1e8)}, progress=False)
    assert not any("widened" in n for n in at_unit.summary.note_texts)


def _odd_rank_matmuls(seed: int = 13) -> onnx.ModelProto:
    """x [N, 16] -> MatMul with a vector weight [16] (-> [N]) and, from x reshaped to
    [N, 2, 4, 2] ... a batched weight [2, 4, 6]: y = concat of both, as float."""
    rng = np.random.default_rng(seed)
    w = {"vec": (rng.standard_normal(16) / 4).astype(np.float32),
         "batched": (rng.standard_normal((2, 4, 6)) / 2).astype(np.float32),
         "shape": np.array([-1, 2, 2, 4], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "vec"], ["v"], name="mm_vec"),
             helper.make_node("Unsqueeze", ["v", "one"], ["v1"]),
             helper.make_node("Reshape", ["x", "shape"], ["x4"]),
             helper.make_node("MatMul", ["x4", "batched"], ["b"], name="mm_batched"),  # [N, 2, 2, 6]
             helper.make_node("Flatten", ["b"], ["bf"]),
             helper.make_node("Concat", ["v1", "bf"], ["y"], axis=1)]
    inits = [numpy_helper.from_array(a, n) for n, a in w.items()] + [numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, "odd_rank", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 25])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("recipe", [{}, {"global_quant_config": {"weight": {"dtype": "int8", "qscheme": "per_group",
                                                                            "group_size": 4}}},
                                    {"target": "x86-avx2"}, {"quant_format": "qoperator"}, "W4_GROUP128"])
def test_matmul_weights_of_rank_other_than_2_run_per_tensor(recipe):
    """A MatMul weight that is a vector or a batch of matrices, scaled per channel (the
    default) or in blocks: onnxruntime loaded the model and then refused to run it (its
    integer MatMul takes per-column zero points of a rank-2 weight only; the blocks of a
    vector were written with one scale), the avx2 target raised, and each exited 0. Such
    weights are quantized per tensor, and the summary says so (new-user trial)."""
    model = _odd_rank_matmuls()
    feeds = [{"x": np.random.default_rng(i).standard_normal((8, 16)).astype(np.float32)} for i in range(4)]
    config = recipe if isinstance(recipe, str) else onnxq.compose_config(None, None, recipe)
    result = onnxq.quantize(model, None, config, feeds)
    onnx.checker.check_model(result.model, full_check=True)
    assert set(result.plan.coarser_weights) == {"mm_vec", "mm_batched"}
    assert any("2 weights quantized coarser than the config asks (2 per tensor: its weight is no matrix" in t
               for t in result.summary.note_texts), result.summary.note_texts
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    deployed = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(9).standard_normal((16, 16)).astype(np.float32)}
    want, got = reference.run(None, feed)[0], deployed.run(None, feed)[0]
    assert 10 * np.log10(np.sum(want ** 2) / np.sum((want - got) ** 2)) > 18


def test_blocks_of_a_one_input_channel_conv_are_per_channel():
    """int4 blocks of a Conv with one input channel per group (a depthwise layer, a
    grayscale first layer) held one weight each, with a float scale per weight: the layer
    larger than float, counted as quantized; an RGB first layer's held 3 (review). Below 8
    input channels per group they are per channel now, named in a note."""
    from helpers import depthwise
    model = depthwise()
    feeds = random_feeds(model, 8, 1)
    config = onnxq.compose_config(None, None, {"global_quant_config": {
        "weight": {"dtype": "int4", "qscheme": "per_group", "group_size": 4}}})
    result = onnxq.quantize(model, None, config, feeds)
    onnx.checker.check_model(result.model, full_check=True)
    depthwise_conv = next(n for n in result.model.graph.node if n.op_type == "Conv" and any(
        a.name == "group" and a.i == 8 for a in n.attribute))
    scales = {i.name: list(i.dims) for i in result.model.graph.initializer}
    weight_dq = next(n for n in result.model.graph.node if n.output[0] == depthwise_conv.input[1])
    assert scales[weight_dq.input[1]] == [8], scales[weight_dq.input[1]]
    first = next(n for n in result.model.graph.node if n.op_type == "Conv")  # 3 input channels: per channel too
    assert set(result.plan.coarser_weights) == {depthwise_conv.name, first.name}
    assert any("fewer than 8 input channels" in t for t in result.summary.note_texts)
    ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds[0])


def _loads_but_fails() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """A float MatMul with a vector weight, and its Q/DQ form with the vector scaled per
    element (what onnxq wrote before): onnxruntime loads the latter and refuses to run it
    (its fused integer MatMul takes no such zero point)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal(16) / 4).astype(np.float32)
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    opset = [helper.make_opsetid("", 17)]
    float_model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "f",
                                                      *io, [numpy_helper.from_array(w, "w")]), opset_imports=opset)
    scale = np.abs(w) / 127 + 1e-6
    inits = [numpy_helper.from_array(np.rint(w / scale).astype(np.int8), "wq"),
             numpy_helper.from_array(scale.astype(np.float32), "ws"), numpy_helper.from_array(np.zeros(16, np.int8), "wz"),
             numpy_helper.from_array(np.float32(0.05), "xs"), numpy_helper.from_array(np.uint8(128), "xz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    quant = helper.make_model(helper.make_graph(nodes, "q", *io, inits), opset_imports=opset)
    return float_model, quant


def test_compare_and_analyze_name_a_quantized_model_that_fails_to_run(tmp_path, capsys):
    """A quantized model that loads but fails in a kernel at run time gave `compare` and
    `analyze` a raw onnxruntime traceback, exit 1 (format trial): one line, exit 2, naming
    the node, and not blaming the data."""
    from onnxq.cli import main
    float_model, quant = _loads_but_fails()
    onnx.save(float_model, tmp_path / "f.onnx")
    onnx.save(quant, tmp_path / "q.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):  # the premise: it loads, then fails
        ort.InferenceSession(quant.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones((2, 16), np.float32)})
    for command in (["compare"], ["analyze", "--quiet"]):
        code = main([*command, str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "--data", str(tmp_path / "d.npz")])
        assert code == 2, command
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "quantized model fails in onnxruntime" in error and "'mm'" in error, error


def test_compare_analyze_and_search_take_batches_of_different_lengths(tmp_path):
    """Token data in files of different sequence lengths calibrates, but compare, analyze's
    output ranking and the accuracy search raised numpy's concatenation error (trust trial):
    compare and analyze join the outputs as rows and count samples as samples (no top-1 of
    rows); the search scores sqnr with each batch as one sample (speech trial; it had said it
    needed one shape)."""
    from onnxq.evaluate import compare_models
    model = _attention()
    folder = tmp_path / "varlen"
    folder.mkdir()
    np.savez(folder / "a.npz", **_tokens(6, 5, 1))
    np.savez(folder / "b.npz", **_tokens(6, 9, 2))
    onnx.save(model, tmp_path / "f.onnx")
    result = onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "U8S8", str(folder), progress=False)
    compared = compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), str(folder))
    assert compared.samples == 12 and compared.outputs[0].sqnr_db > 15
    analysis = analyze_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), str(folder), progress=False)
    assert analysis.layers and analysis.samples == 12
    assert compared.outputs[0].top1_agreement is None  # rows of tokens are no sample's class scores
    searched = onnxq.quantize(str(tmp_path / "f.onnx"), None, onnxq.compose_config(
        "U8S8", None, {"mixed_precision": {"target": "sqnr>=15", "eval_data": str(folder)}}), str(folder),
        progress=False)
    assert searched.summary.mixed_precision.met
    assert searched.summary.mixed_precision.base_score == pytest.approx(compared.outputs[0].sqnr_db, abs=0.01)
    assert result.model is not None


def test_empty_evaluation_data_is_one_line(tmp_path):
    """Data of 0 samples: compare raised an IndexError, analyze numpy's ValueError (trust trial)."""
    from onnxq.errors import CalibrationDataError
    from onnxq.evaluate import compare_models
    model = _attention()
    onnx.save(model, tmp_path / "f.onnx")
    onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "U8S8", [_tokens(4, 5, 1)], progress=False)
    np.savez(tmp_path / "none.npz", **_tokens(0, 5, 1))
    for run_it in (compare_models, analyze_models):
        with pytest.raises(CalibrationDataError, match="the evaluation data holds no sample; give at least one"):
            run_it(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), str(tmp_path / "none.npz"))


def test_analyze_refuses_a_quantized_model_without_the_float_models_outputs():
    """compare refused models whose outputs differ; analyze ranked the layers by an output
    the quantized model lacked (trust trial)."""
    from onnxq.errors import ModelError
    model = _attention()
    feeds = [_tokens(4, 5, i) for i in range(2)]
    quant = onnxq.quantize(model, None, "U8S8", feeds, progress=False).model
    wider = onnx.ModelProto()
    wider.CopyFrom(model)
    wider.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "S", "S"]))
    with pytest.raises(ModelError, match="the quantized model has no output 'scores'"):
        analyze_models(wider, quant, feeds, progress=False)


def test_labels_no_output_can_score_are_said_unused(tmp_path):
    """compare --labels on a model whose output is no class scores printed no accuracy and
    no word (trust trial)."""
    from onnxq.evaluate import compare_models, format_comparison
    model = _attention()
    onnx.save(model, tmp_path / "f.onnx")
    onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "U8S8", [_tokens(4, 5, 1)], progress=False)
    compared = compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), _tokens(6, 5, 2), np.zeros(6, int))
    assert compared.labels_unused and "labels given, but the first output is no class scores" in \
        format_comparison(compared)


def test_compare_scores_an_integer_output_by_equality():
    """An int64 class-index output got SQNR and cosine, figures of a signal (trust trial)."""
    from onnxq.evaluate import _metrics, format_comparison
    ref = {"pred": np.array([1, 2, 3, 4], np.int64), "y": np.ones((4, 3), np.float32)}
    test = {"pred": np.array([1, 2, 0, 4], np.int64), "y": np.ones((4, 3), np.float32)}
    compared = _metrics(ref, test, None, "deployed")
    assert compared.outputs[0].equal == 0.75
    assert "pred: 75.00% of its elements equal (not a float output)" in format_comparison(compared)


def test_inspect_counts_the_files_nodes_then_what_onnxq_reads(tmp_path, capsys):
    """inspect printed MiniLM's 365 nodes where the file holds 530 (its Constant nodes are
    folded on load) without saying so (trust trial), and a quantized model's Sum nodes as
    the Add onnxq reads them (encoder trial): the file's ops first, then what changed."""
    from onnxq.cli import main
    model = _attention()
    const = helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1.0, np.float32)))
    model.graph.node.insert(0, const)
    model.graph.node.append(helper.make_node("Mul", ["y", "one"], ["y2"]))
    model.graph.node.append(helper.make_node("Sum", ["y2", "y2"], ["y3"]))
    model.graph.output[0].name = "y3"
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["inspect", str(tmp_path / "m.onnx")]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("nodes:"))
    assert lines[at].startswith(f"nodes: {len(model.graph.node)} (") and "Sum 1" in lines[at] and "Constant 1" in lines[at]
    assert lines[at + 1].startswith(f"  as onnxq reads the graph: {len(model.graph.node) - 1} nodes (") \
        and "Constant 1 -> 0" in lines[at + 1], lines[at + 1]
    assert "Sum 1 -> 0" in lines[at + 1]


def test_review_fixes_of_the_second_round():
    """An integer output kept the kernel-gap warning on (NaN SQNR); QuantizeBias 0 was
    accepted and ignored; --preset none with --float-op-types Erf added the defaults; a
    MatMul with K = 4 lost its blocks to the convolutions' 8-channel rule (review)."""
    from onnxq.config.ort_options import OrtArguments, ort_overrides
    from onnxq.evaluate import _metrics
    ints = {"pred": np.array([1, 2, 3], np.int64), "p": np.eye(3, dtype=np.float32)}
    near = {"pred": np.array([1, 2, 0], np.int64), "p": np.eye(3, dtype=np.float32) + 0.01}
    deployed, reference = _metrics(ints, near, None, "deployed"), _metrics(ints, near, None, "reference")
    deployed.reference = reference
    assert deployed.kernel_gap() is None
    spec, _ = ort_overrides(OrtArguments(extra_options={"QuantizeBias": 0}), dynamic=False, model_ops=[("c", "Conv")])
    assert spec["global_quant_config"]["bias"] == {"dtype": "float32"}
    assert onnxq.compose_config("none", None, {"float_op_types": ["Erf"]}).float_op_types == ["Erf"]
    rng = np.random.default_rng(0)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])],
                              [numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = onnxq.compose_config(None, None, {"global_quant_config": {"weight": {
        "dtype": "int4", "qscheme": "per_group", "group_size": 4}}})
    result = onnxq.quantize(model, None, config, [{"x": rng.standard_normal((8, 4)).astype(np.float32)}],
                            progress=False)
    assert not result.plan.coarser_weights


@pytest.mark.parametrize("preset", ["U8S8", "S8S8", "A16W8", "XINT8", "FP8_E4M3"])
def test_analyze_lists_the_quantized_layers_only(preset):
    """A float node that only reads a quantized neighbour's output (MiniLM's GELU Divs) was
    listed and ranked, and keeping it float changed nothing (trust trial); a first filter
    dropped the residual Adds S8S8 quantizes through the Relu after them (review). The
    layers are the plan's quantized nodes, less the activations that run inside them."""
    from helpers import every_kernel, residual
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) / 3).astype(np.float32), n) for n in ("w1", "w2")]
    inits.append(numpy_helper.from_array(np.array(1.41, np.float32), "c"))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["h", "w2"], ["y1"], name="mm2"),
             helper.make_node("Div", ["h", "c"], ["y2"], name="div")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 8]) for n in ("y1", "y2")],
                              inits)
    divided = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for model in (divided, residual(), every_kernel(3)):
        feeds = random_feeds(model, 16, 1)
        config = onnxq.compose_config(preset, None, {"algo_config": []})
        result = onnxq.quantize(model, None, config, feeds, progress=False)
        listed = {layer.name for layer in layers(ir.from_proto(result.model))}
        plan = set(result.plan.quantized_nodes) | set(result.plan.lowered)
        assert listed <= plan, (preset, listed - plan)  # no float node
        assert plan - listed <= {n.name for n in model.graph.node if n.op_type in ("Relu", "Clip")}, plan - listed


def test_analyze_reads_another_tools_qdq_weights():
    """A Conv whose float weight goes through QuantizeLinear and DequantizeLinear in the
    graph and whose output stays float is a layer (review)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.float32(0.02), "s"), numpy_helper.from_array(np.int8(0), "z"),
             numpy_helper.from_array(np.float32(0.05), "xs"), numpy_helper.from_array(np.uint8(128), "xz")]
    nodes = [helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"]),
             helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"]),
             helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("Conv", ["xd", "wd"], ["y"], name="conv")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])], inits)
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [layer.name for layer in layers(model)] == ["conv"]


def test_an_unbatched_input_counts_samples_not_rows(tmp_path):
    """A torchvision-style detector takes one image [3, H, W], no batch axis: compare and
    analyze counted its 3 channel rows as 3 samples (detection trial: 4 images, "compared
    on 12 samples")."""
    from onnxq.analyze import analyze_models
    from onnxq.errors import CalibrationDataError
    from onnxq.evaluate import compare_models
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 8)) / 4).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Relu", ["y"], ["z"])], "unbatched",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 8])], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "f.onnx")
    images = {"x": rng.standard_normal((4, 3, 16)).astype(np.float32)}
    result = onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), None, images, progress=False)
    assert result.summary.calibration_samples == 4
    assert compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), images).samples == 4
    assert analyze_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), images, progress=False).samples == 4
    # a stack of images of another size names the axis, not "1 axis too many" with a shape that drops the channels
    with pytest.raises(CalibrationDataError, match=r"samples of shape \[3, 12\], expected float32 \[3,16\] "
                                                   r"\(axis 1 must be 16\)"):
        onnxq.quantize(str(tmp_path / "f.onnx"), None, None, {"x": images["x"][:, :, :12]}, progress=False)


def _detector(seed: int = 0, min_score: float = 0.0) -> onnx.ModelProto:
    """x [1, 50, 8] -> boxes and scores by MatMuls -> NonMaxSuppression -> the kept boxes
    [K, 4]: a detector's head, K set by the data (and by `min_score`)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 4)) / 3).astype(np.float32), "wb"),
             numpy_helper.from_array((rng.standard_normal((8, 1)) / 3).astype(np.float32), "ws"),
             numpy_helper.from_array(np.array([40 if min_score else 10], np.int64), "max_boxes"),
             numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
             numpy_helper.from_array(np.array([min_score], np.float32), "min_score"),
             numpy_helper.from_array(np.array([2], np.int64), "box_column"),
             numpy_helper.from_array(np.array([0], np.int64), "batch_axis")]
    nodes = [helper.make_node("MatMul", ["x", "wb"], ["boxes"], name="box_head"),
             helper.make_node("MatMul", ["x", "ws"], ["logits"], name="score_head"),
             helper.make_node("Sigmoid", ["logits"], ["prob"]),
             helper.make_node("Transpose", ["prob"], ["scores"], perm=[0, 2, 1]),
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_boxes", "iou", "min_score"], ["picked"]),
             helper.make_node("Gather", ["picked", "box_column"], ["which"], axis=1),
             helper.make_node("Squeeze", ["which"], ["index"]),
             helper.make_node("Squeeze", ["boxes", "batch_axis"], ["all_boxes"]),
             helper.make_node("Gather", ["all_boxes", "index"], ["kept_boxes"], axis=0)]
    graph = helper.make_graph(nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 50, 8])],
                              [helper.make_tensor_value_info("kept_boxes", TensorProto.FLOAT, ["kept", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_outputs_after_non_max_suppression_are_not_judged_element_by_element(tmp_path):
    """A detector's boxes after NonMaxSuppression differ row by row where near-equal scores
    swap, with the same picks: the check warned 'far from the float model' on every
    detector (SSDlite in float16, whose picks equal float's, at 7.1 dB). Its figures now
    say what they are, and no warning reads them; compare says so too."""
    from onnxq.evaluate import compare_models, format_comparison
    from onnxq.graph.selection import selected_outputs
    onnx.save(_detector(), tmp_path / "f.onnx")
    assert selected_outputs(ir.from_proto(_detector()).graph) == {"kept_boxes": "NonMaxSuppression"}
    data = {"x": np.random.default_rng(1).standard_normal((8, 1, 50, 8)).astype(np.float32)}
    result = onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), None, data, progress=False)
    fidelity = result.summary.fidelity
    assert fidelity.follows == "NonMaxSuppression" and fidelity.top1_agreement is None
    assert fidelity.warning() is None and "the rows a NonMaxSuppression picks and orders" in fidelity.line()
    compared = compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), data)
    assert compared.outputs[0].follows == "NonMaxSuppression" and compared.outputs[0].top1_agreement is None
    assert "do not measure the picks" in format_comparison(compared)


def test_picks_of_other_counts_are_counted_not_compared(tmp_path):
    """Where the two models pick different numbers of boxes, compare had said 'compare a
    quantized model with the float model it came from', and the accuracy search raised
    numpy's broadcasting error: compare now gives each model's count, and a sqnr target on
    such an output is refused in one line (score the picks with evaluate=)."""
    from onnxq.errors import ConfigError
    from onnxq.evaluate import compare_models, format_comparison
    onnx.save(_detector(min_score=0.5), tmp_path / "f.onnx")
    onnx.save(_detector(min_score=0.6), tmp_path / "fewer.onnx")  # fewer picks, as a quantized model may make
    data = {"x": np.random.default_rng(1).standard_normal((8, 1, 50, 8)).astype(np.float32)}
    compared = compare_models(str(tmp_path / "f.onnx"), str(tmp_path / "fewer.onnx"), data)
    floats, fewer = compared.outputs[0].rows_differ
    assert floats > fewer > 0
    assert f"picked {floats} rows in float and {fewer} quantized" in format_comparison(compared)
    onnxq.quantize(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "W4A8", data, progress=False)
    analysis = analyze_models(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), data, progress=False)
    assert any("'kept_boxes' holds the rows a NonMaxSuppression picks" in note for note in analysis.notes)
    assert any("ranked by their channels' noise, not by the output" in note for note in analysis.notes)
    with pytest.raises(ConfigError, match="scores the model's first float output, 'kept_boxes', whose rows a "
                                          "NonMaxSuppression picks"):
        onnxq.quantize(str(tmp_path / "f.onnx"), None, {"mixed_precision": {"target": "sqnr>=30"}}, data,
                       progress=False)
