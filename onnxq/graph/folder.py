"""Model folders: an onnxruntime-genai folder (model.onnx, its external data,
genai_config.json, the tokenizer) or any folder holding one .onnx model. A folder in gives
a folder out: the quantized model under the same file name, beside a copy of every other
file the folder holds, so the output deploys as the input did."""

from __future__ import annotations

import filecmp
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from onnxq.errors import ModelError
from onnxq.graph.data_files import data_files, external_locations, model_data_files
from onnxq.graph.genai_names import GENAI_CONFIG
from onnxq.graph.save import copy_atomic


@dataclass(frozen=True)
class ModelFolder:
    """A folder with one model: its `.onnx` file, the external data files that model names
    (relative to the folder), and every other file it holds, sub-folders' included
    (`companions`, relative paths)."""

    folder: Path
    model: Path
    data_files: tuple[str, ...]
    companions: tuple[str, ...]

    @property
    def genai(self) -> bool:
        return (self.folder / GENAI_CONFIG).is_file()


def genai_settings(folder: Path) -> dict:
    """The `model` section of `folder`'s genai_config.json ({} without a readable one)."""
    try:
        settings = json.loads((folder / GENAI_CONFIG).read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _genai_model_name(folder: Path) -> str:
    """The decoder's file name in an onnxruntime-genai folder (`model.decoder.filename`)."""
    try:
        json.loads((folder / GENAI_CONFIG).read_text(encoding="utf-8"))
    except ValueError as exc:  # said as what it is (LLM trial: "names no model file")
        raise ModelError(f"{folder / GENAI_CONFIG} is not valid JSON ({exc}); fix the file or pass the .onnx model "
                         "itself") from None
    except OSError:
        pass  # unreadable: said below
    decoder = genai_settings(folder).get("decoder")
    name = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(name, str):
        raise ModelError(f"{folder / GENAI_CONFIG} names no model file (model.decoder.filename); fix the file or "
                         "pass the .onnx model itself")
    return name


def open_folder(path: str | os.PathLike) -> ModelFolder | None:
    """The model folder at `path`, or None when `path` is not a folder (a model file)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    if (folder / GENAI_CONFIG).is_file():
        model = folder / _genai_model_name(folder)
        if not model.is_file():
            raise ModelError(f"{folder / GENAI_CONFIG} names {model.name}, which is not in {folder}; pass a complete "
                             "onnxruntime-genai model folder")
    else:
        models = sorted(folder.glob("*.onnx"))
        if len(models) != 1:
            found = "no .onnx file" if not models else f"{len(models)} .onnx files"
            raise ModelError(f"{folder} holds {found}; pass the .onnx model file itself (or a folder with one model, "
                             f"or an onnxruntime-genai folder with {GENAI_CONFIG})")
        model = models[0]
    data = model_data_files(model)
    return ModelFolder(folder, model, data, _companions(folder, model, data))


def _companions(folder: Path, model: Path, data: tuple[str, ...]) -> tuple[str, ...]:
    """Every file under `folder` but the model and the data files it names, as paths
    relative to the folder: a sub-folder of the float model's weights ("weights/w0.bin")
    stays behind, where it had been copied whole (2.3 GB beside a 324 MB int4 model,
    big-model trial); the tokenizer and anything else beside them goes along, through
    linked folders too. Left out: hidden folders (.git, whose LFS objects are the float
    weights again; .cache), links to nothing, an atomic write's leftovers (`.name.tmpPID`),
    and linked folders that lead back up the path (the folder itself, its parents, a
    folder the walk is already inside)."""
    skip = {model.resolve(), *((folder / name).resolve() for name in data)}
    found: list[str] = []

    def walk(here: Path, relative: str, inside: frozenset[Path]) -> None:
        for entry in sorted(os.scandir(here), key=lambda e: e.name):
            path, name = Path(entry.path), f"{relative}{entry.name}"
            if entry.is_dir():
                real = path.resolve()
                if not entry.name.startswith(".") and real not in inside:
                    walk(path, f"{name}/", inside | {real})
            elif entry.is_file() and path.resolve() not in skip and not TEMPORARY.fullmatch(entry.name):
                found.append(name)

    root = folder.resolve()
    walk(folder, "", frozenset({root, *root.parents}))
    return tuple(sorted(found))


# An atomic write's temporary file or folder (`graph.save`), left by a killed run.
TEMPORARY = re.compile(r"\..+\.tmp\d+(\.d)?")


def output_model(source: ModelFolder, output: str | os.PathLike) -> Path:
    """Where the quantized model of `source` goes when `output` is a folder: the same file
    name inside it. The input folder itself is refused (never overwrite the input)."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out} is a file; a model folder in gives a folder out: pass a folder path")
    if out.exists() and out.resolve() == source.folder.resolve():
        raise ModelError(f"{out} is the input folder; pass another output folder (the input is never overwritten)")
    if source.folder.resolve() in out.resolve().parents:  # it would be written into the input folder
        raise ModelError(f"{out} is inside the input folder {source.folder}; pass a folder outside it (the input "
                         "is never written)")
    return out / source.model.name


def output_folder_before(source: ModelFolder, out_folder: Path) -> tuple[list[str], list[str]]:
    """What `out_folder` held before a run writes `source`'s folder into it: the companions
    whose content the copy will change (a user's own genai_config.json; a rerun's identical
    copies are not listed), and the entries of its top level the input folder does not
    have, left as they are (LLM trial: both had happened without a word)."""
    if not out_folder.is_dir():
        return [], []
    changed = [name for name in source.companions if (out_folder / name).is_file()
               and not _same_content(source.folder / name, out_folder / name)]
    written = (source.model.name, f"{source.model.name}.data")  # the model and the data file a save may write
    ours = {Path(name).parts[0] for name in (*source.companions, *written, *source.data_files)}
    others = sorted(p.name for p in out_folder.iterdir() if p.name not in ours and not p.name.startswith("."))
    return changed, others


def _same_content(a: Path, b: Path) -> bool:
    """Whether files `a` and `b` hold the same bytes (compared in chunks, not read whole)."""
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def copy_companions(source: ModelFolder, out_folder: Path) -> list[str]:
    """Copy every file of the input folder but the model and its data into `out_folder`
    (in their sub-folders); the paths copied."""
    out_folder.mkdir(parents=True, exist_ok=True)
    for name in source.companions:
        dst = out_folder / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        copy_atomic(source.folder / name, dst)
    return list(source.companions)


def remove_replaced_data(model: str | os.PathLike, before: tuple[str, ...], keep: Iterable[str] = (),
                         source: str | os.PathLike | onnx.ModelProto | ir.Model | None = None) -> list[str]:
    """Delete the external data files of the model that `model` replaced (`before`: what
    it named) that the new model does not name and nothing in `keep` was copied as: left,
    a float model's 540 MB of weights would sit beside its int4 replacement. The input
    model `source` and its data (a model in memory: the files it names), and files another
    model in the folder names, are never touched; a file the system will not delete stays.
    The names removed."""
    path = Path(model)
    stale = set(before) - set(model_data_files(path)) - set(keep)
    if stale:  # another model beside it may read the same file
        stale -= {name for other in path.parent.glob("*.onnx") if other.resolve() != path.resolve()
                  for name in data_files(other)}
    stale = sorted(stale - set(external_locations(source)))
    inputs = set()
    if isinstance(source, str | os.PathLike) and Path(source).is_file():
        inputs = {Path(source).resolve(), *((Path(source).parent / n).resolve() for n in data_files(source))}
    removed = []
    for name in stale:
        target = path.parent / name
        if target.is_file() and target.resolve().parent == path.parent.resolve() and target.resolve() not in inputs:
            try:
                target.unlink()
            except OSError:  # read-only, or in use: the new model does not need it either way
                continue
            removed.append(name)
    return removed


def on_disk_bytes(model: str | os.PathLike) -> int:
    """A saved model's size with the external data files it names."""
    path = Path(model)
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in model_data_files(path)
                                     if (path.parent / name).is_file())
