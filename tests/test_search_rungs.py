"""Algorithm rungs of the accuracy-target ladder: recipe changes tried before any layer is
raised, kept only where they improve the score, and said in the summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.config.spec import ALGORITHM_RUNGS, DEFAULT_LADDER, PRECISION_RUNGS
from onnxq.pipeline.run import run_pipeline
from onnxq.search import rungs as R
from onnxq.search.climb import climb_algorithms
from onnxq.search.target import Scored

MODELS = Path(__file__).resolve().parent.parent / "models"


def test_rung_table_matches_the_config_names():
    assert tuple(R.ALGORITHM_RUNGS) == ALGORITHM_RUNGS
    assert R.precision_rungs(list(DEFAULT_LADDER)) == ["int8", "int16", "float"]
    assert [r.name for r in R.algorithm_rungs(["int16", "cle", "per_channel"])] == ["cle", "per_channel"]
    assert not set(ALGORITHM_RUNGS) & set(PRECISION_RUNGS)


def test_skip_reasons_and_applied_recipes():
    per_tensor = compose_config("U8S8", None, {"global_quant_config": {"weight": {"qscheme": "per_tensor"}},
                                               "pre_quant_opt_config": [{"name": "cle"}],
                                               "algo_config": [{"name": "adaquant"}]})
    rungs, convs = R.ALGORITHM_RUNGS, {"Conv", "Relu"}
    assert R.skip_reason(rungs["cle"], per_tensor, convs) == "already in the recipe"
    assert "adaquant already rounds" in R.skip_reason(rungs["adaround"], per_tensor, convs)
    # The target adds bias correction for Conv/Gemm only: a MatMul model still gets the rung.
    assert "target adds it" in R.skip_reason(rungs["bias_correction"], per_tensor, convs)
    assert R.skip_reason(rungs["bias_correction"], per_tensor, {"MatMul", "Add"}) is None
    assert "no quantized Conv" in R.skip_reason(rungs["bias_correction"], per_tensor, {"Add"})
    # per-tensor weights asked for are kept (a deployment's choice); per-tensor by default
    # (no qscheme named) are what the rung is for
    assert R.skip_reason(rungs["per_channel"], per_tensor, convs) == ("the recipe asks for per-tensor weights "
                                                                     "(qscheme: per_tensor)")
    unnamed = compose_config("U8S8", None, {"global_quant_config": {"weight": {"qscheme": None}}})
    assert R.skip_reason(rungs["per_channel"], unnamed, convs) is None
    raised = R.with_rung(unnamed, rungs["per_channel"])
    assert raised.global_quant_config.weight.qscheme.value == "per_channel"
    assert R.skip_reason(rungs["per_channel"], raised, convs) == "the weights are not per-tensor"
    fp16 = compose_config("FP16", None, {})
    assert R.skip_reason(rungs["per_channel"], fp16, {"Conv"}) == "the weights are not per-tensor"
    smooth = R.with_rung(per_tensor, rungs["smoothquant"])
    assert [p["name"] for p in smooth.pre_quant_opt_config] == ["cle", "smoothquant"]
    assert per_tensor.pre_quant_opt_config[-1]["name"] == "cle"  # the input config is not changed


def test_cli_target_met_by_an_algorithm_rung_raises_no_layer(tmp_path, capsys):
    """4-bit per-tensor weights cost the digits classifier top-1; CLE alone brings it back
    within 0.3 points of float, so no layer is raised and every Conv stays quantized."""
    args = ["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"),
            "--calib-data", str(MODELS / "digits_calib.npz"), "--per-tensor", "--weight-bits", "4",
            "--eval-data", str(MODELS / "digits_eval.npz"),
            "--accuracy-target", "float-0.3", "--metric", "top1", "--save-config", str(tmp_path / "out.yaml")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "accuracy target top1>=float-0.3: met" in out and "promoted:" not in out
    assert "rung bias_correction: not tried: the target adds it" in out and "rung cle:" in out and "(meets the target), kept" in out
    saved = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert [p["name"] for p in saved["pre_quant_opt_config"]] == ["cle"] and not saved["layer_quant_config"]
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    convs = [n for n in quantized.graph.node if n.op_type == "Conv"]
    assert convs and all(_producer(quantized, n.input[1]) == "DequantizeLinear"
                         for n in convs)  # every Conv reads a dequantized weight: none left float
    # The saved config reproduces the model without searching.
    assert main(["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "again.onnx"), "--calib-data",
                 str(MODELS / "digits_calib.npz"), "--config", str(tmp_path / "out.yaml"), "--quiet"]) == 0
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "q.onnx").read_bytes()
    with np.load(MODELS / "digits_eval.npz") as npz:
        x, y = npz["input"], npz["labels"]
    session = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    float_session = ort.InferenceSession(str(MODELS / "digits_cnn.onnx"), providers=["CPUExecutionProvider"])
    top1 = [100 * np.mean(s.run(None, {"input": x})[0].argmax(1) == y) for s in (session, float_session)]
    assert top1[0] >= top1[1] - 0.3


def _producer(model: onnx.ModelProto, name: str) -> str:
    return next((n.op_type for n in model.graph.node if name in n.output), "")


def _conv_weight_scales(path: Path) -> list[int]:
    """The number of scales of each Conv's weight DequantizeLinear (1: per-tensor)."""
    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [int(np.prod(inits[dq[n.input[1]].input[1]].dims)) for n in model.graph.node if n.op_type == "Conv"]


def test_per_tensor_weights_asked_for_are_kept_and_by_default_are_tried(tmp_path, capsys):
    """--per-tensor (a deployment's choice: an integer-only NPU) is not undone by the
    per_channel rung, even where per-channel would score better and the target is missed;
    weights per-tensor only because the recipe names no qscheme get the rung."""
    common = ["--calib-data", str(MODELS / "digits_calib.npz"), "--weight-bits", "4", "--eval-data",
              str(MODELS / "digits_eval.npz"), "--accuracy-target", "sqnr>=200", "--ladder", "per_channel"]
    asked = tmp_path / "asked.onnx"
    assert main(["quantize", str(MODELS / "digits_cnn.onnx"), str(asked), "--per-tensor", *common]) == 0
    out = capsys.readouterr().out
    assert "rung per_channel: not tried: the recipe asks for per-tensor weights (qscheme: per_tensor)" in out
    assert set(_conv_weight_scales(asked)) == {1}

    (tmp_path / "unnamed.yaml").write_text("global_quant_config: {weight: {qscheme: null}}\n")
    unnamed = tmp_path / "unnamed.onnx"
    assert main(["quantize", str(MODELS / "digits_cnn.onnx"), str(unnamed), "--config",
                 str(tmp_path / "unnamed.yaml"), *common]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "rung per_channel:" in x)
    assert ", kept," in line, line  # per-channel 4-bit weights beat per-tensor ones beyond the noise
    assert max(_conv_weight_scales(unnamed)) > 1


def test_a_rung_that_does_not_help_is_dropped():
    """The climb keeps a rung only where the score improves, and stops once the target is met."""
    config = compose_config("U8S8", None, {"global_quant_config": {"weight": {"qscheme": None}}})  # per-tensor
    data = str(MODELS / "digits_calib.npz")
    start = run_pipeline(str(MODELS / "digits_cnn.onnx"), None, config, data, False, keep_state=True)
    scores = iter([Scored(1.0), Scored(3.0), Scored(9.0)])  # cle: worse than the start (2.0), per_channel: better
    climb = climb_algorithms(str(MODELS / "digits_cnn.onnx"), config, data, False,
                             R.algorithm_rungs(["cle", "per_channel", "adaround"]), start, Scored(2.0),
                             lambda _model: next(scores), True, lambda s: s >= 3.0)
    assert [(t.rung, t.score, t.kept) for t in climb.trials] == [("cle", 1.0, False), ("per_channel", 3.0, True)]
    assert climb.score == 3.0 and not climb.config.pre_quant_opt_config
    assert climb.config.global_quant_config.weight.qscheme.value == "per_channel"
    assert "no better" in climb.trials[0].why and climb.trials[1].met


def _digits_target(tmp_path, **mixed):
    config = compose_config("U8S8", None, {"global_quant_config": {"weight": {"qscheme": "per_tensor", "bits": 4}},
                                           "mixed_precision": {"eval_data": str(MODELS / "digits_eval.npz"),
                                                               **mixed}})
    return config


def test_latency_is_measured_once_on_the_returned_model(tmp_path, monkeypatch):
    import onnxq
    import onnxq.pipeline.run as run_module

    calls = []
    real = run_module.measure_latency

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "measure_latency", counted)  # every run and the search time through it
    config = _digits_target(tmp_path, target="top1>=float-0.3")
    config.calibration.measure_latency = True
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            str(MODELS / "digits_calib.npz"), progress=False)
    mp = result.summary.mixed_precision
    assert mp.met and [t["rung"] for t in mp.rungs if t["kept"]] == ["cle"]  # three models quantized
    assert len(calls) == 1 and result.summary.latency is not None
    assert [t.batch for t in result.summary.latency.timings] == [1, 8]


def test_a_ladder_of_algorithm_rungs_alone_says_so_when_not_met(tmp_path):
    import onnxq

    config = _digits_target(tmp_path, target="sqnr>=200", ladder=["cle", "per_channel"])
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            str(MODELS / "digits_calib.npz"), progress=False)
    mp = result.summary.mixed_precision
    assert not mp.met and not mp.promotions and mp.ranked_layers == 0
    assert any("the ladder has no precision rung" in n for n in result.summary.note_texts)
    onnx.checker.check_model(str(tmp_path / "q.onnx"))


def test_a_recipe_with_nothing_to_raise_says_so(tmp_path):
    """FP16 on the CPU keeps every node's arithmetic in float32 (weights stored in float16):
    the rungs that rescale quantized layers are not tried, and an unmet target says that no
    layer could be raised rather than that every one was."""
    import onnxq

    config = compose_config("FP16", None, {"mixed_precision": {"eval_data": str(MODELS / "digits_eval.npz"),
                                                               "target": "sqnr>=200"}})
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            str(MODELS / "digits_calib.npz"), progress=False)
    mp = result.summary.mixed_precision
    assert not mp.met and mp.ranked_layers == 0 and not mp.promotions
    skipped = {r["rung"]: r["why"] for r in mp.rungs if r["score"] is None}
    assert skipped["cle"] == "no quantized Conv or Gemm" and skipped["smoothquant"] == "no quantized MatMul or Gemm"
    assert any("no layer could be raised" in n for n in result.summary.note_texts)
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    assert ort.InferenceSession(str(tmp_path / "q.onnx")).get_outputs()[0].name == "logits"


def _reshaped_chain(layers: int = 6) -> onnx.ModelProto:
    """MatMuls [N, 16] with a Reshape -> Transpose -> Reshape between each two: raising a
    MatMul to float leaves the data movement after it a tensor of its own to calibrate."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([-1, 4, 4], np.int64), "s3"),
             numpy_helper.from_array(np.array([-1, 16], np.int64), "s2")]
    nodes, prev = [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Reshape", [f"m{i}", "s3"], [f"r{i}"]),
                  helper.make_node("Transpose", [f"r{i}"], [f"t{i}"], perm=[0, 2, 1]),
                  helper.make_node("Reshape", [f"t{i}", "s2"], [f"b{i}"])]
        prev = f"b{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_tensors_a_trial_needs_anew_are_calibrated_in_one_pass(monkeypatch):
    """Each trial that raised a layer to float asked for the tensor after it, and each such
    ask was a calibration pass over the data (CoaT-lite: 60 passes, 238 of its search's 850
    s): the first ask now calibrates every float tensor a trial could need (min/max,
    reduced inside the session), and the search's result is the same."""
    import onnxq.pipeline.result as result_module

    passes: list[int] = []
    observe = result_module.observe
    monkeypatch.setattr(result_module, "observe", lambda *a, **k: (passes.append(len(a[1])), observe(*a, **k))[1])
    data = {"x": np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)}
    model = _reshaped_chain()
    config_of_target = {"mixed_precision": {"target": "sqnr>=40", "ladder": ["float"]}}
    result = onnxq.quantize(model, None, config_of_target, data, progress=False)
    search = result.summary.mixed_precision
    assert len(passes) == 1  # 10 passes of one tensor each before
    assert search.final_score >= 40.0 and len(search.promotions) == 5
    assert sqnr_db(run(model, data), run(result.model, data)) == pytest.approx(search.final_score, abs=0.01)

    # a config that observes one layer's input otherwise (percentile) has each tensor
    # calibrated with its own method, as asked: the first ask's min/max would have been
    # that input's range in every later trial (review)
    passes.clear()
    overridden = {**config_of_target, "layer_quant_config": {"mm3": {"input_tensors": {"calib_method": "percentile"}}}}
    onnxq.quantize(model, None, overridden, data, progress=False)
    assert len(passes) > 1 and max(passes) == 1
