"""What a newcomer meets on the command line (issue 16): each case runs `onnxq` as a
subprocess, as a user would, and checks the exit status, the one-line message on
stderr, and that nothing was written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import (
    GraphBuilder,
    conv_relu_chain,
    fixed_batch_conv,
    matmul,
    random_feeds,
    save,
    stack_feeds,
    two_inputs,
)

ROOT = Path(__file__).resolve().parents[1]


def onnxq(*args: str, cwd: Path | None = None, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "onnxq", *args], cwd=cwd, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=180)


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxq: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def chain(tmp_path):
    model = save(conv_relu_chain(), tmp_path / "chain.onnx")
    data = tmp_path / "calib.npz"
    np.savez(data, **stack_feeds(random_feeds(conv_relu_chain(), 16, seed=0)))
    return model, data


def test_external_data_model_from_another_directory(tmp_path):
    """A model with external data, quantized from a working directory that is not its own."""
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(matmul(), str(folder / "model.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    np.savez(tmp_path / "calib.npz", **stack_feeds(random_feeds(matmul(), 8, seed=1)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = onnxq("quantize", "../model/model.onnx", "../out.onnx", "--calib-data", "../calib.npz", "--quiet",
                 cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    out = onnx.load(str(tmp_path / "out.onnx"))
    onnx.checker.check_model(out)
    assert any(n.op_type == "DequantizeLinear" for n in out.graph.node)


def test_custom_domain_op_is_one_line(tmp_path, chain):
    model = conv_relu_chain()
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain = "MyRelu", "my.ops"
    model.opset_import.append(onnx.helper.make_opsetid("my.ops", 1))
    path = save(model, tmp_path / "custom.onnx")
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(path), str(out), "--calib-data", str(chain[1])),
                   "my.ops::MyRelu", "custom op")
    assert not out.exists()


def test_calibration_inputs_of_different_lengths(tmp_path):
    path = save(two_inputs(), tmp_path / "two.onnx")
    data = tmp_path / "calib.npz"
    np.savez(data, a=np.zeros((6, 3, 8, 8), np.float32), b=np.zeros((4, 2, 8, 8), np.float32))
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(path), str(out), "--calib-data", str(data)), "sample counts")
    assert not out.exists()


def test_compare_with_a_model_of_other_output_shape(tmp_path, chain):
    b = GraphBuilder(3)
    other = b.build([b.conv(b.input("x", ["N", 3, 16, 16]), 3, 4)], name="other")
    chain_model = onnx.load(str(chain[0]))
    other.graph.node[-1].output[0] = other.graph.output[0].name = chain_model.graph.output[0].name
    path = save(other, tmp_path / "other.onnx")
    one_error_line(onnxq("compare", str(chain[0]), str(path), "--data", str(chain[1]), "--quiet"),
                   "shape", "float model it came from")


def test_broken_pipe_prints_nothing(chain):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before onnxq writes (`onnxq ... | head -0`)
    try:
        proc = onnxq("config", "show", stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141
    assert proc.stderr == ""


def test_debug_keeps_exit_status_2(tmp_path, chain):
    out = tmp_path / "out.onnx"
    proc = onnxq("--debug", "quantize", str(chain[0]), str(out), "--calib-data", str(tmp_path / "missing.npz"))
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "CalibrationDataError" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(("flags", "words"), [
    (["--percentile", "99.9"], ("--percentile 99.9", "calib_method minmax", "use --calib-method percentile")),
    (["--num-bins", "512"], ("--num-bins 512", "calib_method minmax")),
    (["--exclude", "conv_9"], ("exclude entry 'conv_9' matches no node", "did you mean")),
])
def test_settings_that_would_be_ignored_are_refused(tmp_path, chain, flags, words):
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(chain[1]), *flags), *words)
    assert not out.exists()


def test_an_unknown_option_points_to_its_command_help(tmp_path, chain):
    proc = onnxq("quantize", str(chain[0]), str(tmp_path / "out.onnx"), "--presett", "U8S8")
    one_error_line(proc, "unrecognized arguments: --presett U8S8", "see onnxq quantize --help")


def test_an_exclude_entry_matching_nothing_points_to_the_node_names(tmp_path, chain):
    """The error names the command that lists node names, and that command lists them."""
    out = tmp_path / "out.onnx"
    line = one_error_line(onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(chain[1]),
                                "--exclude", "zzz_no_such_node"), "matches no node", "--nodes")
    command = line[line.index("onnxq inspect"):].split(";")[0].replace("MODEL", str(chain[0])).split()[1:]
    listing = onnxq(*command)
    assert listing.returncode == 0
    names = [n.name for n in onnx.load(str(chain[0])).graph.node]
    assert all(f"  {name}  " in listing.stdout for name in names)
    assert "(quantized)" in listing.stdout


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_calibration_data(tmp_path, chain, bad):
    arrays = dict(np.load(chain[1]))
    arrays["x"][3, 0, 2, 2] = bad
    data = tmp_path / "bad.npz"
    np.savez(data, **arrays)
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(data)), "'x'", "NaN",
                   "infinite")
    assert not out.exists()


def test_labels_array_is_left_out_with_a_note(tmp_path, chain):
    arrays = dict(np.load(chain[1]))
    data = tmp_path / "labelled.npz"
    np.savez(data, **arrays, labels=np.arange(len(arrays["x"])))
    out = tmp_path / "out.onnx"
    proc = onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(data))
    assert proc.returncode == 0, proc.stderr
    assert "left out labels (no model input)" in proc.stdout
    compare = onnxq("compare", str(chain[0]), str(out), "--data", str(data), "--quiet")
    assert compare.returncode == 0, compare.stderr
    assert "left out labels" in compare.stdout


def test_fixed_batch_model_short_of_one_batch(tmp_path):
    path = save(fixed_batch_conv(batch=4), tmp_path / "fixed4.onnx")
    data = tmp_path / "three.npz"
    np.savez(data, x=np.zeros((3, 3, 10, 10), np.float32))
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(path), str(out), "--calib-data", str(data)),
                   "fixed batch of 4", "3 rows", "[4,3,10,10]")
    assert not out.exists()


def test_version_and_help_name_every_activation_type():
    version = onnxq("--version")
    assert version.returncode == 0 and version.stdout.startswith("onnxq ")
    text = " ".join(onnxq("quantize", "--help").stdout.split())
    for dtype in ("uint8", "int8", "uint16", "int16", "float8_e4m3fn", "float16", "bfloat16"):
        assert dtype in text.split("--activation-type ACTIVATION_TYPE")[-1].split("--weight-type")[0]


def test_lowercase_preset_in_python_and_cli(tmp_path, chain):
    import onnxq as api

    assert api.as_config("u8s8") == api.get_preset("U8S8")
    with pytest.raises(api.OnnxqError, match="did you mean 'U8S8'"):
        api.as_config("u8s9")
    out = tmp_path / "out.onnx"
    assert onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(chain[1]), "--preset", "s8s8",
                 "--quiet").returncode == 0


def test_custom_domain_refused_without_listing_every_provider(monkeypatch):
    """onnxruntime-gpu without TensorRT's libraries crashes the process when its kernel
    registry is listed (seen on an H200 with 1.31.1): with a provider beyond the built-in
    ones, the refusal works from onnxruntime's own domains instead."""
    import onnxruntime as ort
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    from onnxq.errors import UnsupportedModelError
    from onnxq.graph import checks

    def crash() -> None:
        raise AssertionError("listed every provider's kernels")

    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(C, "get_all_opkernel_def", crash)
    checks._kernel_domains.cache_clear()
    try:
        model = conv_relu_chain()
        checks.check_runnable(ir.serde.deserialize_model(model), "plain.onnx")  # standard ops pass
        relu = next(n for n in model.graph.node if n.op_type == "Relu")
        relu.op_type, relu.domain = "MyRelu", "my.ops"
        model.opset_import.append(onnx.helper.make_opsetid("my.ops", 1))
        with pytest.raises(UnsupportedModelError, match="my.ops::MyRelu"):
            checks.check_runnable(ir.serde.deserialize_model(model), "custom.onnx")
    finally:
        checks._kernel_domains.cache_clear()


def test_compare_of_a_plain_model_needs_no_extensions_library(tmp_path, chain, monkeypatch):
    """A deployment of an ordinary QDQ model loads no custom-op library, and neither does
    `compare` (it failed where onnxruntime-extensions was missing); qdq-ext models still
    get the extended ops."""
    import onnxq.runtime as rt
    from onnxq.errors import OnnxqError
    from onnxq.evaluate import compare_models
    from onnxq.sessions import deployed_options, imports_extended

    out = tmp_path / "q.onnx"
    assert onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(chain[1]), "--quiet").returncode == 0

    def missing() -> None:
        raise OnnxqError("the extended QDQ format runs through onnxruntime-extensions")

    monkeypatch.setattr(rt, "_extensions", missing)
    result = compare_models(str(chain[0]), str(out), str(chain[1]), progress=False)
    assert result.samples == 16 and result.outputs[0].sqnr_db > 25
    ext = onnx.load(str(out))
    ext.opset_import.append(onnx.helper.make_opsetid(rt.DOMAIN, 1))
    assert imports_extended(ext.SerializeToString()) and not imports_extended(str(out))
    with pytest.raises(OnnxqError, match="onnxruntime-extensions"):
        deployed_options(extended=True)


def test_algorithm_option_without_its_algorithm_names_the_one_that_has_it(tmp_path, chain):
    out = tmp_path / "out.onnx"
    one_error_line(onnxq("quantize", str(chain[0]), str(out), "--calib-data", str(chain[1]),
                         "--algo-option", "empirical=true"), "bias_correction.empirical=")
    assert not out.exists()


def test_bias_correction_says_why_dynamic_layers_get_none(tmp_path, chain):
    proc = onnxq("quantize", str(chain[0]), str(tmp_path / "out.onnx"), "--dynamic", "--bias-correction")
    assert proc.returncode == 0, proc.stderr
    assert "no statically quantized layer to correct" in proc.stdout and "dynamically" in proc.stdout, proc.stdout
