"""A model folder in, a folder out: an onnxruntime-genai folder (model.onnx, its external
data, genai_config.json, the tokenizer) quantizes into a folder that holds the quantized
model under the same name and a copy of every other file, and the input is untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import run, sqnr_db
from test_load_runtime import EVAL, decoder_block

import onnxq
from onnxq.cli import main
from onnxq.notes import Topic, of


def genai_folder(folder: Path) -> Path:
    (folder / "extra").mkdir(parents=True)
    onnx.save(decoder_block(), folder / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "extra" / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_genai_folder_quantizes_into_a_folder(tmp_path):
    source = genai_folder(tmp_path / "in")
    before = digests(source)
    out = tmp_path / "out"
    result = onnxq.quantize(str(source), str(out), "W4_GROUP128", progress=False)
    assert digests(source) == before  # never modified
    assert sorted(digests(out)) == ["extra/chat_template.jinja", "genai_config.json", "model.onnx", "tokenizer.json"]
    for name in ("genai_config.json", "tokenizer.json", "extra/chat_template.jinja"):
        assert digests(out)[name] == before[name]
    (copied,) = of(result.summary.notes, Topic.OUTPUT)
    assert set(copied.nodes) == {"extra/chat_template.jinja", "genai_config.json", "tokenizer.json"}
    # The size before counts the external data, not only the 0.4 KB .onnx file.
    data = (source / "model.onnx.data").stat().st_size
    assert result.summary.size_before == (source / "model.onnx").stat().st_size + data
    assert result.summary.quantized_by_op == {"MatMul": 2}
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 2
    assert sqnr_db(run(str(source / "model.onnx"), EVAL), run(str(out / "model.onnx"), EVAL)) > 15


def test_the_cli_takes_folders_and_refuses_the_input_folder(tmp_path, capsys):
    source = genai_folder(tmp_path / "in")
    assert main(["quantize", str(source), str(tmp_path / "out"), "--preset", "W4_GROUP128", "--quiet"]) == 0
    assert (tmp_path / "out" / "model.onnx").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert main(["quantize", str(source), str(source), "--preset", "W4_GROUP128"]) == 2
    err = capsys.readouterr().err
    assert "is the input folder; pass another output folder" in err and err.count("\n") == 1
    before = digests(source)
    assert main(["quantize", str(source), str(source / "sub"), "--preset", "W4_GROUP128"]) == 2
    err = capsys.readouterr().err
    assert "is inside the input folder" in err and err.count("\n") == 1
    assert digests(source) == before and not (source / "sub").exists()


@pytest.mark.parametrize("layout, says", [
    ("two_models", "holds 2 .onnx files; pass the .onnx model file itself"),
    ("no_model", "holds no .onnx file"),
    ("config_names_missing", "names decoder.onnx, which is not in"),
])
def test_a_folder_without_one_clear_model_is_refused(tmp_path, capsys, layout, says):
    folder = tmp_path / "f"
    folder.mkdir()
    if layout == "two_models":
        for name in ("a.onnx", "b.onnx"):
            onnx.save(decoder_block(), folder / name)
    elif layout == "config_names_missing":
        (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "decoder.onnx"}}}))
    assert main(["quantize", str(folder), str(tmp_path / "out"), "--preset", "W4_GROUP128"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_plain_folder_with_one_model_works_too(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    onnx.save(decoder_block(), folder / "net.onnx")
    (folder / "README.txt").write_text("my model")
    calib = {"x": np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)}
    onnxq.quantize(str(folder), str(tmp_path / "q"), "U8S8", calib, progress=False)
    assert (tmp_path / "q" / "net.onnx").is_file() and (tmp_path / "q" / "README.txt").read_text() == "my model"


def test_weights_in_a_sub_folder_stay_behind_and_its_other_files_go_along(tmp_path):
    """onnx.save's one file per weight under a sub-folder: that folder had been copied
    whole into the output (2.3 GB of float weights the int4 model does not name, big-model
    trial). The data files stay behind; another file in the same sub-folder is copied."""
    folder = tmp_path / "plain"
    (folder / "w eights").mkdir(parents=True)
    model = decoder_block()
    for tensor in model.graph.initializer:  # one file per weight, as the trial's exporter wrote them
        if tensor.raw_data:
            (folder / "w eights" / f"{tensor.name}.bin").write_bytes(tensor.raw_data)
            onnx.external_data_helper.set_external_data(tensor, f"w eights/{tensor.name}.bin")
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, folder / "net.onnx")
    data = sorted(p.name for p in (folder / "w eights").iterdir())
    assert data and all((folder / "w eights" / name).is_file() for name in data)
    (folder / "w eights" / "LICENSE").write_text("weights licence")
    before = digests(folder)
    result = onnxq.quantize(str(folder), str(tmp_path / "q"), "W4_GROUP128", progress=False)
    assert digests(folder) == before
    out = tmp_path / "q"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        ["net.onnx", "w eights/LICENSE"]
    (copied,) = of(result.summary.notes, Topic.OUTPUT)
    assert copied.nodes == ("w eights/LICENSE",)
    assert sqnr_db(run(str(folder / "net.onnx"), EVAL), run(str(out / "net.onnx"), EVAL)) > 15


def test_linked_folders_go_along_and_hidden_folders_and_dangling_links_stay(tmp_path):
    """A tokenizer folder linked from elsewhere is copied (review: the file walk had
    dropped it); .git (its LFS objects are the float weights again) and a link to nothing
    are left out, where the link failed the copy after the model was written."""
    shared = tmp_path / "shared_tok"
    shared.mkdir()
    (shared / "tokenizer.json").write_text("{}")
    folder = tmp_path / "plain"
    folder.mkdir()
    onnx.save(decoder_block(), folder / "net.onnx")
    (folder / "tokenizer").symlink_to(shared, target_is_directory=True)
    (folder / ".git" / "lfs").mkdir(parents=True)
    (folder / ".git" / "lfs" / "weights").write_bytes(b"float weights")
    (folder / "gone.txt").symlink_to(tmp_path / "nothing")
    (folder / "loop").symlink_to(folder, target_is_directory=True)
    (folder / "up").symlink_to("..", target_is_directory=True)  # the folder's parent: never walked
    (folder / "vocab").mkdir()
    (folder / "vocab" / "merges.txt").write_text("a b")
    (folder / "another").symlink_to("vocab", target_is_directory=True)  # sorts first: both go along
    (folder / ".net.onnx.tmp12345").write_bytes(b"a killed run's leftover")
    out = tmp_path / "q"
    result = onnxq.quantize(str(folder), str(out), "W4_GROUP128", progress=False)
    (copied,) = of(result.summary.notes, Topic.OUTPUT)
    assert copied.nodes == ("another/merges.txt", "tokenizer/tokenizer.json", "vocab/merges.txt")
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}" and not (out / ".git").exists()


def test_a_replaced_models_external_data_is_removed_never_the_inputs(tmp_path):
    """Writing over a folder that holds another model removes that model's external data
    file the new model does not use (it would sit there stale), and says so; the input's
    files are never touched, even where the old output named them."""
    source = genai_folder(tmp_path / "in")
    small = tmp_path / "small"
    assert main(["quantize", str(source), str(small), "--preset", "W4_GROUP128", "--quiet"]) == 0
    assert not (small / "model.onnx.data").exists()  # small enough to keep its weights inline
    old = tmp_path / "old"
    old.mkdir()
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        (old / name).write_bytes((source / name).read_bytes())
    before = digests(small)
    result = onnxq.quantize(str(small), str(old), "W4_GROUP128", progress=False)
    assert not (old / "model.onnx.data").exists() and digests(small) == before
    assert any(n.startswith("removed model.onnx.data: external data of the model.onnx this run wrote over")
               for n in result.summary.note_texts)
    assert sqnr_db(run(str(source / "model.onnx"), EVAL), run(str(old / "model.onnx"), EVAL)) > 15  # runs without it
    # an output whose old version named the input's own data file: that file stays
    beside = tmp_path / "beside"
    beside.mkdir()
    onnx.save(decoder_block(), beside / "in.onnx", save_as_external_data=True, location="shared.data",
              size_threshold=0)
    (beside / "out.onnx").write_bytes((beside / "in.onnx").read_bytes())  # names shared.data too
    data = (beside / "shared.data").read_bytes()
    onnxq.quantize(str(beside / "in.onnx"), str(beside / "out.onnx"), "W4_GROUP128", progress=False)
    assert (beside / "shared.data").read_bytes() == data
    # nor a file another model in the folder reads
    shared = tmp_path / "shared"
    shared.mkdir()
    onnx.save(decoder_block(), shared / "a.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    (shared / "b.onnx").write_bytes((shared / "a.onnx").read_bytes())
    onnxq.quantize(str(source / "model.onnx"), str(shared / "b.onnx"), "W4_GROUP128", progress=False)
    assert (shared / "w.data").is_file() and run(str(shared / "a.onnx"), EVAL) is not None


@pytest.mark.parametrize("reader", ["onnx", "onnx_ir"])
def test_a_model_in_memory_keeps_the_data_files_it_names(tmp_path, monkeypatch, reader):
    """A model passed in memory with its weights still in external files (read from the
    working folder) keeps them, even where the model written over named them too."""
    folder = tmp_path / "mem"
    folder.mkdir()
    onnx.save(decoder_block(), folder / "in.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    proto = onnx.load(folder / "in.onnx", load_external_data=False) if reader == "onnx" else \
        __import__("onnx_ir").load(folder / "in.onnx")
    (folder / "in.onnx").rename(folder / "out.onnx")  # the file written over names w.data, as the proto does
    data = (folder / "w.data").read_bytes()
    monkeypatch.chdir(folder)
    result = onnxq.quantize(proto, str(folder / "out.onnx"), "W4_GROUP128", progress=False)
    assert (folder / "w.data").read_bytes() == data
    assert not any(n.startswith("removed") for n in result.summary.note_texts)


def test_a_data_file_the_system_will_not_delete_stays(tmp_path, monkeypatch):
    source = genai_folder(tmp_path / "in")
    old = tmp_path / "old"
    old.mkdir()
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        (old / name).write_bytes((source / name).read_bytes())

    unlink = Path.unlink

    def refuse(self, *args, **kwargs):
        if self.name == "model.onnx.data":
            raise PermissionError(f"read-only: {self}")
        return unlink(self, *args, **kwargs)
    monkeypatch.setattr(Path, "unlink", refuse)
    result = onnxq.quantize(str(source), str(old), "W4_GROUP128", progress=False)
    assert (old / "model.onnx.data").exists() and not any(n.startswith("removed") for n in result.summary.note_texts)
    assert run(str(old / "model.onnx"), EVAL) is not None


def test_inspect_run_and_compare_take_model_folders(tmp_path, capsys):
    """The commands that look at models take a folder where `quantize` does (its model file)."""
    source = genai_folder(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["quantize", str(source), str(out), "--preset", "W4_GROUP128", "--quiet"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert f"model: {out / 'model.onnx'}" in capsys.readouterr().out
    assert main(["inspect", str(source)]) == 0  # the folder's default preset, as quantize picks it: a decoder's
    printed = capsys.readouterr().out
    assert "preset: W8_GROUP128 (this model's default" in printed and "would quantize: 2 nodes (MatMul 2)" in printed
    assert "MatMul x2: matmul_nbits (int8, blocks of 64)" in printed  # how stored: K = 64, one block per row
    data = tmp_path / "eval.npz"
    np.savez(data, **EVAL)
    assert main(["run", str(out), "--data", str(data)]) == 0
    assert main(["compare", str(source), str(out), "--data", str(data)]) == 0
    assert "SQNR" in capsys.readouterr().out
    (tmp_path / "two").mkdir()
    for name in ("a.onnx", "b.onnx"):
        onnx.save(decoder_block(), tmp_path / "two" / name)
    assert main(["inspect", str(tmp_path / "two")]) == 2  # which model is meant: one line, exit 2
    err = capsys.readouterr().err.strip()
    assert "holds 2 .onnx files; pass the .onnx model file itself" in err and "\n" not in err
