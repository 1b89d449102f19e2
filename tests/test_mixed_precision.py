"""Mixed precision to an accuracy target: the search finds the sensitive layers, meets the
target in a default session, scores fewer models than there are layers, and its config
reproduces the model."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import random_feeds, stack_feeds
from test_analyze import deep_chain

from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.errors import ConfigError
from onnxq.quantize import quantize
from onnxq.search import parse_target
from onnxq.search.bisect import bisect_promotions
from onnxq.search.ladder import with_promotions

ROOT = Path(__file__).resolve().parents[1]


def _data(model: onnx.ModelProto, n: int, seed: int) -> dict[str, np.ndarray]:
    return stack_feeds(random_feeds(model, n, seed))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return float(np.mean(np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


def _run(model, feeds):
    session = ort.InferenceSession(model if isinstance(model, bytes) else str(model),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.fixture(scope="module")
def coarse_chain(tmp_path_factory):
    """A 16-conv chain in which two layers get 2-bit weights: they wreck the output."""
    model = deep_chain(layers=15, seed=7)
    path = tmp_path_factory.mktemp("mp") / "chain.onnx"
    onnx.save(model, path)
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    coarse = [convs[4], convs[11]]
    overrides = {"layer_quant_config": {n: {"weight": {"bits": 2}} for n in coarse}}
    return path, model, coarse, overrides


def test_parse_target():
    t = parse_target("top1>=float-0.5")
    assert (t.metric, t.op, t.value, t.relative) == ("top1", ">=", -0.5, True)
    assert t.met(85.6, 86.0) and not t.met(85.4, 86.0)
    t = parse_target("cosine >= 0.999")
    assert (t.metric, t.value, t.relative) == ("cosine", 0.999, False)
    assert parse_target("float-1", metric="top1").describe() == "top1>=float-1"
    assert parse_target("custom<=float+0.3").met(10.2, 10.0)
    for bad in ("top1 > 3", "accuracy>=0.5", "top1>=floaty"):
        with pytest.raises(ConfigError):
            parse_target(bad)
    # top1 is in percent: a fraction, or more than 100, is a mistake said at once
    for bad in ("top1>=0.75", "top1>=150"):
        with pytest.raises(ConfigError, match="top1 is a percentage"):
            parse_target(bad)
    assert parse_target("top1>=75").value == 75.0


def test_bisect_finds_the_fewest_layers_in_log_time():
    order = [f"l{i}" for i in range(32)]
    needed = 11  # the score is met once the 11 most sensitive layers are promoted

    def score_of(promotions):
        return float(sum(1 for n in promotions if int(n[1:]) < needed and promotions[n] == "float"))

    outcome = bisect_promotions(order, ["int16", "float"], score_of, lambda s: s >= needed, 0.0)
    assert outcome.met and len(outcome.promotions) == needed
    assert set(outcome.promotions.values()) == {"float"}
    assert len(outcome.trials) <= 2 + 5  # each rung's all-in trial, then log2(32) bisection steps


def test_search_meets_a_cosine_target_with_few_promotions(coarse_chain, tmp_path):
    path, model, coarse, overrides = coarse_chain
    calib, evaluation, held_out = _data(model, 64, 0), _data(model, 32, 1), _data(model, 32, 2)
    base_cfg = compose_config("U8S8", None, overrides)
    plain = quantize(path, tmp_path / "plain.onnx", base_cfg, calib, progress=False)
    float_out = _run(path, held_out)
    base_cos = _cosine(float_out, _run(tmp_path / "plain.onnx", held_out))
    assert base_cos < 0.99, "the 2-bit layers must hurt for this test to mean anything"

    cfg = compose_config("U8S8", None, {**overrides, "mixed_precision": {"target": "cosine>=0.998"}})
    np.savez(tmp_path / "eval.npz", **evaluation)
    cfg.mixed_precision.eval_data = str(tmp_path / "eval.npz")
    result = quantize(path, tmp_path / "mp.onnx", cfg, calib, progress=False)
    mp = result.summary.mixed_precision
    assert mp.met and mp.final_score >= 0.998
    assert result.summary.size_after == (tmp_path / "mp.onnx").stat().st_size and "search" in result.summary.stage_seconds
    assert mp.base_score == pytest.approx(_cosine(_run(path, evaluation), _run(tmp_path / "plain.onnx", evaluation)),
                                          abs=1e-4)
    # The two 2-bit layers rank first; the rest of the target takes a few uint8 layers more.
    assert {p.node for p in mp.promotions[:2]} == set(coarse) and len(mp.promotions) <= 8
    # each raise carries its ranking figure, as `onnxq analyze`'s output dB (the report's column)
    measured = [p for p in mp.promotions if p.output_db is not None]
    assert measured and all(p.output_db == pytest.approx(-10 * np.log10(p.relative_noise)) for p in measured)
    ranked = [p.output_db for p in measured]
    assert max(ranked[:2]) < min(ranked[2:], default=float("inf"))  # the 2-bit layers hurt most
    assert mp.evaluations < mp.ranked_layers  # fewer models scored than there are layers
    onnx.checker.check_model(str(tmp_path / "mp.onnx"), full_check=True)
    assert _cosine(float_out, _run(tmp_path / "mp.onnx", held_out)) > 0.995  # held-out data too
    # The cheapest rung that meets it: 8-bit weights for the 2-bit layers, which stay quantized.
    assert {p.rung for p in mp.promotions} == {"int8"}
    convs = [sum(op == "Conv" for op in r.plan.quantized_nodes.values()) for r in (plain, result)]
    assert convs[1] == convs[0]

    # The resulting config is ordinary: running it again gives the same bytes.
    again = quantize(path, tmp_path / "again.onnx", mp.config, calib, progress=False)
    assert again.summary.mixed_precision is None
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "mp.onnx").read_bytes()


def test_target_met_as_is_promotes_nothing(tmp_path):
    model = deep_chain(layers=4, seed=1)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    cfg = compose_config("U8S8", None, {"mixed_precision": {"target": "cosine>=0.9", "ladder": ["float"]}})
    result = quantize(path, tmp_path / "q.onnx", cfg, _data(model, 16, 0), progress=False)
    mp = result.summary.mixed_precision
    assert mp.met and not mp.promotions and mp.evaluations == 1
    assert any("calibration data" in n for n in result.summary.note_texts)  # no eval set: said so
    # the summary's size is the file's, and its time line has the search and the save
    assert result.summary.size_after == (tmp_path / "q.onnx").stat().st_size
    assert {"search", "save"} <= set(result.summary.stage_seconds)


def test_custom_evaluate_callable_and_unreachable_target(coarse_chain, tmp_path):
    path, model, coarse, overrides = coarse_chain
    feeds = _data(model, 16, 3)
    reference = _run(path, feeds)
    seen = []

    def evaluate(session: ort.InferenceSession) -> float:
        seen.append(session.get_session_options().graph_optimization_level)
        out = session.run(None, feeds)[0]
        return -float(np.abs(out - reference).max())  # higher is better

    cfg = compose_config("U8S8", None, {**overrides, "mixed_precision": {"target": "custom>=-1e-9",
                                                                           "ladder": ["int16"]}})
    result = quantize(path, tmp_path / "q.onnx", cfg, feeds, progress=False, evaluate=evaluate)
    mp = result.summary.mixed_precision
    assert not mp.met  # int16 activations cannot undo 2-bit weights
    # ... but they help a little, and the best model scored is written (one number per model:
    # no noise to tell it from the all-quantized one, so any gain counts)
    assert mp.final_score > mp.base_score and mp.final_score == mp.best_score
    assert {p.rung for p in mp.promotions} == {"int16"} and mp.written.startswith("every ranked layer raised to int16")
    assert any("not met" in n and "and that model is written" in n for n in result.summary.note_texts)
    assert set(seen) == {ort.GraphOptimizationLevel.ORT_ENABLE_ALL}  # what deploys
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    written = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    assert evaluate(written) == pytest.approx(mp.final_score, abs=1e-6)


def test_cli_accuracy_target_and_bad_input(tmp_path, capsys):
    """The bundled digits classifier with 4-bit per-tensor weights loses top-1; the search
    raises layers until it is within 0.3 points of float on the labelled eval set."""
    import yaml

    models = Path(__file__).resolve().parent.parent / "models"
    args = ["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"),
            "--calib-data", str(models / "digits_calib.npz"), "--per-tensor", "--weight-bits", "4",
            "--eval-data", str(models / "digits_eval.npz"),
            "--accuracy-target", "float-0.3", "--metric", "top1", "--save-config", str(tmp_path / "out.yaml"),
            "--ladder", "int16", "float"]  # precision rungs only (algorithm rungs: test_search_rungs.py)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "accuracy target top1>=float-0.3: met" in out and "promoted:" in out
    rung_lines = [line for line in out.splitlines() if line.startswith("  rung ")]
    assert rung_lines and "layers raised:" in rung_lines[0]  # each precision rung tried, with its score
    assert any("fewest that meet:" in line for line in rung_lines)
    saved = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert any(c.get("weight", {}).get("dtype") == "float32" or c.get("input_tensors", {}).get("dtype") == "int16"
               for c in saved["layer_quant_config"].values())
    assert "target" not in saved.get("mixed_precision", {})
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "again.onnx"), "--calib-data",
                 str(models / "digits_calib.npz"), "--config", str(tmp_path / "out.yaml"), "--quiet"]) == 0
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "q.onnx").read_bytes()
    for bad, words in ((["--accuracy-target", "top1 > 2"], "cannot read accuracy target"),
                       (["--metric", "top1"], "--metric names what"),
                       (["--accuracy-target", "cosine>=0.9", "--ladder", "int61"], "did you mean 'int16'"),
                       (["--accuracy-target", "cosine>=0.9", "--ladder", "float", "int16"],
                        "ladder rung 'int16' comes after 'float' in mixed_precision; rungs go cheapest first and "
                        "float is the costliest: put float last"),
                       (["--accuracy-target", "cosine>=0.9", "--ladder", "cle", "int16", "cle"],
                        "ladder rung 'cle' is listed twice"),
                       (["--accuracy-target", "top1>=float-1", "--metric", "cosine"], "conflicts")):
        assert main(args[:6] + bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


def test_ctrl_c_leaves_no_partial_files(tmp_path, monkeypatch, capsys):
    """Interrupted while the model is written (the slowest write), the CLI exits 130 and
    leaves neither the output nor a temporary file behind; the same for the config."""
    from onnxq.graph import save as save_module

    models = Path(__file__).resolve().parent.parent / "models"
    real_write = save_module.write_model

    def interrupted(model, path, *args):
        real_write(model, path, *args)  # the temporary file is complete on disk...
        raise KeyboardInterrupt  # ...when the user presses Ctrl-C

    monkeypatch.setattr(save_module, "write_model", interrupted)
    args = ["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"),
            "--calib-data", str(models / "digits_calib.npz"), "--quiet"]
    assert main(args) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    from onnxq.config import get_preset, save_config
    from onnxq.graph import save as save_module

    def broken_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module.os, "replace", broken_replace)
    with pytest.raises(KeyboardInterrupt):
        save_config(get_preset("U8S8"), tmp_path / "c.yaml")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("promoted", [["global_avg_pool", "flatten"], ["conv2"], ["conv1", "residual_add"]])
def test_a_trial_is_the_model_its_config_gives(promoted):
    """What the search scores (a re-emission of the calibrated model) is byte for byte what
    quantizing with the resulting config gives, also when raising a node leaves a tensor
    that no plan calibrated before (the Gemm's input once pooling and Flatten are float)."""
    import onnx_ir as ir

    from onnxq.quantize import run_pipeline

    models = Path(__file__).resolve().parent.parent / "models"
    model, data = models / "digits_cnn.onnx", str(models / "digits_calib.npz")
    config = compose_config("U8S8", None, {"opset": 21})
    base = run_pipeline(model, None, config, data, progress=False, keep_state=True)
    promoted_config = with_promotions(config, {n: "float" for n in promoted})
    trial = ir.to_proto(base.state.emit(promoted_config)).SerializeToString()
    direct = ir.to_proto(run_pipeline(model, None, promoted_config, data, progress=False).ir_model)
    assert trial == direct.SerializeToString()
    assert ir.to_proto(base.state.emit(config)).SerializeToString() == ir.to_proto(base.ir_model).SerializeToString()


def _offset_session(offset: float) -> ort.InferenceSession:
    """y = x + offset: a stand-in for a model whose one quantized layer adds that error."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "offset",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.full(4, offset, np.float32), "c")])
    model = onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_layers_rank_by_their_effect_on_the_output():
    """The ranking measures each layer where the target is scored, on the output: a layer
    whose own error is small but which the rest of the network amplifies comes first.
    Past the budget, the layers not measured follow in the fallback order."""
    from onnxq.analyze.impact import layers_to_measure
    from onnxq.search.sensitivity import impact_order
    from onnxq.search.target import EvalSet

    effect = {"quiet_locally": 3.0, "loud_locally": 0.5, "harmless": 0.0}
    local = ["loud_locally", "harmless", "quiet_locally"]  # the analysis's per-layer order
    evalset = EvalSet({"x": np.random.default_rng(0).standard_normal((40, 4)).astype(np.float32)}, None, None)
    order = impact_order(local, local, evalset, _offset_session(0.0), lambda n: _offset_session(effect[n]), 3)
    assert [n for n, _ in order] == ["quiet_locally", "loud_locally", "harmless"]
    assert order[0][1] > order[1][1] > order[2][1] == 0.0
    capped = impact_order(local, local, evalset, _offset_session(0.0), lambda n: _offset_session(effect[n]), 1)
    assert [n for n, _ in capped] == local and np.isnan(capped[1][1])  # the rest in the fallback order
    assert layers_to_measure(10 << 20) > 30 and layers_to_measure(2 << 30) == 16  # set by size, not the clock
    # after an analysis pass: at most 16 passes' worth of its samples (a 14 MB detector on 32
    # images had measured all of its 157 layers, 100x its quantize), never under 16 layers
    assert layers_to_measure(14 << 20, 32, 32) == 16 and layers_to_measure(10 << 20, 200, 32) == 100
    assert layers_to_measure(10 << 20, 4, 4) == 16


@pytest.mark.parametrize("rung, dtype", [("fp16", onnx.TensorProto.FLOAT16), ("bf16", onnx.TensorProto.BFLOAT16)])
def test_a_float_type_ladder_raises_layers_to_it(tmp_path, rung, dtype):
    """fp16 and bf16 rungs keep the promoted layers' bias as a float32 spec (a bias spec
    takes int32 or float32): the search used to stop on 'bias dtype float16'."""
    root = Path(__file__).resolve().parents[1] / "models"
    cfg = compose_config("U8S8", None, {"mixed_precision": {"target": "sqnr>=45", "ladder": [rung]}})
    result = quantize(root / "digits_cnn.onnx", tmp_path / "q.onnx", cfg, str(root / "digits_calib.npz"),
                      progress=False)
    mp = result.summary.mixed_precision
    assert mp.met and mp.promotions and {p.rung for p in mp.promotions} == {rung}
    saved = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(saved, full_check=True)
    assert any(t.data_type == dtype for t in saved.graph.initializer)  # the raised layers' weights


def test_an_int8_rung_raises_4_bit_weights_and_only_those(tmp_path):
    """W4A8's cheapest raise is a layer's weights to 8 bits (activations unchanged): the
    int8 rung meets an SQNR target the all-int4 model misses, with int8 weights on the
    raised layers and int4 on the rest; on an 8-bit recipe the rung is not applicable."""
    from onnxq.search.ladder import applicable

    root = Path(__file__).resolve().parents[1] / "models"
    data = str(root / "digits_calib.npz")
    plain = quantize(root / "digits_cnn.onnx", None, compose_config("W4A8", None, {"edge_weight": None}), data,
                     progress=False)
    assert applicable(["int8", "int16", "float"], plain.plan) == ["int8", "int16", "float"]
    u8 = quantize(root / "digits_cnn.onnx", None, compose_config("U8S8", None, {}), data, progress=False)
    assert applicable(["int8", "int16", "float"], u8.plan) == ["int16", "float"]
    cfg = compose_config("W4A8", None, {"edge_weight": None, "algo_config": [],
                                        "mixed_precision": {"target": "sqnr>=30", "ladder": ["int8"]}})
    result = quantize(root / "digits_cnn.onnx", tmp_path / "q.onnx", cfg, data, progress=False)
    mp = result.summary.mixed_precision
    assert mp.met and mp.base_score < 30 <= mp.final_score, (mp.base_score, mp.final_score)
    assert mp.promotions and {p.rung for p in mp.promotions} == {"int8"}
    from onnxq.search.ladder import narrow_weight_nodes
    assert {p.node for p in mp.promotions} <= narrow_weight_nodes(plain.plan)  # no no-op raises reported
    saved = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(saved, full_check=True)
    types = {t.data_type for t in saved.graph.initializer}
    assert onnx.TensorProto.INT8 in types and onnx.TensorProto.INT4 in types  # raised layers, and the rest
    with np.load(data) as npz:
        x = {k: npz[k][:8] for k in npz.files}
    assert np.isfinite(_run(saved.SerializeToString(), x)).all()


def test_eval_data_without_a_target_says_it_was_not_read(tmp_path, capsys):
    models = Path(__file__).resolve().parent.parent / "models"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(models / "digits_calib.npz"), "--eval-data", str(models / "digits_eval.npz")]) == 0
    assert "the eval data was not read" in capsys.readouterr().out


def test_the_search_raises_no_data_movement_op_alone():
    """A MaxPool, Flatten, Slice or Pad passes on its input's parameters whatever its own
    config says: the search's order of layers to raise leaves them out (their override
    would change nothing, and the summary would call it an override with no effect)."""
    import onnxq
    from onnxq.graph.load import load_model
    from onnxq.plan import plan_quantization
    from onnxq.search.driver import promotion_order

    models = Path(__file__).resolve().parents[1] / "models"
    model, _ = load_model(str(models / "digits_cnn.onnx"))
    plan = plan_quantization(model, onnxq.get_preset("U8S8"))
    assert {"MaxPool", "Flatten"} <= set(plan.quantized_nodes.values())
    order = [name for name, _ in promotion_order([], plan)]
    assert {plan.quantized_nodes[n] for n in order} == {"Conv", "Gemm", "Add", "GlobalAveragePool"}


@pytest.mark.parametrize("target, says", [
    ("cosine>=2", "a cosine is at most 1"),
    ("top1>=float+5", "asks for 104% top-1 (float scores 99%)"),
    ("float-1", "names no metric: write one in it (top1>=float-1) or give --metric"),
    # '<=' on a higher-is-better score: raised layers toward float, away from the goal (trial)
    ("top1<=90", "higher top1 is better, so '<=' asks for a model no better"),
    ("cosine<=2", "write 'cosine>=...'"),
])
def test_a_target_no_model_can_meet_is_one_line(tmp_path, capsys, target, says):
    """Targets beyond any model (a cosine above 1, top-1 above 100% relative to float) and
    one without a metric are refused with the fix, exit 2, instead of a whole search that
    ends 'NOT met' with exit 0."""
    models = Path(__file__).resolve().parents[1] / "models"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(models / "digits_calib.npz"), "--eval-data", str(models / "digits_eval.npz"),
                 "--accuracy-target", target, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "q.onnx").exists()


def test_a_ladder_without_a_target_is_said(capsys):
    models = Path(__file__).resolve().parents[1] / "models"
    import onnxq
    result = onnxq.quantize(str(models / "digits_cnn.onnx"), None, {"mixed_precision": {"ladder": ["float"]}},
                            str(models / "digits_calib.npz"), progress=False)
    assert any(n.startswith("the ladder was not used") for n in result.summary.note_texts)


@pytest.mark.parametrize("flags, says", [
    (["--labels", "y"], "the labels (y) were not read"),
    (["--rung-min-gain", "5"], "the rung minimum gain was not used"),
    (["--sequence-length", "7"], "the sequence length was not used"),
])
def test_a_flag_for_another_feature_is_said(tmp_path, capsys, flags, says):
    """--labels, --rung-min-gain and --sequence-length without the feature that reads them
    were taken in silence, where --ladder and --eval-data said so (new-user trial)."""
    models = Path(__file__).resolve().parents[1] / "models"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(models / "digits_calib.npz"), *flags]) == 0
    assert says in capsys.readouterr().out


def test_a_dynamic_recipe_searches_past_the_int16_rung(tmp_path, capsys):
    """W8_DYNAMIC with the default ladder: its int16 rung has no 16-bit form for activations
    quantized at run time; the search refused its own override ('dtype int16 with dynamic
    activations in layer_quant_config...', exit 2) instead of going on to float (trial)."""
    models = Path(__file__).resolve().parents[1] / "models"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--preset", "W8_DYNAMIC",
                 "--eval-data", str(models / "digits_eval.npz"), "--accuracy-target", "sqnr>=60"]) == 0
    out = capsys.readouterr().out
    assert "accuracy target sqnr>=60: met" in out and "promoted: 1 to float: fc" in out, out


def test_a_precision_rung_that_raises_nothing_is_said_and_not_scored(tmp_path, capsys):
    """On A16W8 the int16 rung scored the same model again ('rung int16: 6 layers raised'
    at the all-quantized score; second new-user trial): it is not tried, and says why."""
    models = Path(__file__).resolve().parents[1] / "models"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--preset", "A16W8",
                 "--calib-data", str(models / "digits_calib.npz"), "--eval-data", str(models / "digits_eval.npz"),
                 "--accuracy-target", "sqnr>=70"]) == 0
    out = capsys.readouterr().out
    assert "rung int16: not tried: no ranked layer has 8-bit activations to widen" in out, out
    assert "rung int16: 6 layers raised" not in out


def test_pass_rungs_calibrate_on_the_data_beside_a_ranges_file(tmp_path, capsys):
    """With --load-ranges and --calib-data, the CLE and SmoothQuant rungs said 'not tried:
    failed: ... recalibrate with --save-ranges' where --stats recalibrates on the data
    (second new-user trial): they calibrate on the data, and a kept one is said."""
    models = Path(__file__).resolve().parents[1] / "models"
    base = [str(models / "digits_cnn.onnx"), "--calib-data", str(models / "digits_calib.npz")]
    ranges = tmp_path / "r.json"
    assert main(["quantize", base[0], str(tmp_path / "a.onnx"), *base[1:], "--save-ranges", str(ranges), "--quiet"]) == 0
    assert main(["quantize", base[0], str(tmp_path / "b.onnx"), *base[1:], "--load-ranges", str(ranges),
                 "--eval-data", str(models / "digits_eval.npz"), "--accuracy-target", "sqnr>=55"]) == 0
    out = capsys.readouterr().out
    assert "rung cle: not tried" not in out and "failed" not in out, out
    assert re.search(r"rung cle: [0-9.]+, (kept|dropped)", out), out


def test_a_search_result_slower_than_float_is_a_warning():
    """The model a target needed, timed slower than float, gets a warning naming the int16
    promotions (no CPU int16 kernels) and the ladder that avoids them; faster or within the
    runs' spread, nothing."""
    from onnxq.search.driver import slower_than_float

    note = slower_than_float({"conv1": "int16", "fc": "float"}, 1.90, 0.43)
    assert note is not None and note.text.startswith("warning: the model the target needed runs slower than float")
    assert "1 layer raised to int16 runs as float ops" in note.text and "--ladder without int16" in note.text
    assert slower_than_float({"conv1": "int16"}, 0.43, 0.43) is None
    assert slower_than_float({"fc": "float"}, 0.0215, 0.0205) is None  # a tiny model's call jitter
    assert slower_than_float({}, 1.9, 0.43) is None


def test_the_result_holds_the_config_the_search_chose(tmp_path):
    """`result.config` (what the HTML report's Settings and --save-config show) is the
    config that made the model, promotions included, not the one the search started from."""
    import onnxq

    models = Path(__file__).resolve().parents[1] / "models"
    config = {"preset": "U8S8", "global_quant_config": {"weight": {"qscheme": "per_tensor"}},
              "mixed_precision": {"target": "sqnr>=45", "eval_data": str(models / "digits_eval.npz")}}
    result = onnxq.quantize(str(models / "digits_cnn.onnx"), None, config, str(models / "digits_calib.npz"),
                            progress=False)
    promoted = {p.node for p in result.summary.mixed_precision.promotions}
    assert promoted and promoted <= set(result.config.layer_quant_config)
    again = onnxq.quantize(str(models / "digits_cnn.onnx"), None, result.config, str(models / "digits_calib.npz"),
                           progress=False)
    assert again.model.SerializeToString() == result.model.SerializeToString()


def test_the_int16_rung_leaves_an_embedding_table_alone(tmp_path):
    """An embedding Gather's only quantized input is its constant table: raised to int16 it
    doubled the table (MiniLM +11.9 MB) while the summary said the override had no effect.
    The rung skips it, in the search and in what a search returns."""
    import onnx.helper as oh
    import onnx.numpy_helper as nh

    from onnxq.config import get_preset
    from onnxq.search.ladder import effective

    rng = np.random.default_rng(0)
    table = nh.from_array(rng.standard_normal((64, 16)).astype(np.float32), "table")
    w = nh.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    graph = oh.make_graph([oh.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
                           oh.make_node("MatMul", ["e", "w"], ["y"], name="mm")], "g",
                          [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N"])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])], [table, w])
    path = tmp_path / "embed.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    ids = {"ids": rng.integers(0, 64, (32, 5)).astype(np.int64)}
    result = quantize(path, tmp_path / "q.onnx", "S8S8", ids, progress=False)
    assert effective({"embed": "int16", "mm": "int16"}, result.plan) == {"mm": "int16"}
    wide = quantize(path, tmp_path / "r.onnx", with_promotions(get_preset("S8S8"), {"embed": "int16"}), ids,
                    progress=False)
    assert wide.summary.size_after > result.summary.size_after  # what the rung did to the table


@pytest.mark.parametrize("target, evaluate, words", [
    ("top1>=float-1", lambda session: 1.0, ["evaluate= is given", "custom>=float-1"]),
    ("custom>=float-1", None, ["'custom>=float-1' scores with your own function", "evaluate=fn"]),
    ("custom>=float-1", lambda session: None, ["returned None"]),
    ("custom>=float-1", lambda session: float("nan"), ["returned nan"]),
    ("custom>=float-1", lambda session: "x", ["returned 'x'"]),
    ("custom>=float-1", lambda session: np.zeros(3), ["array of shape (3,)"]),
])
def test_evaluate_and_the_target_metric_agree(tmp_path, target, evaluate, words):
    """evaluate= beside a built-in metric was never called, without a word; a custom target
    without it, or a score that is no number, gave raw TypeErrors or misleading errors."""
    config = compose_config("U8S8")
    config.mixed_precision.target = target
    config.mixed_precision.eval_data = str(ROOT / "models" / "digits_eval.npz")
    with pytest.raises(ConfigError) as info:
        quantize(ROOT / "models" / "digits_cnn.onnx", tmp_path / "q.onnx", config,
                 str(ROOT / "models" / "digits_calib.npz"), evaluate=evaluate, progress=False)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert not (tmp_path / "q.onnx").exists()


def test_an_unmet_target_is_said_under_quiet(tmp_path, capsys):
    """--quiet printed nothing and exit 0 left a pipeline no way to see the miss."""
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(ROOT / "models" / "digits_cnn.onnx"), str(out), "--calib-data",
                 str(ROOT / "models" / "digits_calib.npz"), "--eval-data", str(ROOT / "models" / "digits_eval.npz"),
                 "--accuracy-target", "sqnr>=200", "--ladder", "int16", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "NOT met" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert out.exists()


def test_slower_than_float_names_the_all_quantized_model_when_raising_did_not_slow_it():
    from onnxq.search.driver import slower_than_float

    kernels = slower_than_float({"conv": "int8"}, after_ms=0.81, float_ms=0.46, before_ms=1.13)
    assert kernels is not None and "all-quantized model is slower already" in kernels.text
    raised = slower_than_float({"conv": "int16"}, after_ms=1.9, float_ms=0.43, before_ms=0.5)
    assert raised is not None and "raised to int16" in raised.text


def test_cosine_and_sqnr_targets_score_the_positions_the_mask_keeps(tmp_path):
    """A per-position output was scored over padding too (MiniLM S8S8: 8.9 dB over every
    position, 12.8 over the kept ones), so the search raised layers for outputs nobody
    reads; the output check already left them out."""
    import onnx.helper as oh
    import onnxruntime as ort

    from onnxq.search.target import EvalSet, _cosine, _sqnr

    graph = oh.make_graph([oh.make_node("Cast", ["attention_mask"], ["m"], to=onnx.TensorProto.FLOAT),
                           oh.make_node("Unsqueeze", ["m", "axis"], ["m3"]),
                           oh.make_node("Mul", ["x", "m3"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 3]),
                           oh.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, ["N", 4])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4, 3])],
                          [onnx.numpy_helper.from_array(np.array([-1], np.int64), "axis")])
    path = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), path)
    rng = np.random.default_rng(0)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]] * 3, np.int64)
    data = {"x": rng.standard_normal((6, 4, 3)).astype(np.float32), "attention_mask": mask}
    session = ort.InferenceSession(str(path))
    evalset = EvalSet(data, None, None, batch_size=4)
    evalset.reference = evalset.first_output(session)
    kept = evalset.positions(session)
    np.testing.assert_array_equal(kept, mask != 0)
    noisy = evalset.reference + np.where(kept[..., None], 0.0, 100.0).astype(np.float32)  # padding moved far
    assert _sqnr(evalset.reference, noisy, kept).value == float("inf") and _sqnr(evalset.reference, noisy, None).value < 0
    assert _cosine(evalset.reference, noisy, kept).value == pytest.approx(1.0)
    assert not _sqnr(evalset.reference, noisy, kept).samples.any()  # each sample's noise: none where kept


def test_a_target_met_without_int16_keeps_the_models_opset(tmp_path):
    """The ladder's int16 rung widens every trial's opset to 21; a final model that keeps no
    int16 layer is written at the opset its own types need (segmentation trial: an
    int8-only model left at 21, which older onnxruntimes refuse)."""
    from helpers import conv_relu_chain

    import onnxq

    model = conv_relu_chain()
    assert {o.domain: o.version for o in model.opset_import}[""] < 21
    data = {"x": np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32)}
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, {"mixed_precision": {"target": "sqnr>=10"}}, data, progress=False)
    assert result.summary.mixed_precision.met
    written = onnx.load(out)
    assert {o.domain: o.version for o in written.opset_import}[""] == {o.domain: o.version
                                                                        for o in model.opset_import}[""]
    onnx.checker.check_model(written, full_check=True)
