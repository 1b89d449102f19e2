"""User mistakes: one clear line on stderr, exit status 2, nothing touched.

Through `onnxq.cli.main` every mistake must return 2, print exactly one stderr line that
starts with `onnxq: error:` and names the problem, print no traceback, leave the input
model byte-identical and write no output. Through the Python API the same mistakes raise
`OnnxqError` subclasses.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import conv_relu_chain, save

import onnxq
from onnxq.cli import main
from onnxq.errors import CalibrationDataError, ConfigError, ModelError, OnnxqError


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Workspace:
    root: Path
    model: Path
    good_data: Path
    out: Path

    def npz(self, name: str, **arrays: np.ndarray) -> Path:
        path = self.root / name
        np.savez(path, **arrays)
        return path


@pytest.fixture
def ws(tmp_path) -> Workspace:
    model = save(conv_relu_chain(), tmp_path / "model.onnx")
    good = tmp_path / "calib.npz"
    np.savez(good, x=np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32))
    return Workspace(tmp_path, model, good, tmp_path / "out" / "model.int8.onnx")


def _truncated(ws: Workspace) -> list[str]:
    bad = ws.root / "truncated.onnx"
    data = ws.model.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    return [str(bad), str(ws.out), "--calib-data", str(ws.good_data)]


def _text_file(ws: Workspace) -> list[str]:
    bad = ws.root / "notes.onnx"
    bad.write_text("this is a text file, not a model\n")
    return [str(bad), str(ws.out), "--calib-data", str(ws.good_data)]


def _missing_model(ws: Workspace) -> list[str]:
    return [str(ws.root / "nope.onnx"), str(ws.out), "--calib-data", str(ws.good_data)]


def _wrong_key(ws: Workspace) -> list[str]:
    data = ws.npz("wrong_key.npz", y=np.zeros((4, 3, 16, 16), np.float32))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _wrong_rank(ws: Workspace) -> list[str]:
    data = ws.npz("wrong_rank.npz", x=np.zeros((4, 16), np.float32))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _wrong_dim(ws: Workspace) -> list[str]:
    data = ws.npz("wrong_dim.npz", x=np.zeros((4, 4, 16, 16), np.float32))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _wrong_dtype(ws: Workspace) -> list[str]:
    data = ws.npz("ints.npz", x=np.zeros((4, 3, 16, 16), np.int64))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _out_is_in(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.model), "--calib-data", str(ws.good_data)]


def _out_is_in_other_spelling(ws: Workspace) -> list[str]:
    other = ws.root / "out" / ".." / ws.model.name
    (ws.root / "out").mkdir()
    return [str(ws.model), str(other), "--calib-data", str(ws.good_data)]


def _unknown_config_key(ws: Workspace) -> list[str]:
    cfg = ws.root / "config.yaml"
    cfg.write_text("global_quant_config:\n  weight:\n    symetric: true\n")
    return [str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), "--config", str(cfg)]


def _no_calib_data(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.out)]


def _missing_calib_data(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.out), "--calib-data", str(ws.root / "nope.npz")]


def _unknown_preset(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), "--preset", "U8S9"]


def _output_is_directory(ws: Workspace) -> list[str]:
    ws.out.mkdir(parents=True)
    return [str(ws.model), str(ws.out), "--calib-data", str(ws.good_data)]


def _zero_max_samples(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), "--max-samples", "0"]


def _missing_channel_axis(ws: Workspace) -> list[str]:
    data = ws.npz("no_channels.npz", x=np.zeros((4, 16, 16), np.float32))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _uint8_images(ws: Workspace) -> list[str]:
    data = ws.npz("pixels.npz", x=np.zeros((4, 3, 16, 16), np.uint8))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _already_quantized(ws: Workspace) -> list[str]:
    quantized = ws.root / "q.onnx"
    onnxq.quantize(str(ws.model), str(quantized), calibration_data=str(ws.good_data), progress=False)
    return [str(quantized), str(ws.out), "--calib-data", str(ws.good_data)]


def _channels_last_file(ws: Workspace) -> list[str]:
    data = ws.root / "nhwc.npy"
    np.save(data, np.zeros((4, 16, 16, 3), np.float32))
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _text_as_npy(ws: Workspace) -> list[str]:
    data = ws.root / "notes.npy"
    data.write_text("1 2 3\n")
    return [str(ws.model), str(ws.out), "--calib-data", str(data)]


def _output_name_too_long(ws: Workspace) -> list[str]:
    return [str(ws.model), str(ws.root / ("x" * 300 + ".onnx")), "--calib-data", str(ws.good_data)]


# case -> (builder of the argv after "quantize", words the error line must contain)
CASES: dict[str, tuple[Callable[[Workspace], list[str]], tuple[str, ...]]] = {
    "truncated_onnx": (_truncated, ("truncated.onnx", "not a readable ONNX model")),
    "text_renamed_onnx": (_text_file, ("notes.onnx", "not a readable ONNX model")),
    "missing_model": (_missing_model, ("not found", "nope.onnx")),
    "calib_wrong_key": (_wrong_key, ("'y'", "not a model input", "x")),
    "calib_wrong_rank": (_wrong_rank, ("'x'", "rank 2", "rank 4")),
    "calib_wrong_static_dim": (_wrong_dim, ("'x'", "axis 1 must be 3")),
    # a stack of 4 single-channel images was taken for one sample and split into rows
    "calib_missing_axis": (_missing_channel_axis, ("'x'", "rank 3", "1 axis missing", "[samples, 3, 16, 16]")),
    # a second set of Q/DQ on top of the first quantizes twice
    "already_quantized": (_already_quantized, ("q.onnx", "already quantized", "QuantizeLinear", "float model")),
    "calib_int_for_float": (_wrong_dtype, ("'x'", "int64", "float32")),
    "out_equals_in": (_out_is_in, ("is the input model",)),
    "out_equals_in_other_spelling": (_out_is_in_other_spelling, ("is the input model",)),
    "unknown_config_key": (_unknown_config_key, ("symetric", "did you mean 'symmetric'")),
    "no_calib_data": (_no_calib_data, ("calibration data", "--calib-data")),
    "calib_data_not_found": (_missing_calib_data, ("not found", "nope.npz")),
    "unknown_preset": (_unknown_preset, ("U8S9", "U8S8")),
    "output_is_directory": (_output_is_directory, ("is a directory",)),
    "output_name_too_long": (_output_name_too_long, ("cannot write", "choose another output path")),
    # the file and its whole array named, not one sample
    "calib_file_channels_last": (_channels_last_file, ("nhwc.npy", "samples of shape [16, 16, 3]", "axis 1 must be 3",
                                                        ".transpose(0, 3, 1, 2)")),
    # uint8 images: casting alone would calibrate on pixels the model never sees
    "calib_uint8_images": (_uint8_images, ("'x'", "uint8", ".astype(float32)", "/255, then its mean and std")),
    "calib_text_as_npy": (_text_as_npy, ("notes.npy", "not a numpy .npy file")),
    "zero_max_samples": (_zero_max_samples, ("invalid --max-samples 0",)),
}


def assert_one_error_line(err: str, words: tuple[str, ...]) -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines}"
    line = lines[0]
    assert line.startswith("onnxq: error: ")
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    return line


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_user_error(case, ws, capsys):
    build, words = CASES[case]
    argv = build(ws)
    before = sha256(ws.model)
    out_existed = ws.out.exists()
    rc = main(["quantize", *argv])
    captured = capsys.readouterr()
    assert rc == 2
    assert_one_error_line(captured.err, words)
    assert sha256(ws.model) == before
    assert ws.out.exists() == out_existed
    if not out_existed:
        assert not (ws.root / "out").exists() or not any((ws.root / "out").iterdir())


def test_cli_success_is_quiet_on_stderr(ws, capsys):
    """Control for the cases above: the same workspace quantizes fine."""
    before = sha256(ws.model)
    assert main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(ws.good_data)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "quantized nodes: 5" in captured.out
    assert ws.out.is_file()
    assert sha256(ws.model) == before


@pytest.mark.parametrize("where", ["after", "before"])
def test_cli_debug_shows_the_traceback_and_keeps_exit_status_2(ws, capsys, where):
    argv = ["quantize", *_wrong_dim(ws)]
    argv = [*argv, "--debug"] if where == "after" else ["--debug", *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "CalibrationDataError" in err


@pytest.mark.parametrize("flags", [["--per-tensor", "--per-channel"], ["--per-channel", "--per-tensor"]])
def test_cli_argparse_conflict(flags, ws, capsys):
    with pytest.raises(SystemExit) as info:
        main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err
    assert "Traceback" not in err
    assert not ws.out.exists()


@pytest.mark.parametrize(("flags", "words"), [
    (["--batch-size", "0"], ("invalid --batch-size 0",)),
    (["--num-bins", "1"], ("--num-bins 1 with calib_method minmax", "or remove --num-bins")),
    (["--percentile", "200"], ("--percentile 200.0", "use --calib-method percentile", "remove --percentile")),
    (["--activation-type", "int8", "--weight-type", "int9"], ("invalid --weight-type 'int9'",)),
    # one value for two flags of one field: where the error is tells them apart
    (["--activation-type", "int9", "--weight-type", "int9"],
     ("invalid --activation-type 'int9' in global_quant_config.input_tensors",)),
    # a field the error names elsewhere than the flag writes keeps its name: the dtype is the
    # preset's weights', not the activations' the flag set
    (["--preset", "W4A8", "--activation-type", "int8", "--weight-bits", "6"],
     ("--weight-bits 6 with dtype int4 in global_quant_config.weight", "use --weight-type int8/uint8")),
    (["--preset", "W4A8", "--depthwise-weight-type", "int9"], ("invalid --depthwise-weight-type 'int9'",)),
    # float16 weights beside uint8 activations: no kernel computes that mix
    (["--weight-type", "float16"], ("weight dtype float16 with uint8 input_tensors", "float32 to keep the weights")),
    # and float16 activations beside integer weights: the weights were stored float16, unsaid
    (["--activation-type", "float16", "--weight-type", "int4"],
     ("weight dtype int4 with float16 input_tensors", "--weight-type float16", "W4_GROUP128")),
    (["--activation-type", "bfloat16"], ("weight dtype int8 with bfloat16 input_tensors",)),
    (["--preset", "FP16", "--weight-bits", "4"], ("--weight-bits 4 with dtype float16", "remove --weight-bits")),
])
def test_cli_config_errors_name_the_flag_given(flags, words, ws, capsys):
    assert main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), *flags]) == 2
    assert_one_error_line(capsys.readouterr().err, words)
    assert not ws.out.exists()


def test_cli_missing_positional(capsys):
    with pytest.raises(SystemExit) as info:
        main(["quantize", "only_input.onnx"])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_cli_paths_taken_by_a_many_valued_flag_are_pointed_out(capsys):
    """`onnxq quantize --exclude conv1 in.onnx out.onnx`: --exclude took the paths as node
    names and the error said only that input and output were missing (configuration trial)."""
    with pytest.raises(SystemExit) as info:
        main(["quantize", "--exclude", "conv1", "in.onnx", "out.onnx"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "(--exclude takes every value after it: put the paths before --exclude)" in err and err.count("\n") == 1
    for argv in (["quantize", "only_input.onnx"], ["quantize", "in.onnx", "--exclude", "conv1", "--calib-data", "x"],
                 ["compare", "f.onnx", "--providers", "CPUExecutionProvider"]):  # nothing was taken (review)
        with pytest.raises(SystemExit):
            main(argv)
        assert "takes every value" not in capsys.readouterr().err, argv


# ---------------------------------------------------------------------------------------
# Python API


def _api_cases(ws: Workspace):
    data = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
    truncated = ws.root / "t.onnx"
    truncated.write_bytes(ws.model.read_bytes()[:100])
    text = ws.root / "text.onnx"
    text.write_text("hello\n")
    return {
        "truncated": (ModelError, dict(model=truncated, calibration_data={"x": data})),
        "text": (ModelError, dict(model=text, calibration_data={"x": data})),
        "wrong_key": (CalibrationDataError, dict(model=ws.model, calibration_data={"y": data})),
        "wrong_rank": (CalibrationDataError, dict(model=ws.model, calibration_data=[{"x": data[0, 0]}])),
        "wrong_dim": (CalibrationDataError, dict(model=ws.model, calibration_data={"x": data[:, :2]})),
        "int_data": (CalibrationDataError, dict(model=ws.model, calibration_data={"x": data.astype(np.int32)})),
        "empty": (CalibrationDataError, dict(model=ws.model, calibration_data=[])),
        "not_a_feed": (CalibrationDataError, dict(model=ws.model, calibration_data=[data])),
        "no_data": (CalibrationDataError, dict(model=ws.model, calibration_data=None)),
        "out_is_in": (OnnxqError, dict(model=ws.model, output=ws.model, calibration_data={"x": data})),
        "config_key": (ConfigError, dict(model=ws.model, calibration_data={"x": data},
                                         config={"global_quant_config": {"weight": {"symetric": True}}})),
        "config_name": (ConfigError, dict(model=ws.model, calibration_data={"x": data}, config="U8S9")),
    }


@pytest.mark.parametrize("case", ["truncated", "text", "wrong_key", "wrong_rank", "wrong_dim",
                                  "int_data", "empty", "not_a_feed", "no_data", "out_is_in",
                                  "config_key", "config_name"])
def test_api_raises_onnxq_errors(case, ws):
    error, kwargs = _api_cases(ws)[case]
    before = sha256(ws.model)
    with pytest.raises(error) as info:
        onnxq.quantize(**kwargs)
    assert isinstance(info.value, OnnxqError)
    assert "\n" not in str(info.value)
    assert sha256(ws.model) == before


# ---------------------------------------------------------------------------------------
# regressions: these mistakes used to escape as tracebacks instead of one-line errors


def test_cli_corrupt_npz_file(ws, capsys):
    bad = ws.root / "corrupt.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip archive")
    rc = main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(bad)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("corrupt.npz",))


def test_cli_corrupt_npy_in_directory(ws, capsys):
    folder = ws.root / "samples"
    folder.mkdir()
    np.save(folder / "0.npy", np.zeros((3, 16, 16), np.float32))
    (folder / "1.npy").write_bytes(b"\x93NUMPY garbage")
    rc = main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(folder)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("1.npy",))


def test_cli_output_parent_is_a_file(ws, capsys):
    out = ws.model.parent / "model.onnx" / "q.onnx"
    rc = main(["quantize", str(ws.model), str(out), "--calib-data", str(ws.good_data)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("q.onnx",))


@pytest.mark.parametrize("command", ["compare", "analyze", "run"])
@pytest.mark.parametrize("side", [0, 1])
def test_cli_truncated_model_for_commands_that_run_it(ws, capsys, command: str, side: int):
    """compare / analyze / run hand the files to onnxruntime: a truncated one is one line
    (it was onnxruntime's InvalidProtobuf traceback, exit 1)."""
    truncated = ws.root / "truncated.onnx"
    data = ws.model.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    models = [str(ws.model), str(truncated)]
    models = [models[side], models[1 - side]] if command != "run" else [str(truncated)]
    rc = main([command, *models, "--data", str(ws.good_data)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("truncated.onnx", "not a readable ONNX model"))


def test_dequantized_graph_input_is_a_float_model(tmp_path):
    """A uint8 image input turned into float by a DequantizeLinear (scale 1/255) is float
    preprocessing, not an already-quantized model: it quantizes, and the result runs."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["xf"]),
             helper.make_node("Conv", ["xf", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])],
        [numpy_helper.from_array(np.float32(1 / 255), "s"), numpy_helper.from_array(np.uint8(0), "z"),
         numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    data = {"x": rng.integers(0, 256, (8, 3, 8, 8)).astype(np.uint8)}
    result = onnxq.quantize(model, tmp_path / "q.onnx", calibration_data=data, progress=False)
    assert result.summary.quantized_by_op.get("Conv") == 1
    import onnxruntime as ort
    out = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, data)[0]
    assert out.shape == (8, 4, 8, 8) and np.isfinite(out).all()


def test_compare_batch_size(ws, capsys):
    """`--batch-size` reaches the comparison (a static model's figures do not depend on
    it); 0 is one line and exit 2."""
    onnxq.quantize(str(ws.model), str(ws.out), calibration_data=str(ws.good_data), progress=False)
    figures = []
    for size in ("1", "3"):
        assert main(["compare", str(ws.model), str(ws.out), "--data", str(ws.good_data), "--batch-size", size,
                     "--quiet"]) == 0
        figures.append(capsys.readouterr().out)
    assert figures[0] == figures[1] and "SQNR" in figures[0]
    assert main(["compare", str(ws.model), str(ws.out), "--data", str(ws.good_data), "--batch-size", "0"]) == 2
    assert_one_error_line(capsys.readouterr().err, ("--batch-size 0",))


def test_compare_refuses_a_model_of_another_input_shape(ws, capsys):
    """A quantized model whose inputs differ from the float model's (the quantized model
    of another network): one line and exit 2, not onnxruntime's traceback mid-run."""
    onnxq.quantize(str(ws.model), str(ws.out), calibration_data=str(ws.good_data), progress=False)
    larger = conv_relu_chain()  # the same network for 32x32 inputs
    del larger.graph.value_info[:]
    for axis in (2, 3):
        larger.graph.input[0].type.tensor_type.shape.dim[axis].dim_value = 32
    other = save(larger, ws.root / "other.onnx")
    assert main(["compare", str(other), str(ws.out), "--data", str(ws.good_data)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("input 'x'", "float model it came from"))


def test_compare_calls_its_data_evaluation_data(ws, capsys):
    """Errors about compare's data call it evaluation data, not calibration data."""
    onnxq.quantize(str(ws.model), str(ws.out), calibration_data=str(ws.good_data), progress=False)
    data = ws.root / "nhwc.npy"
    np.save(data, np.zeros((4, 16, 16, 3), np.float32))
    assert main(["compare", str(ws.model), str(ws.out), "--data", str(data)]) == 2
    line = assert_one_error_line(capsys.readouterr().err, ("nhwc.npy", "evaluation input 'x'"))
    assert "calibration" not in line
    nan = ws.npz("nan.npz", x=np.full((2, 3, 16, 16), np.nan, np.float32))
    assert main(["compare", str(ws.model), str(ws.out), "--data", str(nan)]) == 2
    line = assert_one_error_line(capsys.readouterr().err, ("NaN", "from the evaluation data"))
    assert "calibration" not in line


def test_an_array_that_is_no_input_is_left_out_whatever_its_length(ws, capsys):
    """A non-input array in the data (labels, ids) is left out with a note, not counted
    against the inputs' samples."""
    data = ws.npz("extra.npz", x=np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32),
                  ids=np.arange(3), temperature=np.array(1.0))
    assert main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(data)]) == 0
    assert "left out ids, temperature (no model input)" in capsys.readouterr().out
    wrong = ws.npz("wrong.npz", image=np.zeros((4, 3, 16, 16), np.float32), ids=np.arange(3))
    assert main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(wrong)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("'x'",))


def test_ranges_and_stats_of_another_pass_setup_are_refused(ws, capsys):
    """Ranges or statistics calibrated without CLE do not fit a run with it (the weights,
    and so the activations, differ): refused in one line, not silently used."""
    ranges, stats = ws.root / "r.json", ws.root / "s.npz"
    base = [str(ws.model), str(ws.out), "--quiet"]
    assert main(["quantize", *base, "--calib-data", str(ws.good_data), "--save-ranges", str(ranges)]) == 0
    assert main(["calibrate", str(ws.model), "--calib-data", str(ws.good_data), "--stats", str(stats),
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["quantize", *base, "--load-ranges", str(ranges), "--cle"]) == 2
    assert_one_error_line(capsys.readouterr().err, ("r.json", "weight-rewriting passes"))
    assert main(["quantize", *base, "--stats", str(stats), "--cle"]) == 2
    assert_one_error_line(capsys.readouterr().err, ("s.npz", "other passes before calibration: --cle"))
    assert main(["quantize", *base, "--load-ranges", str(ranges), "--calib-data", str(ws.good_data)]) == 0


def test_ranges_calibrated_for_another_recipe_are_refused(ws, capsys):
    """A ranges file records each tensor's method, type and symmetry: ranges a run would not
    calibrate (another method, symmetric for asymmetric, an entropy range fit to another
    type) are refused in one line; minmax ranges serve any type, as they are the data's."""
    ranges = ws.root / "r.json"
    base = [str(ws.model), str(ws.out), "--quiet"]
    assert main(["quantize", *base, "--calib-data", str(ws.good_data), "--save-ranges", str(ranges)]) == 0
    capsys.readouterr()
    assert main(["quantize", *base, "--load-ranges", str(ranges), "--calib-method", "entropy"]) == 2
    assert_one_error_line(capsys.readouterr().err, ("r.json", "calibrated uint8 asymmetric minmax",
                                                    "uint8 asymmetric entropy", "--save-ranges under this recipe"))
    assert main(["quantize", *base, "--load-ranges", str(ranges), "--activation-type", "int16"]) == 0  # minmax
    entropy = ws.root / "e.json"
    assert main(["quantize", *base, "--calib-data", str(ws.good_data), "--calib-method", "entropy",
                 "--save-ranges", str(entropy)]) == 0
    capsys.readouterr()
    assert main(["quantize", *base, "--load-ranges", str(entropy), "--calib-method", "entropy",
                 "--activation-type", "int16"]) == 2
    assert_one_error_line(capsys.readouterr().err, ("uint8 asymmetric entropy", "int16"))
    assert main(["quantize", *base, "--load-ranges", str(entropy), "--calib-method", "entropy"]) == 0


@pytest.mark.parametrize("flag", ["--report", "--save-ranges", "--save-config"])
def test_unwritable_side_output_is_refused_before_the_run(ws, capsys, flag):
    blocker = ws.root / "file.txt"
    blocker.write_text("not a folder")
    rc = main(["quantize", str(ws.model), str(ws.out), "--calib-data", str(ws.good_data), flag,
               str(blocker / "x.out")])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("file.txt is a file, not a directory",))
    assert not ws.out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_an_output_that_is_no_file_is_refused_and_kept(ws, capsys):
    """The atomic write renamed its file over a device or pipe given as the output (a
    device node became a 16 KB file; as root, /dev/null would have)."""
    pipe = ws.root / "pipe"
    os.mkfifo(pipe)
    assert main(["quantize", str(ws.model), str(pipe), "--calib-data", str(ws.good_data)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("is a pipe, not a file",))
    assert stat.S_ISFIFO(pipe.stat().st_mode)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_an_output_whose_folder_cannot_be_made_is_refused_before_the_run(ws, capsys):
    """A missing folder under a file system that takes no files (/proc; a read-only mount):
    quantized first, then a PermissionError traceback at the save (new-user trial)."""
    out = Path("/proc/onnxq-no-such-folder/q.onnx")
    assert main(["quantize", str(ws.model), str(out), "--calib-data", str(ws.good_data)]) == 2
    assert_one_error_line(capsys.readouterr().err, (f"cannot write {out}",))


@pytest.mark.parametrize("extra, words", [
    (["--save-ranges", "r.json"], ("--save-ranges has no effect on calibrate",)),
    (["--format", "qoperator"], ("--format has no effect on calibrate",)),
    (["--latency", "--check-samples", "8"], ("--check-samples, --latency have no effect on calibrate",)),
    (["--rung-min-gain", "0"], ("--rung-min-gain has no effect on calibrate",)),
    (["--shards", "0"], ("invalid --shards 0",)),
])
def test_calibrate_refuses_flags_it_would_ignore(ws, capsys, extra, words):
    stats = ws.root / "s.npz"
    rc = main(["calibrate", str(ws.model), "--calib-data", str(ws.good_data), "--stats", str(stats), *extra])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, words)
    assert not stats.exists()


@pytest.mark.parametrize("argv, words", [
    (["quantize", "m.onnx", "o.onnx", "--max-samples", "abc"], ("--max-samples: invalid int value",)),
    (["quantize"], ("required: input, output", "onnxq quantize --help")),
    (["quantise"], ("invalid choice: 'quantise'",)),
])
def test_usage_mistakes_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert_one_error_line(capsys.readouterr().err, words)


def _lookup_model(root: Path) -> Path:
    """ids [N, 4] -> an embedding table of 10 rows -> Relu -> MatMul: ids past 9 cannot run."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Relu", ["e"], ["r"]),
         helper.make_node("MatMul", ["r", "w"], ["y"])],
        "lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 3])],
        [numpy_helper.from_array(rng.standard_normal((10, 8)).astype(np.float32), "table"),
         numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "lookup.onnx")


def test_data_the_model_cannot_run_on_is_one_line(ws, capsys):
    """onnxruntime's refusal of the data (an index past the table, as token ids past a
    vocabulary) is one line naming the node and the batch's shapes, in quantize and
    compare, not its traceback."""
    model = _lookup_model(ws.root)
    good = ws.npz("ids.npz", ids=np.arange(32, dtype=np.int64).reshape(8, 4) % 10)
    bad = ws.npz("ids_bad.npz", ids=np.arange(32, dtype=np.int64).reshape(8, 4) * 10)
    before = sha256(model)
    assert main(["quantize", str(model), str(ws.out), "--calib-data", str(bad)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("cannot run on this calibration data", "ids [8, 4]", "Gather"))
    assert sha256(model) == before and not ws.out.exists()
    assert main(["quantize", str(model), str(ws.out), "--calib-data", str(good), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["compare", str(model), str(ws.out), "--data", str(bad)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("cannot run on this evaluation data", "Gather"))


def test_labels_that_do_not_fit_the_data_are_one_line(ws, capsys):
    """Fewer labels than samples, or one-hot labels: one line with the fix, not numpy's
    broadcasting error; class indices stored as floats are taken."""
    from helpers import image_classifier
    from onnx import helper

    rng = np.random.default_rng(1)
    model = save(image_classifier(
        [helper.make_node("GlobalAveragePool", ["x"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("Gemm", ["f", "w", "b"], ["y"])],
        {"w": rng.standard_normal((3, 10)).astype(np.float32), "b": np.zeros(10, np.float32)}, "classifier"),
        ws.root / "classifier.onnx")
    x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    onnxq.quantize(str(model), str(ws.out), calibration_data={"x": x}, progress=False)
    base = ["compare", str(model), str(ws.out), "--labels", "labels", "--data"]
    assert main([*base, str(ws.npz("short.npz", x=x, labels=np.arange(2)))]) == 2
    assert_one_error_line(capsys.readouterr().err, ("2 labels for 4 evaluation samples",))
    assert main([*base, str(ws.npz("onehot.npz", x=x, labels=np.eye(4)))]) == 2
    assert_one_error_line(capsys.readouterr().err, ("one class index per sample", "argmax(1)"))
    assert main([*base, str(ws.npz("floats.npz", x=x, labels=np.arange(4.0))), "--quiet"]) == 0
    assert main([*base, str(ws.npz("column.npz", x=x, labels=np.arange(4)[:, None])), "--quiet"]) == 0
    assert main([*base, str(ws.npz("binary.npz", x=x, labels=np.arange(4) % 2 == 0)), "--quiet"]) == 0
    assert main([*base, str(ws.npz("shifted.npz", x=x, labels=np.arange(4) + 10))]) == 2  # 10 classes: 0 to 9
    assert_one_error_line(capsys.readouterr().err, ("labels run from 10 to 13, but the model scores 10 classes",))


def test_a_labels_key_not_in_the_eval_data_is_one_line(tmp_path, capsys):
    """--labels naming no array of --eval-data: the arrays there and the nearest name, exit 2
    (before: "metric top1 needs labels", as if none had been given)."""
    models = Path(__file__).resolve().parents[1] / "models"
    args = ["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "q.onnx"), "--calib-data", str(models / "digits_calib.npz"),
            "--accuracy-target", "top1>=float-1", "--eval-data", str(models / "digits_eval.npz"), "--labels", "label"]
    assert main(args) == 2
    assert_one_error_line(capsys.readouterr().err, ("labels 'label' not in the evaluation data", "did you mean 'labels'"))
    assert not (tmp_path / "q.onnx").exists()


def test_compare_with_its_models_swapped_says_so(ws, capsys):
    """A quantized model given as the float one is compared (two quantized models can be
    meant), with a note that the order looks swapped."""
    onnxq.quantize(str(ws.model), str(ws.out), calibration_data=str(ws.good_data), progress=False)
    assert main(["compare", str(ws.out), str(ws.model), "--data", str(ws.good_data), "--quiet"]) == 0
    assert "the first model, taken as the float one, is quantized (DequantizeLinear" in capsys.readouterr().out
    assert main(["compare", str(ws.model), str(ws.out), "--data", str(ws.good_data), "--quiet"]) == 0
    assert "taken as the float one" not in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["OUT", "--save-ranges", "DATA"], "the ranges file (save_ranges) DATA is the calibration data"),
    (["DATA"], "the output model DATA is the calibration data"),
    (["CONFIG", "--config", "CONFIG"], "the output model CONFIG is the config file"),
    (["OUT", "--save-ranges", "OUT"], "the output model and the ranges file (save_ranges) are the same file OUT"),
    (["OUT", "--save-config", "DATA"], "--save-config DATA is the calibration data (--calib-data)"),
    (["OUT", "--report", "DATA"], "the report DATA is the calibration data"),
])
def test_an_output_never_writes_over_what_the_run_reads(tmp_path, capsys, args, says):
    """Every path the run writes (model, ranges, report, saved config) is refused where it
    is a file the run reads (calibration data, config file) or another output: one line,
    exit 2, the file untouched (before: the calibration .npz was replaced, exit 0)."""
    models = Path(__file__).resolve().parents[1] / "models"
    names = {"DATA": tmp_path / "calib.npz", "CONFIG": tmp_path / "c.yaml", "OUT": tmp_path / "q.onnx"}
    names["DATA"].write_bytes((models / "digits_calib.npz").read_bytes())
    names["CONFIG"].write_text("preset: U8S8\n")
    before = {k: v.read_bytes() for k, v in names.items() if v.exists()}
    argv = [str(names.get(a, a)) for a in args]
    assert main(["quantize", str(models / "digits_cnn.onnx"), *argv[:1], "--calib-data", str(names["DATA"]),
                 *argv[1:], "--quiet"]) == 2
    assert_one_error_line(capsys.readouterr().err, (says.replace("DATA", str(names["DATA"])).replace(
        "CONFIG", str(names["CONFIG"])).replace("OUT", str(names["OUT"])),))
    assert {k: v.read_bytes() for k, v in names.items() if v.exists()} == before


@pytest.mark.parametrize("args, says", [
    (["FOLDER/batch_0.npy"], "the output model FOLDER/batch_0.npy is inside the calibration data FOLDER"),
    (["OUT", "--save-ranges", "FOLDER/r.json"], "the ranges file (save_ranges) FOLDER/r.json is inside the "
                                                 "calibration data FOLDER"),
    (["OUT", "--save-ranges", "R", "--save-config", "R"], "--save-config and --save-ranges are the same file R"),
    (["PLUGIN", "--plugin", "PLUGIN"], "the output model PLUGIN is the plugin PLUGIN"),
])
def test_an_output_never_writes_into_a_data_folder_a_plugin_or_another_output(tmp_path, capsys, args, says):
    """A folder of calibration batches, a plugin's source, and --save-config beside
    --save-ranges (new-user trial: each was overwritten, exit 0)."""
    models = Path(__file__).resolve().parents[1] / "models"
    folder = tmp_path / "batches"
    folder.mkdir()
    x = np.load(models / "digits_calib.npz")["input"]
    for i in range(0, len(x), 64):
        np.save(folder / f"batch_{i}.npy", x[i:i + 64])
    names = {"FOLDER": folder, "OUT": tmp_path / "q.onnx", "R": tmp_path / "r.json", "PLUGIN": tmp_path / "plug.py"}
    names["PLUGIN"].write_text("# a plugin that registers nothing\n")
    files = [*folder.iterdir(), names["PLUGIN"]]
    before = {f: f.read_bytes() for f in files}

    def path(a: str) -> str:
        for key, value in names.items():
            a = a.replace(key, str(value))
        return a
    argv = [path(a) for a in args]
    assert main(["quantize", str(models / "digits_cnn.onnx"), argv[0], "--calib-data", str(folder), *argv[1:],
                 "--quiet"]) == 2
    assert_one_error_line(capsys.readouterr().err, (path(says),))
    assert {f: f.read_bytes() for f in files} == before and not names["R"].exists()


def test_the_api_refuses_a_report_over_its_calibration_data(tmp_path):
    models = Path(__file__).resolve().parents[1] / "models"
    data = tmp_path / "calib.npz"
    data.write_bytes((models / "digits_calib.npz").read_bytes())
    with pytest.raises(onnxq.OnnxqError, match="the report .* is the calibration data"):
        onnxq.quantize(str(models / "digits_cnn.onnx"), None, "U8S8", str(data), progress=False, report=str(data))
    assert data.read_bytes() == (models / "digits_calib.npz").read_bytes()


@pytest.mark.parametrize("config, says", [
    ({"global_quant_config": {"weight": {"ch_axis": 5, "qscheme": "per_channel"}}},
     "weight ch_axis 5 of Conv 'conv1': its weight has 4 axes"),
    ({"layer_quant_config": {"conv2": {"weight": {"ch_axis": 1, "qscheme": "per_channel"}}}},
     "weight ch_axis 1 of Conv 'conv2' is not its output-channel axis 0"),
])
def test_a_weight_axis_the_kernels_cannot_take_is_one_line(tmp_path, capsys, config, says):
    """A per-channel weight axis out of range (before: numpy's reshape error) or other than
    the output channels (before: exit 0 and 54% top-1 in a default session, whose fused
    kernel reads one scale per output channel) is refused before anything is written."""
    models = Path(__file__).resolve().parents[1] / "models"
    path = tmp_path / "c.json"
    path.write_text(__import__("json").dumps(config))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(models / "digits_cnn.onnx"), str(out), "--calib-data",
                 str(models / "digits_calib.npz"), "--config", str(path), "--quiet"]) == 2
    assert_one_error_line(capsys.readouterr().err, (says,))
    assert not out.exists()


def test_api_arguments_of_the_wrong_type_are_onnxq_errors(tmp_path):
    """What the Python API is handed in the wrong type is an onnxq error with the fix, not
    a TypeError or AttributeError from inside (a new-user trial); a mapping where a
    QuantizationConfig goes is taken, as a file gives it."""
    models = Path(__file__).resolve().parents[1] / "models"
    model, data = str(models / "digits_cnn.onnx"), str(models / "digits_calib.npz")
    for config in (42, ["U8S8"]):
        with pytest.raises(ConfigError, match="config must be a Config, a dict, a preset name"):
            onnxq.quantize(model, None, config, data, progress=False)
    with pytest.raises(onnxq.OnnxqError, match="model must be a path.*onnx.load_from_string"):
        onnxq.quantize((models / "digits_cnn.onnx").read_bytes(), None, "U8S8", data, progress=False)
    with pytest.raises(ConfigError, match="save_config takes a Config, got str"):
        onnxq.save_config("U8S8", tmp_path / "c.yaml")
    config = onnxq.get_preset("U8S8")
    config.layer_quant_config = {"conv3": {"weight": {"qscheme": "per_tensor"}}}
    by_dict = onnxq.quantize(model, None, config, data, progress=False)
    by_file = tmp_path / "c.yaml"
    by_file.write_text("layer_quant_config:\n  conv3:\n    weight: {qscheme: per_tensor}\n")
    assert by_dict.model.SerializeToString() == onnxq.quantize(model, None, str(by_file), data,
                                                               progress=False).model.SerializeToString()
    onnxq.save_config(config, tmp_path / "new" / "dir" / "c.yaml")  # missing folders made, as for the model
    assert (tmp_path / "new" / "dir" / "c.yaml").is_file()


def test_side_commands_never_write_over_what_they_read(tmp_path, capsys):
    """run --out, analyze --json/--report and calibrate --stats naming the model or the
    data they read (or one another) are refused before anything is written; before, each
    replaced the file (the model became an .npz of its outputs) with exit 0."""
    from onnxq.cli import main

    root = Path(__file__).resolve().parents[1] / "models"
    model, data = tmp_path / "f.onnx", tmp_path / "e.npz"
    model.write_bytes((root / "digits_cnn.onnx").read_bytes())
    data.write_bytes((root / "digits_eval.npz").read_bytes())
    quant = tmp_path / "q.onnx"
    assert main(["quantize", str(model), str(quant), "--calib-data", str(root / "digits_calib.npz"), "--quiet"]) == 0
    before = {p: p.read_bytes() for p in (model, data, quant)}
    for args, words in (
            (["run", str(quant), "--data", str(data), "--out", str(data)], "--out"),
            (["run", str(quant), "--data", str(data), "--out", str(quant)], "is the input model"),
            (["analyze", str(model), str(quant), "--data", str(data), "--json", str(model)], "--json"),
            (["analyze", str(model), str(quant), "--data", str(data), "--report", str(data)], "--report"),
            (["analyze", str(model), str(quant), "--data", str(data), "--json", str(tmp_path / "a"),
              "--report", str(tmp_path / "a")], "are the same file"),
            (["calibrate", str(model), "--calib-data", str(data), "--stats", str(data)], "--stats")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert all(p.read_bytes() == b for p, b in before.items())


@pytest.mark.parametrize("data_name, output_name", [("model.onnx.data", "model.onnx.data"),
                                                    ("q.onnx.data", "q.onnx")])
def test_output_over_the_inputs_external_data_is_refused(tmp_path, capsys, data_name, output_name):
    """An output naming the input's external data file, or one whose own data file
    (`<output>.data`) would be it, is refused before any work: the input stays whole."""
    model = tmp_path / "model.onnx"
    onnx.save_model(conv_relu_chain(), model, save_as_external_data=True, location=data_name, size_threshold=0)
    data = tmp_path / "calib.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32))
    before = sha256(tmp_path / data_name)
    rc = main(["quantize", str(model), str(tmp_path / output_name), "--calib-data", str(data)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("input model's external data file", data_name))
    assert sha256(tmp_path / data_name) == before
    ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def test_a_model_onnxruntime_cannot_run_is_one_line(tmp_path, capsys):
    """A float64 Conv, which onnxruntime's CPU provider has no kernel for: one line naming
    the node and the fix, exit 2 (a raw NOT_IMPLEMENTED from the calibration session before;
    the bfloat16 MatMul this test once used is now quantized as float32, test_half_models.py)."""
    rng = np.random.default_rng(2)
    w32 = onnx.numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w32")
    w64 = onnx.numpy_helper.from_array(rng.standard_normal((8, 4, 1, 1)), "w64")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w32"], ["h"], name="conv"),
         onnx.helper.make_node("Cast", ["h"], ["h64"], to=onnx.TensorProto.DOUBLE, name="cast"),
         onnx.helper.make_node("Conv", ["h64", "w64"], ["y"], name="conv64")], "f64",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 5, 5])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, ["N", 8, 5, 5])], [w32, w64])
    model = save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), tmp_path / "f64.onnx")
    data = tmp_path / "calib.npz"
    np.savez(data, x=rng.standard_normal((8, 4, 5, 5)).astype(np.float32))
    rc = main(["quantize", str(model), str(tmp_path / "q.onnx"), "--calib-data", str(data)])
    assert rc == 2
    assert_one_error_line(capsys.readouterr().err, ("onnxruntime cannot run this model", "Conv", "'conv64'"))
    assert not (tmp_path / "q.onnx").exists()


def test_side_outputs_and_convert_never_write_over_the_inputs_data(tmp_path):
    """The same guard for every output: a ranges file named as the input's external data
    file, and `convert` writing a model whose `<output>.data` would be it, are refused."""
    from onnxq.emit.format_convert import convert_model

    model = tmp_path / "m.onnx"
    onnx.save_model(conv_relu_chain(), model, save_as_external_data=True, location="q.onnx.data", size_threshold=0)
    before = sha256(tmp_path / "q.onnx.data")
    data = {"x": np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)}
    config = onnxq.compose_config("U8S8", None, {"calibration": {"save_ranges": str(tmp_path / "q.onnx.data")}})
    with pytest.raises(OnnxqError, match="side output .* is the input model's external data file"):
        onnxq.quantize(str(model), str(tmp_path / "out.onnx"), config, data)
    with pytest.raises(OnnxqError, match="the data file of output .* is the input model's external data file"):
        convert_model(str(model), str(tmp_path / "q.onnx"), "float")
    assert sha256(tmp_path / "q.onnx.data") == before


@pytest.mark.parametrize("edit, words", [({"max": float("nan")}, ("NaN, or min above max",)),
                                         ({"min": 20.0, "max": 1.0}, ("[20, 1]", "min above max")),
                                         ({"max": None}, ("not two numbers",))])
def test_a_hand_edited_range_that_no_data_has_is_refused(ws, capsys, edit, words):
    """A ranges file edited by hand to a NaN, an inverted range or a missing bound: one line
    naming the tensor (a NaN quantized on scale 1 without a word; a missing key was a raw
    KeyError)."""
    import json

    ranges = ws.root / "r.json"
    base = [str(ws.model), str(ws.out), "--quiet"]
    assert main(["quantize", *base, "--calib-data", str(ws.good_data), "--save-ranges", str(ranges)]) == 0
    doc = json.loads(ranges.read_text())
    name = sorted(doc["tensors"])[-1]
    doc["tensors"][name].update(edit)
    if edit.get("max", 0) is None:
        del doc["tensors"][name]["max"]
    ranges.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["quantize", *base, "--load-ranges", str(ranges), "--calib-data", str(ws.good_data)]) == 2
    assert_one_error_line(capsys.readouterr().err, (repr(name), *words))


def test_a_checker_failure_keeps_the_node_it_names(tmp_path, capsys):
    """onnx puts the node's name and op on lines of their own; the one-line error joins
    them (before: "... however input 'nope' of node: ; fix or re-export the model")."""
    node = onnx.helper.make_node("Relu", ["nope"], ["y"], name="r")
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])])
    path = tmp_path / "invalid.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    assert main(["inspect", str(path)]) == 2
    assert_one_error_line(capsys.readouterr().err, ("input 'nope' of node: name: r OpType: Relu is not output",
                                                   "fix or re-export the model"))


@pytest.mark.parametrize(("argv0", "says"), [("/usr/bin/onnxq", True), ("my_pipeline.py", False)])
def test_ctrl_c_while_the_command_line_starts_is_one_line(argv0, says):
    """Ctrl-C during `onnxq`'s imports (a second or more on a busy machine) printed a
    30-line import traceback (big-model trial): the command line says one line and exits
    130; a program importing onnxq gets its KeyboardInterrupt."""
    import subprocess
    import sys

    code = ("import builtins, sys\n"
            f"sys.argv[0] = {argv0!r}\n"
            "real = builtins.__import__\n"
            "def interrupted(name, *args, **kwargs):\n"
            "    if name == 'onnxq.report':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = interrupted\n"
            "import onnxq\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if says:
        assert done.returncode == 130 and done.stderr.strip() == "onnxq: interrupted", done.stderr[-500:]
    else:
        assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


def test_ctrl_c_while_python_m_onnxq_starts_is_one_line_too(tmp_path):
    """`python -m onnxq` imports the package with sys.argv[0] set to '-m' (review)."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import builtins\nreal = builtins.__import__\n"
        "def interrupted(name, *args, **kwargs):\n"
        "    if name == 'onnxq.report':\n        raise KeyboardInterrupt\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = interrupted\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "onnxq", "presets"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 130 and done.stderr.strip() == "onnxq: interrupted", done.stderr[-500:]
