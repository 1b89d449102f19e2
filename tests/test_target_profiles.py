"""Deployment targets: what each target does to the weights, the probe of this onnxruntime,
the CLI and config surface, `compare` measuring the deployed session, and the load check
that keeps nodes onnxruntime refuses in float.

Weight codes are read from the written model: where the GEMM kernels saturate, adjacent
weight pairs sum to at most 128 (`helpers.assert_pair_safe`); 8-bit weights reach 127
(every weight here is He-normal, so each channel's extreme maps to the symmetric maximum).
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from helpers import (
    assert_pair_safe,
    every_kernel,
    initializers,
    producers,
    random_feeds,
    reference_run,
    run,
    sqnr_db,
)

import onnxq
from onnxq.cli import main
from onnxq.config import get_preset
from onnxq.emit import loadcheck
from onnxq.errors import OnnxqError
from onnxq.notes import Topic, of
from onnxq.target import resolve_target
from onnxq.target.probe import saturating_kernels, wrong_kernels
from onnxq.target.profile import AVX2_SATURATING

MODEL = every_kernel()
CALIB = random_feeds(MODEL, 16, seed=1)


def quantize(**config: object) -> onnxq.QuantizationResult:
    cfg = get_preset("U8S8")
    for key, value in config.items():
        setattr(cfg, key, value)
    return onnxq.quantize(MODEL, None, cfg, CALIB)


def weight_codes(model: onnx.ModelProto) -> dict[str, tuple[str, np.ndarray]]:
    """Node name -> (kernel class, int8 weight codes) of every Conv/Gemm."""
    inits, prods = initializers(model), producers(model)
    out = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            codes = inits[prods[node.input[1]].input[0]]
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            out[node.name] = ("depthwise" if group > 1 else "gemm", codes)
    return out


def test_avx2_narrows_gemm_kernels_only():
    model = quantize(target="x86-avx2").model
    codes = weight_codes(model)
    assert {kind for kind, _ in codes.values()} == {"gemm", "depthwise"}
    assert_pair_safe(model, {name for name, (kind, _) in codes.items() if kind == "gemm"})
    assert all(np.abs(w).max() == 127 for kind, w in codes.values() if kind == "depthwise")


@pytest.mark.parametrize("target", ["x86-vnni", "arm64", "gpu"])
def test_exact_targets_keep_8_bits_and_correct_biases(target):
    result = quantize(target=target)
    assert all(np.abs(w).max() == 127 for _, w in weight_codes(result.model).values())
    assert result.summary.target.startswith(f"target {target}")
    (added,) = of(result.summary.notes, Topic.TARGET, "bias_correction")
    assert added.text.startswith(f"target {target} adds bias_correction")


def test_generic_is_avx2():
    a, b = quantize(target="generic").model, quantize(target="x86-avx2").model
    a.graph.name = b.graph.name
    assert [w.tobytes() for _, w in weight_codes(a).values()] == [w.tobytes() for _, w in weight_codes(b).values()]


def test_target_adds_bias_correction_unless_told_not_to():
    on = quantize(target="x86-avx2")
    assert of(on.summary.notes, Topic.TARGET, "bias_correction")
    off = quantize(target="x86-avx2", target_algorithms=False)
    assert not of(off.summary.notes, Topic.TARGET) and not of(off.summary.notes, Topic.ALGORITHM, "bias_correction")
    assert on.model.SerializeToString() != off.model.SerializeToString()


def test_reduce_range_forces_either_way():
    everywhere = weight_codes(quantize(target="x86-vnni", reduce_range=True).model)
    assert all(w.min() >= -64 and w.max() <= 63 for _, w in everywhere.values())
    never = weight_codes(quantize(target="x86-avx2", reduce_range=False).model)
    assert all(np.abs(w).max() == 127 for _, w in never.values())


def test_explicit_bits_win_over_the_target():
    cfg = get_preset("U8S8")
    cfg.target = "x86-avx2"
    cfg.global_quant_config.weight.bits = 6
    codes = weight_codes(onnxq.quantize(MODEL, None, cfg, CALIB).model)
    for _, w in codes.values():
        assert w.min() >= -32 and w.max() <= 31
        assert np.abs(w).max() >= 31


def test_narrowed_weights_track_float_in_reference_arithmetic():
    feeds = random_feeds(MODEL, 8, seed=2)
    ref = run(MODEL, feeds)
    eight = sqnr_db(ref, reference_run(quantize(target="x86-vnni").model, feeds))
    seven = sqnr_db(ref, reference_run(quantize(target="x86-avx2", target_algorithms=False).model, feeds))
    assert seven >= 25.0 and eight >= 28.0
    assert seven < eight  # one bit fewer costs something: the narrowing really happened


def test_auto_is_what_the_probe_measures():
    probed = saturating_kernels()
    assert probed <= AVX2_SATURATING  # no ISA known to onnxq saturates anything else
    profile = resolve_target(get_preset("U8S8"))
    assert profile.saturating == probed and profile.wrong == wrong_kernels()
    result = quantize()
    codes = weight_codes(result.model)
    gemm = {name for name, (kind, _) in codes.items() if kind == "gemm"}
    if ("uint8", "gemm") in probed:
        assert_pair_safe(result.model, gemm)
    else:
        assert all(np.abs(codes[name][1]).max() == 127 for name in gemm)


def test_depthwise_asymmetric_weights_become_symmetric_where_zero_points_are_wrong():
    cfg = get_preset("U8S8")
    cfg.target = "x86-avx2"  # a named target assumes onnxruntime's depthwise zero-point bug
    cfg.global_quant_config.weight.symmetric = False
    q = onnxq.quantize(MODEL, None, cfg, CALIB).model
    inits, prods = initializers(q), producers(q)
    for node in q.graph.node:
        if node.op_type == "Conv":
            dq = prods[node.input[1]]
            zp = inits[dq.input[2]]
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            assert np.any(zp != 0) == (group == 1), node.name


# --------------------------------------------------------------------------- config / CLI


@pytest.mark.parametrize("extra", [["--weight-bits", "9"], ["--target", "x86-avx"],
                                   ["--weight-type", "int4", "--weight-bits", "7"]])
def test_bad_target_options_exit_2_with_one_line(extra, tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(MODEL, src)
    np.savez(tmp_path / "c.npz", x=np.concatenate([f["x"] for f in CALIB]))
    rc = main(["quantize", str(src), str(tmp_path / "q.onnx"), "--calib-data", str(tmp_path / "c.npz"), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("onnxq: error:"), err


def test_cli_flags_reach_the_config(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(MODEL, src)
    np.savez(tmp_path / "c.npz", x=np.concatenate([f["x"] for f in CALIB]))
    out = tmp_path / "q.onnx"
    args = ["quantize", str(src), str(out), "--calib-data", str(tmp_path / "c.npz"),
            "--target", "x86-vnni", "--reduce-range", "--no-target-algorithms"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "target x86-vnni: 7-bit weights (reduce_range set" in printed
    assert all(w.max() <= 63 for _, w in weight_codes(onnx.load(str(out))).values())


def test_output_is_byte_identical_across_runs():
    assert quantize(target="auto").model.SerializeToString() == quantize(target="auto").model.SerializeToString()


# --------------------------------------------------------------------------- compare


def test_compare_reports_the_deployed_session_and_the_kernel_gap(tmp_path, capsys):
    float_path, q_path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(MODEL, float_path)
    cfg = get_preset("U8S8")
    cfg.target = "x86-vnni"  # 8-bit weights everywhere, whatever this CPU's kernels do
    onnxq.quantize(MODEL, q_path, cfg, CALIB)
    data = tmp_path / "eval.npz"
    np.savez(data, x=np.concatenate([f["x"] for f in random_feeds(MODEL, 16, seed=3)]))
    assert main(["compare", str(float_path), str(q_path), "--data", str(data), "--kernels", "both",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "default onnxruntime session (deployed kernels)" in printed
    assert "[reference kernels]" in printed
    # 8-bit weights on a CPU whose GEMM kernels saturate: the gap is reported with its fix.
    saturates = ("uint8", "gemm") in saturating_kernels()
    assert ("--reduce-range" in printed) == saturates, printed


# --------------------------------------------------------------------------- load check


def test_find_culprits_finds_exactly_the_bad_nodes():
    names = [f"n{i}" for i in range(10)]
    bad = {"n3", "n7"}
    calls = []

    def emit(kept: set[str]) -> loadcheck.Trial:
        calls.append(kept)
        return loadcheck.Trial(None, bad <= kept)

    trial, culprits = loadcheck.find_culprits(names, emit)
    assert trial.loads and set(culprits) == bad
    assert len(calls) <= 2 + 2 * 5  # about log2(10) trials per culprit


def test_find_culprits_refuses_when_even_float_fails():
    with pytest.raises(OnnxqError, match="even with every quantized node kept float"):
        loadcheck.find_culprits(["a", "b"], lambda kept: loadcheck.Trial(None, False))


def refuse_quantized(monkeypatch, victim: str) -> None:
    """Make onnxruntime (as the emission stage opens models) refuse any model in which
    node `victim` reads a dequantized weight."""
    real = loadcheck.open_deployed

    def refuses_victim(model, providers, prepack=True):
        quantized = any(n.name == victim and n.inputs[1].producer() is not None
                        and n.inputs[1].producer().op_type == "DequantizeLinear" for n in model.graph)
        return None if quantized else real(model, providers, prepack)

    module = importlib.import_module("onnxq.pipeline.emission")
    monkeypatch.setattr(module, "open_deployed", refuses_victim)
    monkeypatch.setattr(module, "model_loads",
                        lambda model, providers, prepack=True: refuses_victim(model, providers, prepack) is not None)


def test_nodes_onnxruntime_refuses_stay_float(monkeypatch):
    victim = next(n.name for n in MODEL.graph.node if n.op_type == "Conv" and
                  any(a.name == "group" and a.i > 1 for a in n.attribute))
    refuse_quantized(monkeypatch, victim)
    result = quantize(target="x86-vnni")
    assert victim in result.summary.float_nodes
    (kept,) = of(result.summary.notes, Topic.FLOAT)
    assert kept.nodes == (victim,) and "could not load them quantized" in kept.text
    assert result.summary.quantized_by_op["Conv"] == 2  # the other two Convs stay quantized
    feeds = random_feeds(MODEL, 4, seed=5)
    assert sqnr_db(run(MODEL, feeds), reference_run(result.model, feeds)) > 20


def test_a_layer_kept_float_after_all_gets_its_float_bias_back(monkeypatch):
    """A layer onnxruntime refuses quantized stays float with the bias it had, not the one
    bias correction fitted to its rounding (a trial's model with nothing quantized read
    27.6 dB against float)."""
    from pathlib import Path

    digits = onnx.load(Path(__file__).resolve().parents[1] / "models" / "digits_cnn.onnx")
    victim = next(n.name for n in digits.graph.node if n.op_type == "Conv")
    refuse_quantized(monkeypatch, victim)
    data = {k: v for k, v in np.load(Path(__file__).resolve().parents[1] / "models" / "digits_calib.npz").items()}
    config = {"preset": "U8S8", "algo_config": [{"name": "bias_correction"}], "target_algorithms": False}
    result = onnxq.quantize(digits, None, config, data, progress=False)
    assert victim in result.summary.float_nodes
    assert any(n.startswith("bias_correction:") for n in result.summary.note_texts)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in result.model.graph.initializer}
    before = {t.name: onnx.numpy_helper.to_array(t) for t in digits.graph.initializer}
    node = next(n for n in result.model.graph.node if n.name == victim)
    original = next(n for n in digits.graph.node if n.name == victim)
    np.testing.assert_array_equal(inits[node.input[2]], before[original.input[2]])


def test_cuda_provider_notes_say_where_int8_is_no_faster():
    """Calibrating for CUDAExecutionProvider, the summary says that its int8/float8 QDQ runs as
    dequantize + float kernels and that dynamic int8 runs on the CPU (measured on an H200,
    docs/kernels.md section 10); other providers get no such note."""
    from helpers import matmul

    from onnxq.plan import provider_notes

    static = quantize(target="gpu").plan
    (note,) = provider_notes(["CUDAExecutionProvider", "CPUExecutionProvider"], static)
    assert "4 quantized Conv/MatMul/Gemm" in note and "TensorrtExecutionProvider" in note
    assert provider_notes(["CPUExecutionProvider"], static) == []
    dynamic = onnxq.quantize(matmul(), None, get_preset("W8_DYNAMIC")).plan
    (note,) = provider_notes(["CUDAExecutionProvider"], dynamic)
    assert "DynamicQuantizeLinear" in note
    fp8 = onnxq.quantize(MODEL, None, get_preset("FP8_E4M3"), CALIB).plan
    assert len(provider_notes(["CUDAExecutionProvider"], fp8)) == 1
    fp16 = onnxq.quantize(MODEL, None, get_preset("FP16")).plan
    assert provider_notes(["CUDAExecutionProvider"], fp16) == []
