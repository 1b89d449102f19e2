"""`--optimize-for latency`: the plan timed on this CPU, changed where that makes the
deployed model faster without costing accuracy, and cached so a rerun gives the same bytes.

The timings of the real search vary with the machine, so the tests that check which
change is kept replace the timing (`_Bench.ratios`) with a rule; the end-to-end tests
check what holds on any CPU: a valid model that runs, close to float, and the cache."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder, op_count, run, sqnr_db

import onnxq
import onnxq.errors
from onnxq.cli import main
from onnxq.config.spec import DType
from onnxq.emit import latency as emit_latency
from onnxq.plan import plan_quantization
from onnxq.search import latency, latency_cache, latency_changes

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test searches afresh, in a cache of its own, with real timings cut to a few
    rounds (what is under test is the search and the cache, not the timing's precision)."""
    monkeypatch.setenv("ONNXQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(latency, "BUDGET_S", 0.05)


def block(seed: int = 3) -> onnx.ModelProto:
    """A transformer-like block: MatMul, bias Add, Mul by a constant, Relu, MatMul and a
    residual Add: [N,16,32] -> [N,16,32]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 16, 32])
    h = b.node("Add", [b.matmul(x, 32, 64), b.const("bias", b.small((64,), 0.1))])
    h = b.relu(b.node("Mul", [h, b.const("gain", np.full((64,), 0.7, np.float32))]))
    return b.build([b.node("Add", [x, b.matmul(h, 64, 32)])], name="block")


def block_data(n: int = 32) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((n, 16, 32)).astype(np.float32)}


def dynamic_is_faster(self, best, model):
    """A stand-in CPU where only dynamic int8 MatMuls pay: half the time, every other
    change the same."""
    ops = {n.op_type for n in model.model.graph}
    return {b: 0.5 if "DynamicQuantizeLinear" in ops or "MatMulInteger" in ops else 1.0 for b in self.feeds}


def test_a_faster_change_is_kept_and_the_output_carries_it(tmp_path, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", dynamic_is_faster)
    model, data = block(), block_data()
    result = onnxq.quantize(model, tmp_path / "q.onnx", {"optimize_for": "latency"}, data, progress=False)
    saved = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(saved)
    assert op_count(saved, "DynamicQuantizeLinear") + op_count(saved, "MatMulInteger") > 0
    texts = result.summary.note_texts
    assert any(t.startswith("latency plan: MatMul/Gemm dynamic int8 (batch 8: float") for t in texts)
    tried = [t for t in texts if t.startswith("latency plan tried:")]
    assert any("MatMul/Gemm dynamic int8: batch 1 0.50x the time, batch 8 0.50x the time" in t for t in tried)
    assert any(t.endswith("1.00x the time, not kept") for t in tried)  # the others, no faster
    feed = {"x": data["x"][:8]}
    assert sqnr_db(run(model, feed)[0], run(saved, feed)[0]) > 25
    assert result.summary.latency is not None and [t.batch for t in result.summary.latency.timings] == [1, 8]


def test_a_change_that_loses_accuracy_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", dynamic_is_faster)
    plain_sqnr = latency._Bench.sqnr

    def dynamic_is_worse(self, model):
        ops = {n.op_type for n in model.model.graph}
        return 0.0 if "DynamicQuantizeLinear" in ops or "MatMulInteger" in ops else plain_sqnr(self, model)

    monkeypatch.setattr(latency._Bench, "sqnr", dynamic_is_worse)
    result = onnxq.quantize(block(), tmp_path / "q.onnx", {"optimize_for": "latency"}, block_data(), progress=False)
    saved = onnx.load(tmp_path / "q.onnx")
    assert op_count(saved, "DynamicQuantizeLinear") == 0
    texts = result.summary.note_texts
    assert any(t.startswith("latency plan: no change made the model faster") for t in texts)
    assert any(t.startswith("latency plan tried: MatMul/Gemm dynamic int8: output SQNR 0.0 dB, more than 1 dB")
               for t in texts)


def test_the_search_is_cached_and_a_rerun_gives_the_same_bytes(tmp_path, capsys):
    # The outputs go beside the model: a file written there does not change the key.
    shutil.copy(MODELS / "digits_cnn.onnx", tmp_path / "digits_cnn.onnx")
    base = ["quantize", str(tmp_path / "digits_cnn.onnx")]
    data = ["--calib-data", str(MODELS / "digits_calib.npz"), "--optimize-for", "latency"]
    assert main([*base, str(tmp_path / "a.onnx"), *data]) == 0
    first = capsys.readouterr().out
    assert "latency plan:" in first and "(cached for this" not in first
    line = next(s for s in first.splitlines() if "latency, default onnxruntime session" in s)
    assert re.findall(r"batch (\d+) [\d.e-]+ -> [\d.e-]+ ms", line) == ["1", "8"]
    stored = list((tmp_path / "cache" / "latency").glob("*.json"))
    assert len(stored) == 1
    assert main([*base, str(tmp_path / "b.onnx"), *data]) == 0
    assert "(cached for this model, data, config and its providers, CPU and onnxruntime)" in capsys.readouterr().out
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    quantized = onnx.load(tmp_path / "a.onnx")
    onnx.checker.check_model(quantized)
    with np.load(MODELS / "digits_calib.npz") as npz:
        x = {"input": npz["input"][:16]}
    reference = run(str(MODELS / "digits_cnn.onnx"), x)[0]
    assert sqnr_db(reference, run(quantized, x)[0]) > 20


def test_a_broken_cache_entry_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", lambda self, best, model: dict.fromkeys(self.feeds, 1.0))
    config = onnxq.as_config({"optimize_for": "latency"})
    source, data = block(), block_data()
    key = latency_cache.key(source, onnxq.as_config({}), data)
    folder = tmp_path / "cache" / "latency"
    folder.mkdir(parents=True)
    (folder / f"{key}.json").write_text("{not json")
    result = onnxq.quantize(source, None, config, data, progress=False)
    assert any(t.startswith("latency plan: no change made") for t in result.summary.note_texts)
    assert json.loads((folder / f"{key}.json").read_text())["kept"] == []


def test_what_cannot_be_searched_is_quantized_as_configured_and_says_why(tmp_path):
    data = block_data(8)["x"]
    result = onnxq.quantize(block(), tmp_path / "q.onnx", {"optimize_for": "latency"},
                            ({"x": data[i:i + 1]} for i in range(8)), progress=False)
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"))
    assert any(t.startswith("latency plan not searched: the calibration data can be read only once")
               and t.endswith("quantized as configured") for t in result.summary.note_texts)
    weight_only = onnxq.quantize(block(), tmp_path / "w.onnx", {"preset": "W8_DYNAMIC", "optimize_for": "latency"},
                                 block_data(8), progress=False)
    assert any(t.startswith("latency plan not searched: this recipe quantizes no activations statically")
               for t in weight_only.summary.note_texts)
    assert op_count(onnx.load(tmp_path / "w.onnx"), "DynamicQuantizeLinear") > 0  # the recipe as given


def test_the_chosen_config_is_saved_and_reproduces_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", dynamic_is_faster)
    model_path = tmp_path / "block.onnx"
    onnx.save(block(), model_path)
    np.savez(tmp_path / "data.npz", **block_data())
    args = ["quantize", str(model_path), str(tmp_path / "q.onnx"), "--calib-data", str(tmp_path / "data.npz"),
            "--optimize-for", "latency", "--save-config", str(tmp_path / "chosen.yaml"), "--quiet"]
    assert main(args) == 0
    chosen = (tmp_path / "chosen.yaml").read_text()
    assert "optimize_for: accuracy" in chosen and "is_dynamic: true" in chosen
    again = ["quantize", str(model_path), str(tmp_path / "again.onnx"), "--calib-data", str(tmp_path / "data.npz"),
             "--config", str(tmp_path / "chosen.yaml"), "--quiet"]
    assert main(again) == 0
    assert (tmp_path / "q.onnx").read_bytes() == (tmp_path / "again.onnx").read_bytes()


def test_saved_ranges_are_a_one_line_error(tmp_path, capsys):
    code = main(["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(MODELS / "digits_calib.npz"), "--optimize-for", "latency", "--load-ranges",
                 str(tmp_path / "ranges.json")])
    err = capsys.readouterr().err
    assert code == 2 and "drop --load-ranges/--stats, or --optimize-for latency" in err and "Traceback" not in err


def test_with_an_accuracy_target_it_is_a_one_line_error(tmp_path, capsys):
    code = main(["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"),
                 "--calib-data", str(MODELS / "digits_calib.npz"), "--optimize-for", "latency",
                 "--accuracy-target", "sqnr>=20"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot be combined" in err and "Traceback" not in err
    assert not (tmp_path / "q.onnx").exists()


def test_faster_needs_the_gain_at_the_largest_batch_and_no_loss_at_batch_1():
    assert latency._faster({1: 1.0, 8: 0.9})
    assert not latency._faster({1: 1.0, 8: 0.97})  # within noise
    assert not latency._faster({1: 1.2, 8: 0.8})  # slower at batch 1
    assert latency._faster({1: 0.9})  # a model that runs at batch 1 only


def test_other_data_is_another_key_and_a_reader_is_not_cached():
    config, source, data = onnxq.as_config({}), block(), block_data()
    key = latency_cache.key(source, config, data)
    assert key == latency_cache.key(source, config, {"x": data["x"].copy()})
    assert key != latency_cache.key(source, config, {"x": data["x"][:16]})
    assert key != latency_cache.key(source, config, [{"x": data["x"][:1]}])
    assert latency_cache.key(source, config, iter([{"x": data["x"][:1]}])) is None


def test_a_change_that_fails_is_not_kept_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", dynamic_is_faster)
    emit = latency.PipelineState.emit

    def dynamic_fails(self, config):
        if config.layer_type_quant_config:
            raise RuntimeError("the kernel is missing\nand more")
        return emit(self, config)

    monkeypatch.setattr(latency.PipelineState, "emit", dynamic_fails)
    result = onnxq.quantize(block(), tmp_path / "q.onnx", {"optimize_for": "latency"}, block_data(), progress=False)
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"))
    assert "latency plan tried: MatMul/Gemm dynamic int8: failed (RuntimeError: the kernel is missing), not kept" \
        in result.summary.note_texts


def test_report_and_evaluate_with_the_latency_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(latency._Bench, "ratios", dynamic_is_faster)
    result = onnxq.quantize(block(), tmp_path / "q.onnx", {"optimize_for": "latency"}, block_data(), progress=False,
                            report=tmp_path / "report.html")
    assert "is_dynamic: true" in (tmp_path / "report.html").read_text()  # the chosen config
    assert result.config.optimize_for == "accuracy" and result.config.layer_type_quant_config
    with pytest.raises(onnxq.errors.ConfigError, match="evaluate= scores models for an accuracy target"):
        onnxq.quantize(block(), None, {"optimize_for": "latency"}, block_data(), evaluate=lambda s: 1.0)


def test_excluded_names_are_escaped():
    b = GraphBuilder(5)
    x = b.input("x", ["N", 3, 8, 8])
    model = ir.from_proto(b.build([b.conv(x, 3, 4, k=1)], name="dotted"))
    model.graph.node(0).name = "conv.1"
    plan = plan_quantization(model, onnxq.as_config({}))
    change = next(c for c in latency_changes.CHANGES if c.name == "other Conv kept float")
    assert change.make(onnxq.as_config({}), model.graph, plan).exclude == [r"conv\.1"]


def float16_is_faster(self, best, model):
    """A stand-in GPU provider where only float16 pays (the CUDA provider has no fused int8
    kernels): half the time for a model with float16 weights, every other the same. Each
    float16 candidate's weights are kept, to compare with the model written."""
    half = any(v.const_value is not None and v.const_value.dtype == ir.DataType.FLOAT16
               for v in model.model.graph.initializers.values())
    if half:
        TIMED.append({n: v.const_value.numpy().copy() for n, v in model.model.graph.initializers.items()})
    return {b: 0.5 if half else 1.0 for b in self.feeds}


TIMED: list[dict[str, np.ndarray]] = []


def test_on_a_gpu_provider_float16_is_tried_first_and_kept_where_faster(tmp_path, monkeypatch):
    # The timing runs on the CPU, which the plan is told is a GPU provider.
    for module in (latency_cache, emit_latency):
        monkeypatch.setattr(module, "GPU_PROVIDERS", ("CPUExecutionProvider",))
    for module in (latency_changes, emit_latency):
        monkeypatch.setattr(module, "gpu_first", lambda providers: next(iter(providers), None))
    monkeypatch.setattr(latency._Bench, "ratios", float16_is_faster)
    TIMED.clear()
    model, data = block(), block_data()
    # A pass and a float op type of the user's: kept, so the model timed is the one written.
    config = {"optimize_for": "latency", "pre_quant_opt_config": [{"name": "cle"}], "float_op_types": ["Relu"]}
    result = onnxq.quantize(model, tmp_path / "q.onnx", config, data, progress=False)
    saved = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(saved)
    assert op_count(saved, "QuantizeLinear") == 0
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in saved.graph.initializer)
    written = {t.name: onnx.numpy_helper.to_array(t) for t in saved.graph.initializer}
    assert len(TIMED) == 2 and written.keys() == TIMED[0].keys()  # one timing, and its confirmation
    assert all(np.array_equal(written[n], TIMED[0][n]) for n in written)
    texts = result.summary.note_texts
    assert any(t.startswith("latency plan: float16 weights and compute") for t in texts)
    tried = [t for t in texts if t.startswith("latency plan tried:")]
    assert tried[0].startswith("latency plan tried: float16 weights and compute (the FP16 preset; GPU providers): "
                               "batch 1 0.50x the time, batch 8 0.50x the time")
    feed = {"x": data["x"][:8]}
    assert sqnr_db(run(model, feed)[0], run(saved, feed)[0]) > 50  # float16: far above int8's
    chosen = result.config
    assert chosen.global_quant_config.weight.dtype == DType.FLOAT16
    assert "Relu" in chosen.float_op_types and "Softmax" in chosen.float_op_types
    assert chosen.pre_quant_opt_config == [{"name": "cle"}]
    lines = result.summary.latency.lines()
    assert lines[0].startswith("latency, default onnxruntime session on CPUExecutionProvider, float -> quantized")


def test_float16_is_a_change_only_where_a_gpu_provider_times_it():
    model = ir.from_proto(block())
    plan = plan_quantization(model, onnxq.as_config({}))
    change = next(c for c in latency_changes.CHANGES if c.name.startswith("float16"))
    assert change.make(onnxq.as_config({}), model.graph, plan) is None  # the CPU: no float16 kernels to gain
    cuda = onnxq.as_config({"exclude": ["x"], "layer_type_quant_config": {"Add": {"weight": {"dtype": "int8"}}},
                            "calibration": {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}})
    made = change.make(cuda, model.graph, plan)
    assert made.global_quant_config.weight.dtype == DType.FLOAT16
    assert made.exclude == ["x"] and made.calibration == cuda.calibration
    assert made.layer_type_quant_config == cuda.layer_type_quant_config
    assert change.make(made, model.graph, plan) is None  # already float16
    # The int8 changes do not apply to a float16 config, whatever the plan holds.
    dynamic = next(c for c in latency_changes.CHANGES if c.name == "MatMul/Gemm dynamic int8")
    assert dynamic.make(cuda, model.graph, plan) is not None
    assert dynamic.make(made, model.graph, plan) is None


def test_a_gpu_plan_entry_names_the_provider():
    entry = latency_cache.Entry(onnxq.as_config({"calibration": {"providers": ["CUDAExecutionProvider"]}}), [],
                                {8: 1.0}, {8: 2.0}, {8: 2.0}, [])
    assert entry.describe().startswith("no change made the model faster on CUDAExecutionProvider (batch 8")
    assert "faster on this CPU" in latency_cache.Entry(onnxq.as_config({}), [], {8: 1.0}, {8: 2.0}, {8: 2.0},
                                                       []).describe()
