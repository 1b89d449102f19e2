"""Where no preset is named (no --preset, no `preset:` key, `config=None`), the model's kind
picks the default (`config/defaults.py`): an LLM decoder as deployed (an onnxruntime-genai
folder, or a graph with KV-cache inputs) gets weight-only int8, W8_GROUP128, which beats
static int8 on perplexity and decode speed; every other model gets U8S8, byte for byte as
before. Named presets, `preset: none` included, are untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from genai_model import build_genai_folder, build_genai_model
from helpers import attr, op_count

import onnxq
from onnxq.cli import main
from onnxq.config import config_to_dict, default_preset, get_preset
from onnxq.config.defaults import model_kind
from onnxq.notes import Topic, of

ROOT = Path(__file__).resolve().parents[1]
DIGITS, DIGITS_CALIB = ROOT / "models" / "digits_cnn.onnx", ROOT / "models" / "digits_calib.npz"
GROUP_32 = {"layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_genai_folder(tmp_path_factory.mktemp("genai"), layers=2, kv_heads=2)


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "windows.npz"
    np.savez(path, input_ids=np.random.default_rng(3).integers(0, 256, (6, 16)))
    return path


def decoder_notes(summary) -> list[str]:
    return [n.text for n in of(summary.notes, Topic.CONFIG) if n.text.startswith("decoder default")]


def assert_weight_only_int8(path: Path, block_size: int = 128) -> None:
    model = onnx.load(str(path))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) >= 4 and {attr(n, "bits") for n in nbits} == {8}
    # a tied LM head stores the embedding's table: blocks that divide the hidden size (`plan/tied.py`);
    # a row shorter than the block is one block of the next power of two (`matmul_nbits.row_block`)
    assert all(attr(n, "block_size") == min(block_size, 1 << (attr(n, "K") - 1).bit_length())
               for n in nbits if "lm_head" not in n.name)
    assert all(block_size % attr(n, "block_size") == 0 for n in nbits)
    assert op_count(model, "QuantizeLinear") == op_count(model, "DynamicQuantizeLinear") == 0  # no activation


def test_model_kind():
    assert model_kind(DIGITS) == "model"
    assert model_kind(build_genai_model()) == "decoder"
    assert model_kind(ir.serde.deserialize_model(build_genai_model())) == "decoder"
    assert model_kind(ROOT / "no_such_model.onnx") == "model"  # loading says what is wrong
    assert default_preset(DIGITS) == "U8S8"


def test_decoder_folder_and_file_are_decoders(folder):
    assert model_kind(folder) == model_kind(folder / "model.onnx") == "decoder"
    assert default_preset(folder) == "W8_GROUP128"


def test_api_decoder_without_preset_gets_weight_only_int8(folder, tmp_path):
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), progress=False)
    assert_weight_only_int8(tmp_path / "out" / "model.onnx")
    assert config_to_dict(result.config) == config_to_dict(get_preset("W8_GROUP128"))
    (note,) = decoder_notes(result.summary)
    assert result.summary.notes[0].text == note  # the recipe first
    assert "W8_GROUP128" in note and "--preset W4_GROUP128 --algorithm gptq --calib-data windows.npz" in note
    assert "not needed" not in note  # no data was given


def test_cli_decoder_without_preset_gets_weight_only_int8(folder, windows, tmp_path, capsys):
    """Calibration data given anyway calibrates nothing: the note says so."""
    out = tmp_path / "out"
    assert main(["quantize", str(folder), str(out), "--calib-data", str(windows),
                 "--save-config", str(tmp_path / "used.yaml")]) == 0
    assert_weight_only_int8(out / "model.onnx")
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if "decoder default" in line]
    assert "calibration data (--calib-data, --calib-text) not needed: weight-only int8 calibrates nothing (only the output check used it)" in line
    assert config_to_dict(onnxq.load_config(tmp_path / "used.yaml")) == config_to_dict(get_preset("W8_GROUP128"))


def test_overrides_without_preset_go_over_the_decoder_default(folder, tmp_path, capsys):
    """A dict (or flags) naming no preset: overrides on W8_GROUP128; a bare decoder file
    (KV-cache inputs, no genai_config.json beside it) is a decoder too."""
    model = tmp_path / "decoder.onnx"
    onnx.save(build_genai_model(), model)
    result = onnxq.quantize(str(model), str(tmp_path / "api.onnx"), GROUP_32, progress=False)
    assert_weight_only_int8(tmp_path / "api.onnx", block_size=32)
    assert decoder_notes(result.summary)
    assert main(["quantize", str(folder), str(tmp_path / "cli"), "--per-group", "32"]) == 0
    assert_weight_only_int8(tmp_path / "cli" / "model.onnx", block_size=32)
    assert "decoder default" in capsys.readouterr().out


def test_data_an_algorithm_reads_is_not_called_unneeded(folder, windows, tmp_path):
    """GPTQ over the decoder default reads the windows: the note keeps the 4-bit hint and
    says nothing of unneeded data."""
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), {"algo_config": [{"name": "gptq"}]}, str(windows),
                            progress=False)
    assert_weight_only_int8(tmp_path / "out" / "model.onnx")
    (note,) = decoder_notes(result.summary)
    assert "not needed" not in note


@pytest.mark.parametrize("how", ["cli", "api", "dict"])
def test_named_u8s8_stays_static_int8(folder, windows, tmp_path, capsys, how):
    out = tmp_path / "out"
    if how == "cli":
        assert main(["quantize", str(folder), str(out), "--preset", "U8S8", "--calib-data", str(windows)]) == 0
        assert "decoder default" not in capsys.readouterr().out
    else:
        config = "U8S8" if how == "api" else {"preset": "U8S8", "exclude": ["/lm_head/MatMul"]}
        result = onnxq.quantize(str(folder), str(out), config, str(windows), progress=False)
        assert not decoder_notes(result.summary)
    model = onnx.load(str(out / "model.onnx"))
    assert op_count(model, "QuantizeLinear") > 0 and op_count(model, "MatMulNBits") == 0


def test_named_weight_only_and_no_preset_say_nothing(folder, tmp_path):
    """An explicit W8_GROUP128 is the user's choice, and `preset: none` (the config is
    whole) names no base: neither is the decoder default."""
    result = onnxq.quantize(str(folder), str(tmp_path / "w8"), "W8_GROUP128", progress=False)
    assert not decoder_notes(result.summary)
    whole = config_to_dict(get_preset("W4_GROUP128"))
    result = onnxq.quantize(str(folder), str(tmp_path / "none"), {**whole, "preset": "none"}, progress=False)
    assert not decoder_notes(result.summary)
    nbits = [n for n in onnx.load(str(tmp_path / "none" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert nbits and {attr(n, "bits") for n in nbits} == {4}


def test_other_models_keep_u8s8_byte_for_byte(tmp_path, capsys):
    """The bundled CNN: no preset gives what --preset U8S8 gives, file for file, from the
    command line and from Python."""
    outputs = {name: tmp_path / f"{name}.onnx" for name in ("cli", "cli_u8s8", "api", "api_u8s8")}
    assert main(["quantize", str(DIGITS), str(outputs["cli"]), "--calib-data", str(DIGITS_CALIB), "--quiet"]) == 0
    assert main(["quantize", str(DIGITS), str(outputs["cli_u8s8"]), "--calib-data", str(DIGITS_CALIB),
                 "--preset", "U8S8", "--quiet"]) == 0
    result = onnxq.quantize(DIGITS, outputs["api"], None, DIGITS_CALIB, progress=False)
    onnxq.quantize(DIGITS, outputs["api_u8s8"], "U8S8", DIGITS_CALIB, progress=False)
    digests = {hashlib.sha256(path.read_bytes()).hexdigest() for path in outputs.values()}
    assert len(digests) == 1
    assert not of(result.summary.notes, Topic.CONFIG)
    assert config_to_dict(result.config) == config_to_dict(get_preset("U8S8"))
