"""`onnxq analyze`: per-tensor and per-layer error, checked against numpy recomputations."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, random_feeds, stack_feeds

from onnxq.analyze import analyze_models, format_analysis
from onnxq.analyze.accumulate import ErrorStats, RangeStats
from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.config.presets import get_preset
from onnxq.errors import ModelError
from onnxq.quantize import quantize


def deep_chain(layers: int = 10, channels: int = 8, seed: int = 0, classes: int | None = None) -> onnx.ModelProto:
    """Conv+Relu x `layers` on [N,4,8,8], then a Conv to 4 channels (or, with `classes`,
    global pooling and a Gemm to class scores)."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 4, 8, 8])
    x = b.relu(b.conv(x, 4, channels))
    for _ in range(layers - 1):
        x = b.relu(b.conv(x, channels, channels))
    if classes is None:
        return b.build([b.conv(x, channels, 4)], name="deep_chain")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])])
    return b.build([b.gemm(x, channels, classes)], name="deep_classifier")


def _data(model: onnx.ModelProto, n: int, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    data = stack_feeds(random_feeds(model, n, seed))
    return {k: (v * scale).astype(v.dtype) for k, v in data.items()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    model = deep_chain()
    path = tmp_path_factory.mktemp("analyze") / "chain.onnx"
    onnx.save(model, path)
    quant = path.with_name("chain.q.onnx")
    quantize(path, quant, "U8S8", _data(model, 32, 0), progress=False)
    return path, quant, model


def test_error_stats_match_numpy():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    test = ref + 0.01 * rng.standard_normal(ref.shape).astype(np.float32)
    stats = ErrorStats()
    for i in range(0, 6, 2):  # streaming in batches gives the whole-array figures
        stats.update(ref[i:i + 2], test[i:i + 2])
    expected = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - test).astype(np.float64) ** 2))
    assert stats.sqnr_db == pytest.approx(expected, abs=1e-3)
    cos = np.sum(ref * test) / np.linalg.norm(ref) / np.linalg.norm(test)
    assert stats.cosine == pytest.approx(cos, abs=1e-6)
    assert stats.max_abs == pytest.approx(np.max(np.abs(ref - test)), rel=1e-6)
    per_channel = [np.sum((ref - test)[:, c] ** 2) / np.sum(ref[:, c] ** 2) for c in range(3)]
    assert stats.channel_relative_noise == pytest.approx(np.mean(per_channel), rel=1e-4)
    same = ErrorStats()
    same.update(ref, ref)
    assert math.isinf(same.sqnr_db)


def test_error_stats_of_masking_constants_do_not_overflow():
    """An attention mask's float-min entries square beyond float32: the sums go to float64
    instead of warning and returning inf or nan."""
    ref = np.array([[0.0, -3.4e38, 1.0], [2.0, -3.4e38, -1.0]], np.float32)
    test = ref.copy()
    test[:, 0] += 0.5
    stats = ErrorStats()
    with np.errstate(all="raise"):
        stats.update(ref, test)
    expected = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / 0.5)
    assert stats.sqnr_db == pytest.approx(expected, abs=1e-6)
    assert np.isfinite(stats.channel_signal).all() and np.isfinite(stats.channel_relative_noise)
    apart = ErrorStats()  # the difference itself passes float32's range
    with np.errstate(all="raise"):
        apart.update(np.array([[3e38, 1.0]], np.float32), np.array([[-3e38, 1.0]], np.float32))
    assert apart.sqnr_db == pytest.approx(10 * np.log10((9e76 + 1) / 36e76), abs=1e-6)
    assert apart.max_abs == pytest.approx(6e38, rel=1e-6)


def test_range_stats_count_clipped_values():
    stats = RangeStats(-1.0, 1.0)
    stats.update(np.array([-2.0, -0.5, 0.0, 0.5, 1.5], np.float32))
    assert stats.saturation == pytest.approx(2 / 5)
    assert (stats.used_min, stats.used_max) == (-2.0, 1.5)
    assert stats.counts.sum() == 5
    # on a uniform grid of step 0.1, values within half a step past an end round to it with
    # no more error than any value inside: no clip (a SiLU's minimum had read as 10% clipped)
    grid = RangeStats(-1.0, 1.0, step=0.1)
    grid.update(np.array([-1.04, -0.5, 1.049, 1.06], np.float32))
    assert grid.saturation == pytest.approx(1 / 4)


def test_tensor_figures_match_a_direct_comparison(chain):
    path, quant, model = chain
    data = _data(model, 16, 1)
    analysis = analyze_models(path, quant, data, progress=False)
    assert analysis.samples == 16
    # Recompute one tensor's error directly: float tensor vs the DQ output the quantized
    # model's consumers read, both exposed by onnxruntime.
    worst = analysis.tensors[0]
    q = onnx.load(quant)
    dq = next(n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"
              and n.input[0] == next(m.output[0] for m in q.graph.node
                                     if m.op_type == "QuantizeLinear" and m.input[0] == worst.name))
    ref = _exposed(model, worst.name, data)
    test = _exposed(q, dq, data)
    expected = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - test).astype(np.float64) ** 2))
    assert worst.sqnr_db == pytest.approx(expected, abs=0.05)
    assert worst.used_range == pytest.approx((float(ref.min()), float(ref.max())), rel=1e-5)
    # Worst first, and sorted.
    assert [t.sqnr_db for t in analysis.tensors] == sorted(t.sqnr_db for t in analysis.tensors)


def _exposed(model: onnx.ModelProto, name: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run([name], feeds)[0]


def test_layers_alone_lose_less_than_with_their_prefix(chain):
    path, quant, model = chain
    analysis = analyze_models(path, quant, _data(model, 16, 2), progress=False)
    convs = [r for r in analysis.layers if r.op_type == "Conv"]
    assert len(convs) == 11
    # Deep in the chain the error of everything before a layer adds up: the layer alone
    # is clearly better than the layer with its prefix quantized too.
    deeper = [r for r in convs if r.prefix_sqnr_db is not None and r.prefix_sqnr_db < r.own_sqnr_db - 1]
    assert len(deeper) >= 5
    assert all(r.own_sqnr_db > 25 for r in convs)  # uint8/int8 per channel: each layer alone is fine
    assert analysis.outputs[0].sqnr_db > 15


def test_models_given_the_wrong_way_round_are_one_line(chain, tmp_path, capsys):
    """Quantized first, float second gave "0 of 0" layers and nothing to say why, then empty
    tables with a note and exit 0; a float model as the quantized one, or one model twice,
    gave empty tables (or SQNR inf from compare) with exit 0."""
    path, quant, model = chain
    with pytest.raises(ModelError, match="the arguments look swapped"):
        analyze_models(quant, path, _data(model, 4, 3), progress=False)
    with pytest.raises(ModelError, match="no QuantizeLinear/DequantizeLinear"):
        analyze_models(path, path, _data(model, 4, 3), progress=False)
    assert not any("taken as the float one" in n for n in analyze_models(path, quant, _data(model, 4, 3),
                                                                          progress=False).notes)
    np.savez(tmp_path / "d.npz", **_data(model, 4, 3))
    for command in ("analyze", "compare"):
        assert main([command, str(path), str(path), "--data", str(tmp_path / "d.npz")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "are the same model" in err


def test_the_layer_made_coarse_ranks_first(tmp_path):
    model = deep_chain(seed=3)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    coarse = next(n.name for n in model.graph.node if n.op_type == "Conv" and n.name != model.graph.node[0].name)
    config = compose_config("U8S8", None, {"layer_quant_config": {coarse: {"weight": {"bits": 3}}}})
    quantize(path, tmp_path / "q.onnx", config, _data(model, 32, 0), progress=False)
    analysis = analyze_models(path, tmp_path / "q.onnx", _data(model, 16, 5), progress=False)
    assert analysis.layers[0].name == coarse
    assert analysis.layers[0].own_sqnr_db < min(r.own_sqnr_db for r in analysis.layers[1:] if r.op_type == "Conv")


def test_out_of_range_data_shows_saturation(chain):
    path, quant, model = chain
    analysis = analyze_models(path, quant, _data(model, 8, 3, scale=4.0), progress=False)
    clipped = [t for t in analysis.tensors if t.saturation > 0]
    assert clipped, "inputs 4x the calibration range must clip somewhere"
    for t in clipped:
        assert t.used_range[1] > t.calibrated_range[1] or t.used_range[0] < t.calibrated_range[0]


def test_json_is_strict_and_complete(chain, tmp_path):
    path, quant, model = chain
    analysis = analyze_models(path, quant, _data(model, 4, 4), progress=False)
    text = analysis.to_json(tmp_path / "a.json")
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert len(data["layers"]) == len(analysis.layers)
    assert set(data["tensors"][0]) >= {"name", "sqnr_db", "cosine", "saturation", "used_range",
                                       "calibrated_range", "histogram"}
    assert "worst first" in format_analysis(analysis)


def test_cli_analyze_writes_json_and_rejects_missing_models(chain, tmp_path, capsys):
    path, quant, model = chain
    np.savez(tmp_path / "d.npz", x=_data(model, 4, 6)["x"], labels=np.zeros(4, np.int64))
    out = tmp_path / "a.json"
    assert main(["analyze", str(path), str(quant), "--data", str(tmp_path / "d.npz"), "--labels", "labels",
                 "--json", str(out), "--quiet", "--top", "3"]) == 0
    assert json.loads(out.read_text())["samples"] == 4
    assert "layers, most sensitive first" in capsys.readouterr().out
    assert main(["analyze", str(path), str(tmp_path / "nope.onnx"), "--data", str(tmp_path / "d.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err


def test_a_tensor_a_clip_reads_is_measured_after_the_clip(tmp_path):
    """Float8 layouts quantize a Conv output and run its Clip(0, 6) after the DQ, with the
    grid fitted to the Clip's range: values beyond 6 never reach the model, so they are
    neither clipping nor error (they were reported as 50% clipped)."""
    b = GraphBuilder(2)
    x = b.input("x", ["N", 4, 8, 8])
    lo, hi = b.const("lo", np.array(0.0, np.float32)), b.const("hi", np.array(6.0, np.float32))
    y = b.node("Clip", [b.conv(x, 4, 8), lo, hi])
    model = b.build([b.conv(y, 8, 4)], name="conv_clip")
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    quant = tmp_path / "q.onnx"
    data = _data(model, 16, 0, scale=20.0)  # conv outputs far beyond 6
    config = get_preset("FP8_E4M3")
    config.edge_input = None  # the Clip's input is the last layer's: quantized
    quantize(path, quant, config, data, progress=False)
    q = onnx.load(quant)
    clip = next(n for n in q.graph.node if n.op_type == "Clip")
    dq = next(n for n in q.graph.node if n.output[0] == clip.input[0])
    if dq.op_type == "Add":  # float8 centring puts the channel offset back after the DQ
        dq = next(n for n in q.graph.node if n.output[0] == dq.input[0])
    assert dq.op_type == "DequantizeLinear"  # the layout this test is about
    quantizer = next(n for n in q.graph.node if n.op_type == "QuantizeLinear" and n.output[0] == dq.input[0])
    centre = next((n for n in q.graph.node if n.output[0] == quantizer.input[0] and n.op_type == "Sub"), None)
    conv_out = (centre or quantizer).input[0]
    analysis = analyze_models(path, quant, data, progress=False)
    report = next(t for t in analysis.tensors if t.name == conv_out)
    assert report.saturation == 0.0
    assert report.used_range[1] <= 6.0 + 1e-6 and report.sqnr_db > 20
    # The Conv whose bias the layout moved into an Add is measured with it, after the Clip.
    conv = next(n.name for n in q.graph.node if n.op_type == "Conv")
    layer = next(r for r in analysis.layers if r.name == conv)
    assert layer.own_sqnr_db > 20 and not any("not isolated" in n for n in analysis.notes)


def test_a_model_equalized_against_its_float_model_is_flagged(chain, tmp_path):
    """CLE rescales channels: the quantized model's tensors then differ from the float
    model's by those factors, and the analysis says so above its tables (the weights show
    it; rounding cannot scale a whole channel by 2x or more). A plain model is not flagged."""
    path, plain, original = chain
    model = onnx.ModelProto()
    model.CopyFrom(original)
    rng = np.random.default_rng(4)
    for init in model.graph.initializer:  # channels of very different ranges: CLE has work to do
        w = onnx.numpy_helper.to_array(init)
        if w.ndim == 4:
            w = w * rng.choice([0.05, 1.0, 20.0], size=(w.shape[0], 1, 1, 1)).astype(w.dtype)
            init.CopyFrom(onnx.numpy_helper.from_array(w, init.name))
    uneven = tmp_path / "uneven.onnx"
    onnx.save(model, uneven)
    config = compose_config("U8S8", None, {"pre_quant_opt_config": [{"name": "cle"}]})
    quantize(uneven, tmp_path / "cle.onnx", config, _data(model, 32, 0), progress=False)
    flagged = analyze_models(uneven, tmp_path / "cle.onnx", _data(model, 8, 5), progress=False)
    assert any("rescaled per channel" in n for n in flagged.notes)
    assert format_analysis(flagged).splitlines()[1].startswith("warning: ")
    clean = analyze_models(path, plain, _data(model, 8, 5), progress=False)
    assert not any("rescaled per channel" in n for n in clean.notes)


def test_top1_agreement_is_for_class_scores_not_embeddings():
    """analyze printed a 'top-1 agreement' for MiniLM's sentence embedding (58-63%), which
    compare leaves out: unit-length rows with negative entries are embeddings."""
    from onnxq.analyze.accumulate import AgreementStats

    rng = np.random.default_rng(0)
    scores = rng.standard_normal((8, 10)).astype(np.float32)
    stats = AgreementStats()
    stats.update(scores, scores + 0.01)
    assert stats.rate == 1.0
    embeddings = scores / np.linalg.norm(scores, axis=1, keepdims=True)
    stats = AgreementStats()
    stats.update(embeddings, embeddings + 0.01)
    assert stats.rate is None


def test_long_names_print_whole_up_to_a_width():
    """Layer and tensor names are pasted into --exclude: a name up to 100 characters prints
    whole (cut from the left at 40, MiniLM's rows of different layers printed alike)."""
    from onnxq.analyze.analysis import Analysis, LayerReport

    long = "/bert/encoder/layer.3/intermediate/intermediate_act_fn/Mul_1"
    fields = {f.name: 0.0 for f in dataclasses.fields(LayerReport)}
    fields.update(name=long, op_type="Mul")
    analysis = Analysis(**{f.name: ([] if f.name in ("outputs", "tensors", "notes") else
                                    [LayerReport(**fields)] if f.name == "layers" else 1 if f.name == "samples"
                                    else "x") for f in dataclasses.fields(Analysis)})
    assert long in format_analysis(analysis)


def _two_matmuls() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    nodes = [onnx.helper.make_node("MatMul", ["x", "w1"], ["a"], name="fc1"),
             onnx.helper.make_node("Relu", ["a"], ["r"], name="act"),
             onnx.helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    weights = [onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
               for n, s in (("w1", (256, 256)), ("w2", (256, 64)))]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 256])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 64])], weights)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model, {"x": rng.standard_normal((32, 256)).astype(np.float32)}


def test_weight_only_layers_are_measured_and_dynamic_ones_said():
    """MatMulNBits layers (W4_GROUP128) are measured alone and with their prefix like Q/DQ
    layers; dynamic ones (W8_DYNAMIC) are named in a note. Both gave empty tables with no
    word (new-user trial)."""
    model, data = _two_matmuls()
    q4 = quantize(model, None, "W4_GROUP128", data, progress=False).model
    a = analyze_models(model, q4, data)
    assert sorted((r.name, r.op_type) for r in a.layers) == [("fc1_MatMulNBits", "MatMulNBits"),
                                                            ("fc2_MatMulNBits", "MatMulNBits")]
    whole = a.outputs[0].sqnr_db
    by_name = {r.name: r for r in a.layers}
    assert all(whole < r.own_sqnr_db < whole + 10 for r in a.layers), ([r.own_sqnr_db for r in a.layers], whole)
    assert by_name["fc2_MatMulNBits"].prefix_sqnr_db == pytest.approx(whole, abs=0.05)  # the last: the whole model
    assert any("weight-only kernels" in n for n in a.notes)
    q8 = quantize(model, None, "W8_DYNAMIC", data, progress=False).model
    notes = analyze_models(model, q8, data).notes
    assert any(n.startswith("2 dynamically quantized layers (MatMulInteger") for n in notes), notes


def test_weight_only_layers_in_groups_give_the_same_figures():
    """One pass per layer (the smallest budget) or one for all: the same errors."""
    from onnxq.analyze.grouped import kernel_layers, measure_in_groups
    from onnxq.graph.load import read_model

    model, data = _two_matmuls()
    quant = read_model(quantize(model, None, "W4_GROUP128", data, progress=False).model)
    float_model = read_model(model)
    found = kernel_layers(quant)
    one, each = (measure_in_groups(float_model, quant, found, data, ["CPUExecutionProvider"], 8, None, budget)
                 for budget in (1 << 30, 1))
    assert (one.passes, each.passes) == (1, 2)
    for a, b in ((one.own, each.own), (one.prefix, each.prefix)):  # equal up to the kernels' summation order
        assert a.keys() == b.keys() and all(a[n].sqnr_db == pytest.approx(b[n].sqnr_db, abs=1e-3) for n in a)


def test_cli_analyze_with_labels_gives_top1_as_compare_does_and_says_what_the_ranking_ran_on(tmp_path, capsys):
    """`--labels` had only left the array out of the inputs (trust trial): analyze now gives
    both models' top-1 against the labels, the figures `onnxq compare` gives on the same
    samples, and the layer table says how many samples its ranking ran on."""
    from pathlib import Path

    models = Path(__file__).resolve().parent.parent / "models"
    quant = tmp_path / "q.onnx"
    quantize(str(models / "digits_cnn.onnx"), str(quant), None, str(models / "digits_calib.npz"), progress=False)
    args = [str(models / "digits_cnn.onnx"), str(quant), "--data", str(models / "digits_eval.npz"), "--labels",
            "labels", "--max-samples", "64", "--quiet"]
    assert main(["compare", *args]) == 0
    compared = capsys.readouterr().out
    assert main(["analyze", *args, "--top", "2"]) == 0
    analysed = capsys.readouterr().out
    line = next(x for x in analysed.splitlines() if "top-1 against the labels" in x)
    assert "on 64 samples: float" in line
    float_acc, quant_acc = (x.split("%")[0] for x in line.split("float ")[1].split("quantized "))
    assert f"{float_acc}%" in compared and f"{quant_acc}%" in compared, (line, compared)
    assert "first output on the first 32 samples with only that layer quantized" in analysed
    lines = analysed.splitlines()
    header = next(i for i, x in enumerate(lines) if x.lstrip().startswith("layer "))
    assert len({len(x) for x in lines[header:header + 3]}) == 1  # GlobalAveragePool's row in line with the rest
    np.savez(tmp_path / "e.npz", input=np.load(models / "digits_eval.npz")["input"][:8],
             labels=np.zeros(8, np.int64))
    assert main(["analyze", str(models / "digits_cnn.onnx"), str(quant), "--data", str(tmp_path / "e.npz"),
                 "--labels", "labels", "--quiet", "--top", "1"]) == 0
    assert "top-1 against the labels on 8 samples" in capsys.readouterr().out
