"""Same input, same bytes out; outputs are written atomically; inputs are never touched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import pooling, residual, save

import onnxq
import onnxq.graph.save as save_module
from onnxq.cli import main
from onnxq.errors import OnnxqError


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def inputs(tmp_path):
    """(model path, calibration .npz) for a model with Conv, Add, pools, Resize, Gemm."""
    folder = tmp_path / "in"
    folder.mkdir()
    model = save(pooling(), folder / "model.onnx")
    data = folder / "calib.npz"
    np.savez(data, x=np.random.default_rng(3).standard_normal((10, 3, 16, 16)).astype(np.float32))
    return model, data


def test_api_twice_is_byte_identical(inputs, tmp_path):
    model, data = inputs
    before = (digest(model), model.stat().st_mtime_ns)
    a, b = tmp_path / "a" / "q.onnx", tmp_path / "b" / "q.onnx"
    onnxq.quantize(model, a, "U8S8", data)
    onnxq.quantize(model, b, "U8S8", data)
    assert a.read_bytes() == b.read_bytes()
    assert (digest(model), model.stat().st_mtime_ns) == before
    # Atomic write: the output folder holds the output and nothing else.
    assert sorted(p.name for p in a.parent.iterdir()) == ["q.onnx"]
    onnx.checker.check_model(str(a), full_check=True)


def test_cli_twice_and_api_are_byte_identical(inputs, tmp_path, capsys):
    model, data = inputs
    before = digest(model)
    outs = [tmp_path / "cli1.onnx", tmp_path / "cli2.onnx"]
    for out in outs:
        assert main(["quantize", str(model), str(out), "--calib-data", str(data), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert outs[0].read_bytes() == outs[1].read_bytes()
    api = tmp_path / "api.onnx"
    onnxq.quantize(model, api, "U8S8", data)
    assert api.read_bytes() == outs[0].read_bytes()
    assert digest(model) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api.onnx", "cli1.onnx", "cli2.onnx", "in"]
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["calib.npz", "model.onnx"]


def test_in_memory_result_matches_saved_file(inputs, tmp_path):
    model, data = inputs
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, "U8S8", data)
    saved = onnx.load(str(out))
    assert saved.graph.SerializeToString() == result.model.graph.SerializeToString()
    assert result.summary.output == str(out)
    # the file is written from the load check's bytes: those a fresh serialization writes
    again = save_module.save_model(result.ir_model, tmp_path / "again.onnx")
    assert again.read_bytes() == out.read_bytes()


def test_overwriting_an_old_output_is_atomic(inputs, tmp_path):
    model, data = inputs
    out = tmp_path / "q.onnx"
    out.write_bytes(b"previous output")
    onnxq.quantize(model, out, "U8S8", data)
    onnx.checker.check_model(str(out), full_check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "q.onnx"]


def test_failed_save_leaves_old_output_and_no_temp_file(inputs, tmp_path, monkeypatch):
    """A crash half-way through writing must not leave a partial file anywhere."""
    model, data = inputs
    out = tmp_path / "q.onnx"
    out.write_bytes(b"previous output")

    def failing_save(model, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(save_module, "write_model", failing_save)
    with pytest.raises(OnnxqError, match="cannot write .*simulated"):  # one line for the CLI, no traceback
        onnxq.quantize(model, out, "U8S8", data)
    assert out.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "q.onnx"]


@pytest.mark.parametrize("fail_at", ["write", "model rename"])
def test_interrupted_save_with_external_data_never_mixes_runs(inputs, tmp_path, monkeypatch, fail_at):
    """Past the external-data size the weights go to `<name>.data`: an interruption while
    writing keeps the old pair; one between the renames leaves no model file (never an
    old model reading the new weights), and no temporary files either way."""
    model, data = inputs
    out = tmp_path / "q.onnx"
    monkeypatch.setattr(save_module, "EXTERNAL_DATA_LIMIT", 1000)
    onnxq.quantize(model, out, "U8S8", data)
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert set(old) == {"q.onnx", "q.onnx.data"}
    real_replace, real_save = os.replace, save_module.ir.save

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if fail_at == "write":
        monkeypatch.setattr(save_module.ir, "save", lambda *a, **k: (real_save(*a, **k), interrupt()))
    else:
        monkeypatch.setattr(save_module.os, "replace",
                            lambda a, b: interrupt() if str(b).endswith("q.onnx") else real_replace(a, b))
    with pytest.raises(KeyboardInterrupt):
        onnxq.quantize(model, out, {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}}, data)
    monkeypatch.undo()
    left = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if fail_at == "write":
        assert left == old
    else:
        assert "q.onnx" not in left


def test_model_proto_input_is_not_mutated(tmp_path):
    model = residual()
    snapshot = model.SerializeToString()
    feeds = {"x": np.random.default_rng(0).standard_normal((6, 3, 12, 12)).astype(np.float32)}
    a = onnxq.quantize(model, tmp_path / "a.onnx", "U8S8", feeds)
    assert model.SerializeToString() == snapshot
    b = onnxq.quantize(model, tmp_path / "b.onnx", "U8S8", feeds)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert a.ranges == b.ranges


def test_same_bytes_across_processes_with_different_hash_seeds(inputs, tmp_path):
    """Set/dict ordering under PYTHONHASHSEED must not leak into the output."""
    model, data = inputs
    outs = []
    for seed in ("0", "12345"):
        out = tmp_path / f"q_{seed}.onnx"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-m", "onnxq", "quantize", str(model), str(out),
             "--calib-data", str(data), "--quiet"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("algorithm", ["adaquant", "adaround"])
def test_layerwise_algorithms_give_the_same_bytes_on_one_blas_thread_or_all(tmp_path, algorithm):
    """AdaQuant on the bundled model differed in 6 of 36 tensors between one BLAS thread
    and two (a machine's core count, OMP_NUM_THREADS, taskset: determinism trial); the fit
    now runs on one thread wherever it runs. (On a one-core machine both runs use one.)"""
    from threadpoolctl import threadpool_limits

    models = Path(__file__).resolve().parent.parent / "models"
    config = {"algo_config": [{"name": algorithm}]}

    def quantized() -> bytes:
        return onnxq.quantize(str(models / "digits_cnn.onnx"), None, config, str(models / "digits_calib.npz"),
                              progress=False).model.SerializeToString()

    everywhere = quantized()
    with threadpool_limits(limits=1, user_api="blas"):
        assert quantized() == everywhere


def test_a_layerwise_algorithm_off_the_main_thread_says_its_bytes_may_differ():
    """From another thread OpenBLAS ignores the one-thread limit the fit runs under, so the
    codes can differ from a main-thread run's (determinism trial): the summary says so."""
    import threading

    models = Path(__file__).resolve().parent.parent / "models"
    config = {"algo_config": [{"name": "adaround", "num_iteration": 20}]}
    found = {}

    def run_it() -> None:
        found["r"] = onnxq.quantize(str(models / "digits_cnn.onnx"), None, config,
                                    str(models / "digits_calib.npz"), progress=False)

    thread = threading.Thread(target=run_it)
    thread.start()
    thread.join()
    assert any("adaround ran outside the main thread" in n for n in found["r"].summary.note_texts)
    main = onnxq.quantize(str(models / "digits_cnn.onnx"), None, config, str(models / "digits_calib.npz"),
                          progress=False)
    assert not any("outside the main thread" in n for n in main.summary.note_texts)


def test_a_killed_runs_temporary_files_are_cleared_by_the_next_write(inputs, tmp_path):
    """SIGKILL (or the out-of-memory killer) skips the cleanup: its temporary file stayed
    beside the output through later runs (big-model trial). A dead process's untouched for
    10 minutes are removed; a live one's, or a recent one (another host's), kept."""
    import subprocess

    model, calib = inputs
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    (out.parent / f".q.onnx.tmp{pid}").write_bytes(b"half a model")
    (out.parent / f".q.onnx.tmp{pid}.d").mkdir()
    (out.parent / f".q.onnx.tmp{pid}.d" / "q.onnx.data").write_bytes(b"weights")
    live = out.parent / f".q.onnx.tmp{os.getppid()}"  # the test runner's parent: alive
    live.write_bytes(b"another run")
    young = out.parent / f".q.onnx.tmp{pid + 1_000_000}"  # no such process here: another host's, perhaps
    young.write_bytes(b"another host's run")
    old = __import__("time").time() - 3600
    for path in [*out.parent.glob(f".q.onnx.tmp{pid}*"), out.parent / f".q.onnx.tmp{pid}.d" / "q.onnx.data"]:
        os.utime(path, (old, old))  # untouched for an hour
    assert main(["quantize", str(model), str(out), "--calib-data", str(calib), "--quiet"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["q.onnx", live.name, young.name])
