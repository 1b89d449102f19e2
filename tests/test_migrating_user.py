"""What a user coming from onnxruntime.quantization met (a trial with their own readers,
models and scripts): each case as they would hit it, with the one-line answer onnxq owes
them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import sqnr_db

import onnxq
from onnxq.cli import main
from onnxq.errors import CalibrationDataError, ConfigError, ModelError

MODELS = Path(__file__).resolve().parent.parent / "models"
MODEL = str(MODELS / "digits_cnn.onnx")
CALIB = np.load(MODELS / "digits_calib.npz")["input"]


class EmptyBatches:
    """A reader whose every batch has no sample (a filter that dropped everything)."""

    def __init__(self) -> None:
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        self.i += 1
        return {"input": CALIB[:0]} if self.i <= 4 else None


@pytest.mark.parametrize("data", [EmptyBatches(), [{"input": CALIB[:0]}] * 4, {"input": CALIB[:0]}],
                         ids=["reader", "feeds", "arrays"])
def test_data_of_empty_batches_is_the_same_one_line_error(tmp_path, data):
    """A reader of empty batches wrote a model calibrated on nothing (6.7 dB); a list of
    them gave a raw numpy ValueError."""
    with pytest.raises(CalibrationDataError, match="calibration data is empty"):
        onnxq.quantize(MODEL, tmp_path / "q.onnx", "U8S8", data, progress=False)
    assert not (tmp_path / "q.onnx").exists()


def test_a_reader_that_raises_is_named_with_the_item():
    class Broken:
        def __init__(self) -> None:
            self.i = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            self.i += 1
            if self.i == 3:
                raise OSError("image 17.jpg: truncated file")
            return {"input": CALIB[:8]} if self.i < 6 else None

    with pytest.raises(CalibrationDataError) as caught:
        onnxq.quantize(MODEL, None, "U8S8", Broken(), progress=False)
    message = str(caught.value)
    assert "Broken's get_next() raised OSError on item 3: image 17.jpg: truncated file" in message
    assert len(message.splitlines()) == 1 and isinstance(caught.value.__cause__, OSError)

    def feeds():
        yield {"input": CALIB[:8]}
        raise ValueError("bad row")

    with pytest.raises(CalibrationDataError, match="calibration generator raised ValueError on item 2: bad row"):
        onnxq.quantize(MODEL, None, "U8S8", feeds(), progress=False)


def test_a_proto_loaded_without_its_external_data_is_one_line(tmp_path, monkeypatch):
    onnx.save(onnx.load(MODEL), tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    proto = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    with pytest.raises(ModelError, match="external data \\(m.onnx.data\\).*onnx.load\\(path\\)"):
        onnxq.quantize(proto, None, "U8S8", CALIB, progress=False)
    monkeypatch.chdir(tmp_path)  # where the file is found from the working directory, it is read as before
    assert onnxq.quantize(proto, None, "U8S8", {"input": CALIB}, progress=False).summary.fidelity.sqnr_db > 30


def test_onnxruntimes_qdq_model_converts_to_qoperator(tmp_path, capsys):
    """onnxruntime's quantize_static leaves its intermediate tensors untyped: convert made
    nothing of it, saying an input was not 8-bit; it now infers their types first."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input": CALIB[i:i + 8]} for i in range(0, 128, 8)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    logging.disable(logging.WARNING)
    try:
        quantize_static(MODEL, str(tmp_path / "ort.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    finally:
        logging.disable(logging.NOTSET)
    assert main(["convert", str(tmp_path / "ort.onnx"), str(tmp_path / "qop.onnx"), "--to", "qoperator"]) == 0
    assert "QLinearConv 3" in capsys.readouterr().out
    feed = {"input": np.load(MODELS / "digits_eval.npz")["input"][:64]}
    qdq, qop = (ort.InferenceSession(str(tmp_path / p), providers=["CPUExecutionProvider"]).run(None, feed)[0]
                for p in ("ort.onnx", "qop.onnx"))
    assert sqnr_db(qdq, qop) > 30


@pytest.mark.parametrize("value", ["0.99999", "10", "101"])
def test_a_percentile_out_of_range_names_the_one_range(tmp_path, capsys, value):
    """0.99999 (a fraction) and 10 were refused as "must be in [50, 100]" and 101 as "use a
    value in (0, 100]": one range, in percent, named with the flag."""
    args = ["quantize", MODEL, str(tmp_path / "q.onnx"), "--calib-data", str(MODELS / "digits_calib.npz"),
            "--calib-method", "percentile", "--percentile", value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--percentile" in err and "[50, 100]" in err and "not a fraction" in err
    with pytest.raises(ConfigError, match=r"\[50, 100\]"):
        onnxq.compose_config("U8S8", None, {"global_quant_config": {"input_tensors": {
            "calib_method": "percentile", "percentile": float(value)}}})


def test_a_float_node_beside_qoperator_kernels_is_not_called_qdq(tmp_path):
    """Add kept float by config read a quantized Conv's output: the qoperator note listed it
    as "kept as Q/DQ"."""
    config = onnxq.compose_config("U8S8", None, {"quant_format": "qoperator", "float_op_types": ["Add"]})
    result = onnxq.quantize(MODEL, tmp_path / "q.onnx", config, str(MODELS / "digits_calib.npz"), progress=False)
    note = next(n for n in result.summary.note_texts if n.startswith("qoperator format"))
    assert "kept as Q/DQ" not in note and "QLinearConv" in note


def test_onnxruntimes_argument_names_in_a_config_file_name_onnxqs(tmp_path, capsys):
    """`activation_type` was answered "did you mean 'fuse_activations'?"."""
    (tmp_path / "c.yaml").write_text("activation_type: QUInt8\n")
    assert main(["config", "show", "--config", str(tmp_path / "c.yaml")]) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert out == ""  # no header of a config that was refused (a redirect got a file of one comment)
    assert len(err.splitlines()) == 1 and "onnxruntime.quantization's name" in err
    assert "input_tensors.dtype" in err and "fuse_activations" not in err
    with pytest.raises(ConfigError, match="weight.qscheme: per_channel"):
        onnxq.compose_config("U8S8", None, {"per_channel": True})


def test_config_show_redirected_reads_back_to_the_same_files(tmp_path, capsys, monkeypatch):
    """A file's relative paths read against its folder; `config show` printed them relative
    to the working directory, so its output saved elsewhere (as the docs do) pointed at
    out/out/r8.json. It prints them absolute."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "digits.yaml").write_text("calibration: {load_ranges: r8.json}\n")
    assert main(["config", "show", "--config", "out/digits.yaml"]) == 0
    (tmp_path / "out" / "resolved.yaml").write_text(capsys.readouterr().out)
    again = onnxq.load_config(tmp_path / "out" / "resolved.yaml").calibration.load_ranges
    assert Path(again) == tmp_path / "out" / "r8.json"


def test_round_to_nearest_over_a_files_gptq_switches_it_off(tmp_path, capsys):
    (tmp_path / "g.yaml").write_text("preset: W4_GROUP128\nalgo_config: [{name: gptq}]\n")
    assert main(["config", "show", "--config", str(tmp_path / "g.yaml"), "--algorithm", "rtn"]) == 0
    import yaml

    assert yaml.safe_load(capsys.readouterr().out)["algo_config"] == [{"name": "gptq", "enabled": False}]
