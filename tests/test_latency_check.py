"""`--latency`: the float and the quantized model timed in default sessions, and the causes
named where the quantized model is not faster."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder

import onnxq
from onnxq.cli import main
from onnxq.emit.latency import (
    Latency,
    Timing,
    causes,
    model_format,
    slower_on_cpu,
    slower_on_gpu,
    timed_on,
)

MODELS = Path(__file__).resolve().parent.parent / "models"


def test_cli_prints_both_batches_and_leaves_the_model_unchanged(tmp_path, capsys):
    base = ["quantize", str(MODELS / "digits_cnn.onnx")]
    data = ["--calib-data", str(MODELS / "digits_calib.npz")]
    assert main([*base, str(tmp_path / "timed.onnx"), *data, "--latency"]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "latency, default onnxruntime session" in s)
    found = re.findall(r"batch (\d+) ([\d.e-]+) -> ([\d.e-]+) ms \(([\d.]+)x\)", line)
    assert [b for b, *_ in found] == ["1", "8"]
    for _, before, after, speedup in found:
        assert float(before) > 0 and float(after) > 0
        assert abs(float(speedup) - float(before) / float(after)) < 0.02 * float(speedup) + 0.01  # 3 digits each
    onnx.checker.check_model(str(tmp_path / "timed.onnx"))
    assert main([*base, str(tmp_path / "plain.onnx"), *data, "--quiet"]) == 0
    assert (tmp_path / "plain.onnx").read_bytes() == (tmp_path / "timed.onnx").read_bytes()


def test_read_once_data_is_said_not_measured(tmp_path):
    with np.load(MODELS / "digits_calib.npz") as npz:
        x = npz["input"][:16]
    config = onnxq.compose_config("U8S8", None, {"calibration": {"measure_latency": True, "check_samples": 0}})
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            ({"input": x[i:i + 1]} for i in range(16)), progress=False)
    assert result.summary.latency is None
    assert any(n.startswith("latency not measured: the calibration data can be read only once")
               for n in result.summary.note_texts)


def test_causes_read_the_kernel_profiles():
    # Integer kernels with long Q/DQ stretches around them.
    found = causes({"Conv": 10.0}, {"QLinearConv": 6.0, "QuantizeLinear": 2.0, "DequantizeLinear": 3.0}, "x86-vnni")
    assert len(found) == 1 and "Q/DQ take 45%" in found[0] and "int8 regions are short" in found[0]
    # int16 activations: the Conv still runs in float, the Q/DQ are overhead.
    found = causes({"Conv": 10.0}, {"Conv": 11.0, "QuantizeLinear": 4.0, "DequantizeLinear": 4.0}, "x86-vnni")
    assert "no integer kernel runs" in found[0] and "every Conv still runs in float" in found[1]
    # Integer kernels no faster than the float ones they replace, on a CPU without VNNI.
    found = causes({"Conv": 5.0, "ReorderInput": 1.0}, {"QLinearConv": 6.5, "QuantizeLinear": 0.1}, "x86-avx2")
    assert "QLinearConv 6.50 ms, where float Conv took 6.00 ms" in found[0] and "no VNNI" in found[1]
    # A model too small for kernels to matter.
    assert "fixed cost" in causes({"Conv": 0.01}, {"QLinearConv": 0.01}, "arm64")[0]
    # Nothing stands out: the largest kernels are listed.
    assert "no single op type" in causes({"Conv": 5.0}, {"QLinearConv": 2.0, "Softmax": 1.0}, "x86-vnni")[0]


def test_on_a_gpu_provider_the_causes_and_the_label_are_the_providers():
    b = GraphBuilder(2)
    x = b.input("x", ["N", 3, 8, 8])
    conv = ir.from_proto(b.build([b.conv(x, 3, 4, k=3)], name="conv"))
    qdq = onnxq.quantize(conv.clone(), None, {}, {"x": np.ones((2, 3, 8, 8), np.float32)}, progress=False).ir_model
    half = onnxq.quantize(conv.clone(), None, "FP16", None, progress=False).ir_model
    assert [model_format(m) for m in (qdq, half, conv)] == ["qdq", "float16", "other"]
    slower = Latency([Timing(1, 1.0, 0.9), Timing(8, 1.0, 2.0)], "CUDAExecutionProvider")
    # int8 QDQ on the CUDA provider: Q/DQ + float kernels; TensorRT and float16 named.
    found = slower_on_gpu(slower, qdq)
    assert len(found) == 1 and "CUDAExecutionProvider has no fused int8" in found[0]
    assert "TensorrtExecutionProvider" in found[0] and "float16" in found[0]
    assert "float16 pays on wide layers only" in slower_on_gpu(slower, half)[0]
    assert "saves memory, not time" in slower_on_gpu(slower, conv)[0]
    # TensorRT compiles its own int8 kernels: not told to use itself.
    compiled = slower_on_gpu(Latency(slower.timings, "TensorrtExecutionProvider"), qdq)[0]
    assert compiled.startswith("TensorrtExecutionProvider compiles the model")
    # Faster everywhere, or timed on the CPU: no GPU causes.
    assert slower_on_gpu(Latency([Timing(8, 2.0, 1.0)], "CUDAExecutionProvider"), qdq) == []
    assert slower_on_gpu(Latency(slower.timings, "x86-vnni"), qdq) == []
    assert timed_on(["CUDAExecutionProvider", "CPUExecutionProvider"]) == "CUDAExecutionProvider"
    assert timed_on(["CPUExecutionProvider"]) == timed_on([]) != "CPUExecutionProvider"  # the CPU's ISA
    line = slower.lines()[0]
    assert line.startswith("latency, default onnxruntime session on CUDAExecutionProvider, float -> quantized: "
                           "batch 1 1 -> 0.9 ms (1.11x), batch 8 1 -> 2 ms (0.50x)")


def test_layers_left_float_among_integer_ones_are_named():
    """W4A8 MobileNet: int8 edge layers in QLinearConv, the int4 body in float Conv between
    Q/DQ; the cause read 'no single op type explains it' (trust trial)."""
    found = causes({"Conv": 10.0}, {"Conv": 19.9, "QLinearConv": 6.6, "QuantizeLinear": 2.0,
                                    "DequantizeLinear": 2.0}, "x86-vnni", {"Conv"})
    assert any(c.startswith("most Conv time is still float (19.90 ms, against 6.60 ms") for c in found), found


def test_a_float16_model_on_the_cpu_is_said_to_save_memory_not_time():
    """FP16 timed on the CPU read "no single op type explains it" (format trial)."""
    b = GraphBuilder(2)
    x = b.input("x", ["N", 3, 8, 8])
    conv = ir.from_proto(b.build([b.conv(x, 3, 4, k=3)], name="conv"))
    half = onnxq.quantize(conv.clone(), None, "FP16", None, progress=False).ir_model
    found = slower_on_cpu({"Conv": 1.0}, {"Conv": 1.0, "Cast": 0.2}, "x86-vnni", half)
    assert found[0].startswith("float16 saves memory on the CPU, not time")
    assert not any("float16" in c for c in slower_on_cpu({"Conv": 1.0}, {"Conv": 1.0}, "x86-vnni", conv))
    bf16 = onnxq.quantize(conv.clone(), None, "BF16", None, progress=False).ir_model
    assert slower_on_cpu({"Conv": 1.0}, {"Conv": 1.0}, "x86-vnni", bf16)[0].startswith("bfloat16 saves memory")


def test_no_data_is_said_not_measured(tmp_path):
    config = onnxq.compose_config("W8_DYNAMIC", None, {"calibration": {"measure_latency": True}})
    result = onnxq.quantize(str(MODELS / "digits_cnn.onnx"), tmp_path / "q.onnx", config, None, progress=False)
    assert result.summary.latency is None
    assert "latency not measured: it runs both models on the first calibration sample; pass calibration_data" \
        in result.summary.note_texts


def test_notes_name_the_python_argument_in_python_and_the_flag_on_the_command_line(tmp_path, capsys):
    """A summary note says what a Python caller passes (calibration_data); the CLI prints
    the same note with the flag its user types (--calib-data PATH)."""
    from onnxq.cli import main

    code = main(["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--preset", "W8_DYNAMIC",
                 "--latency"])
    out = capsys.readouterr().out
    assert code == 0
    assert "latency not measured: it runs both models on the first calibration sample; pass --calib-data PATH" in out
    assert "calibration_data" not in out


def test_a_fixed_batch_model_is_timed_at_its_batch(tmp_path):
    """An input of a fixed batch of 8 is timed at 8, with a line for the batch it cannot
    take (one row of it was fed before: onnxruntime refused it, and nothing was timed)."""
    b = GraphBuilder()
    x = b.input("x", [8, 32])
    w = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    model = b.build([b.node("MatMul", [x, b.const("w", w)])], name="fixed8")
    data = {"x": np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)}
    config = onnxq.compose_config("U8S8", None, {"calibration": {"measure_latency": True}})
    result = onnxq.quantize(model, tmp_path / "q.onnx", config, data, progress=False)
    latency = result.summary.latency
    assert latency is not None, result.summary.note_texts
    assert [t.batch for t in latency.timings] == [8] and latency.timings[0].quantized_ms > 0
    assert latency.skipped == ["batch 1 not measured: input 'x' has a fixed batch of 8"]


def test_cli_words_keep_an_alternative_in_parentheses(capsys):
    """"pass mixed_precision.eval_data (or calibration_data)" reads "pass --eval-data PATH
    (or --calib-data PATH)" on the command line: the alternative is not taken for the
    argument's own explanation and dropped."""
    from onnxq.cli import main
    from onnxq.cli.flags import in_cli_words

    assert in_cli_words("an accuracy target needs data; pass mixed_precision.eval_data (or calibration_data)") == \
        "an accuracy target needs data; pass --eval-data PATH (or --calib-data PATH)"
    assert in_cli_words("pass calibration_data (a path or arrays) as well") == "pass --calib-data PATH as well"
    assert main(["quantize", str(MODELS / "digits_cnn.onnx"), "/tmp/onnxq_never_written.onnx",
                 "--accuracy-target", "sqnr>=30"]) == 2
    assert "pass --eval-data PATH (or --calib-data PATH)" in capsys.readouterr().err


def test_the_cli_report_names_flags_where_the_library_names_arguments(tmp_path):
    """The HTML report written through the CLI says what its user types (--eval-data
    PATH), as its printed summary does, not the Python argument (mixed_precision.eval_data)."""
    pytest.importorskip("matplotlib")
    from onnxq.cli import main

    report = tmp_path / "r.html"
    assert main(["quantize", str(MODELS / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data",
                 str(MODELS / "digits_calib.npz"), "--accuracy-target", "sqnr>=10", "--report", str(report),
                 "--quiet"]) == 0
    text = report.read_text(encoding="utf-8")
    assert "pass --eval-data PATH for a held-out set" in text
    assert "mixed_precision.eval_data" not in text


def test_a_decoder_is_timed_on_its_prefill_and_a_decode_step(tmp_path):
    """An LLM folder's first sample is a prefill of a whole window; said as "batch 1" (and
    repeated at batch 8) it read 1.19x where decoding, what users wait on, ran 4.5x (LLM
    trial). Timed as what deploys: the prefill and one decode step on a cache of its length."""
    from genai_model import build_genai_folder

    folder = build_genai_folder(tmp_path / "float", layers=2, kv_heads=2)
    windows = tmp_path / "windows.npz"
    np.savez(windows, input_ids=np.random.default_rng(0).integers(0, 256, (2, 24)))
    config = onnxq.compose_config("W4_GROUP128", None, {"calibration": {"measure_latency": True}})
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), config, str(windows), progress=False)
    timings = result.summary.latency.timings
    assert [t.label for t in timings] == ["prefill of 24 tokens", "decode step after 24 tokens"]
    assert all(t.float_ms > 0 and t.quantized_ms > 0 for t in timings)
    (line,) = [s for s in result.summary.latency.lines() if s.startswith("latency,")]
    assert "prefill of 24 tokens" in line and "decode step after 24 tokens" in line and "batch" not in line


def test_a_decode_step_a_session_refuses_leaves_the_prefill_timed(tmp_path, monkeypatch):
    """Where the decode step's feed does not fit the model (a cache layout it does not
    build), the prefill is still timed and the step is said not measured (review: the
    whole latency had been lost)."""
    from genai_model import build_genai_folder

    import onnxq.emit.latency as latency

    folder = build_genai_folder(tmp_path / "float", layers=2, kv_heads=2)
    windows = tmp_path / "windows.npz"
    np.savez(windows, input_ids=np.random.default_rng(0).integers(0, 256, (2, 24)))
    built = latency.decoder_steps

    def broken(sample):
        steps = built(sample)
        step = next(k for k in steps if k.startswith("decode step"))
        steps[step] = {**steps[step], "attention_mask": steps[step]["attention_mask"].astype(np.float32)}
        return steps

    monkeypatch.setattr(latency, "decoder_steps", broken)
    config = onnxq.compose_config("W4_GROUP128", None, {"calibration": {"measure_latency": True}})
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), config, str(windows), progress=False)
    assert [t.label for t in result.summary.latency.timings] == ["prefill of 24 tokens"]
    assert any(s.startswith("decode step after 24 tokens not measured") for s in result.summary.latency.skipped)


def test_a_weight_only_kernel_fused_between_q_dq_is_said_as_such():
    """onnxruntime fuses A16W8's MatMul and its weight's DequantizeLinear into MatMulNBits,
    which computes on the float activations between the int16 Q/DQ pairs: the cause had
    read "as fast as its int8 ones ... int8 pays on wider layers" (encoder trial)."""
    timed = {"MatMulNBits": 23.30, "MatMul": 1.27, "Conv": 0.03, "QuantizeLinear": 4.0, "DequantizeLinear": 4.0}
    found = causes({"MatMul": 22.79, "Conv": 0.02}, timed, "x86-vnni", {"MatMul/Gemm", "Conv"}, fused_weight_only=True)
    assert any(c.startswith("onnxruntime runs the MatMuls as weight-only MatMulNBits made from each weight's "
                            "DequantizeLinear (23.30 ms against 22.79 ms in float)") for c in found), found
    assert not any("int8 pays on wider layers" in c or "int8 regions are short" in c for c in found), found
    conv = [c for c in found if c.startswith("every Conv")]
    assert all(c.startswith("every Conv still runs in float (0.03 ms against 0.02 ms)") for c in conv), conv  # its own
    # the model's own MatMulNBits (W4_GROUP128 beside an int8 Conv): read as before
    own = causes({"MatMul": 0.45, "Conv": 0.02}, {"MatMulNBits": 0.54, "QLinearConv": 0.02, "DequantizeLinear": 0.004},
                 "x86-vnni", {"Conv"}, fused_weight_only=False)
    assert any(c.startswith("MatMulNBits 0.54 ms") for c in own) and not any("every Conv" in c for c in own), own
    weight_only = causes({"MatMul": 10.0}, {"MatMulNBits": 12.0}, "x86-vnni", {"MatMul/Gemm"})  # no Q/DQ: W4 LLMs
    assert any(c.startswith("MatMulNBits 12.00 ms") for c in weight_only), weight_only
