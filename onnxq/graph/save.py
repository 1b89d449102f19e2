"""Save a model atomically: write a temporary file beside the target, then rename."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxq.errors import OnnxqError
from onnxq.graph import wire
from onnxq.graph.data_files import data_files
from onnxq.graph.genai_names import GENAI_CONFIG

# Weights above this size go to an external data file (protobuf cannot exceed 2 GB).
EXTERNAL_DATA_LIMIT = 1800 * 1024 * 1024


def check_output_path(output: str | os.PathLike, source: str | os.PathLike | None, what: str = "output") -> Path:
    """Refuse to overwrite the input model, and an output that cannot be written (before
    the work, not after it). A string ending in a separator names a folder, which a file
    output is not (a `Path` has dropped the separator already: it is taken as a file)."""
    out = Path(output)
    if str(output).endswith(("/", os.sep)) and not out.is_dir():
        fix = ", or pass a model folder as the input to get a folder out" if what == "output" else ""
        raise OnnxqError(f"{what} {output} ends in a separator, as a folder does; give a file path{fix}")
    try:
        _check_writable(out, source, what)
    except OSError as exc:  # a name too long, a special file system
        raise OnnxqError(f"cannot write {out}: {exc.strerror or exc}; choose another output path") from None
    return out


def _check_writable(out: Path, source: str | os.PathLike | None, what: str) -> None:
    if source is not None and isinstance(source, str | os.PathLike):
        src = Path(source)
        if _same_file(out, src):
            raise OnnxqError(f"output {out} is the input model; choose another output path")
        _check_not_input_data(out, src, what)
    if out.is_dir():
        name = "model.int8.onnx"
        if source is not None and (Path(source).parent / GENAI_CONFIG).is_file():  # a genai folder's model
            raise OnnxqError(f"output {out} is a directory; to get an onnxruntime-genai folder out, pass the model's "
                             f"folder {Path(source).parent} as the input, else give a file name such as {out / name}")
        raise OnnxqError(f"output {out} is a directory; give a file name such as {out / name}")
    if out.exists() and not out.is_file():  # the atomic rename would put a file in place of a device or pipe
        raise OnnxqError(f"output {out} is {_kind(out)}, not a file; give a file path (onnxq writes a new file "
                         "in its place)")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise OnnxqError(f"cannot write {out}: {parent} is a file, not a directory; choose another output path")
    if parent is not None and not os.access(parent, os.W_OK):
        raise OnnxqError(f"cannot write {out}: {parent} is not writable; choose another output path")
    if parent is not None:  # try it where the file, or the folders to make for it, will go
        probe = _temporary(parent / out.name)
        try:
            probe.touch()
        finally:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)


def _kind(path: Path) -> str:
    """What a path that is neither a file nor a directory is."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((text for test, text in kinds if test(mode)), "not a regular file")


def _check_not_input_data(out: Path, source: Path, what: str) -> None:
    """Refuse an output that would write over an external data file of the input model: the
    output itself, or the data file saved beside it (`<output>.data`)."""
    for name in data_files(source):
        data = source.parent / name
        for written in (out, out.with_name(f"{out.name}.data")):
            if _same_file(written, data):
                which = what if written == out else f"the data file of {what}"
                raise OnnxqError(f"{which} {written} is the input model's external data file {name}; choose another "
                                 "output path (the input is never overwritten)")


def check_output_paths(source: str | os.PathLike | None, *paths: str | os.PathLike | None) -> None:
    """`check_output_path` for each side output given (reports, JSON, ranges), before the
    work that writes them, not after it."""
    for path in paths:
        if path is not None:
            check_output_path(path, source, "side output")


def check_apart(outputs: Mapping[str, str | os.PathLike | None], inputs: Mapping[str, object]) -> None:
    """No output is a file the run reads (`inputs`: the calibration data, the config file,
    ...; values that are not paths are skipped), and no two outputs are one file: each
    would be overwritten, the input lost or one output in place of another."""
    given = [(label, path) for label, path in outputs.items() if path is not None]
    for label, out in given:
        for what, source in inputs.items():
            if isinstance(source, str | os.PathLike) and _same_file(out, source):
                raise OnnxqError(f"{label} {out} is {what}; choose another path (onnxq never writes over what it "
                                 "reads)")
            if isinstance(source, str | os.PathLike) and _inside(out, source):
                raise OnnxqError(f"{label} {out} is inside {what} {source}, whose files the run reads; choose a path "
                                 "outside that folder (onnxq never writes over what it reads)")
    for i, (label, out) in enumerate(given):
        for other, path in given[i + 1:]:
            if _same_file(out, path):
                raise OnnxqError(f"{label} and {other} are the same file {out}; give each its own path")


def _inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether `path` lies in the existing directory `folder` (or below it)."""
    try:
        return Path(folder).is_dir() and Path(path).resolve().is_relative_to(Path(folder).resolve())
    except OSError:
        return False


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    first, second = Path(a), Path(b)
    try:
        return first.resolve() == second.resolve() or (first.exists() and second.exists() and first.samefile(second))
    except OSError:  # a name the system refuses: its own error comes when it is written
        return False


def _write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` then rename tmp to `path`: an interrupted run (Ctrl-C) leaves the old
    file or none, never half of one."""
    out = Path(path)
    tmp = _temporary(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as the model's own output does
        write(tmp)
        os.replace(tmp, out)
    except OSError as exc:
        raise OnnxqError(f"cannot write {out}: {exc.strerror or exc}; choose another output path") from None
    finally:
        with contextlib.suppress(OSError):  # gone, or never made (a name too long)
            tmp.unlink(missing_ok=True)
    return out


def _temporary(out: Path) -> Path:
    """The file an atomic write of `out` goes through (renamed over `out` when complete)."""
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


# A temporary file or folder untouched this long may be a dead run's (a live write
# touches it continuously); younger ones may be another host's or container's, whose
# process this one cannot see.
STALE_SECONDS = 600


def clear_stale(out: Path) -> list[str]:
    """Remove the temporary files and folders of earlier writes of the model `out` whose
    process is gone and which nothing touched for `STALE_SECONDS`: SIGKILL or the
    out-of-memory killer skips the cleanup, and a rerun had left a 20 MB
    `.q.onnx.tmp31602` beside the new model (big-model trial). Run once per model write
    (not per companion file: a glob each). The names removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in out.parent.glob(f".{glob.escape(out.name)}.tmp*"):
            pid = re.fullmatch(rf"\.{re.escape(out.name)}\.tmp(\d+)(\.d)?", path.name)
            if pid is None or int(pid.group(1)) == os.getpid() or _alive(int(pid.group(1))) or _recent(path):
                continue
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                removed.append(path.name)
    return removed


def _recent(path: Path) -> bool:
    """Whether `path`, or a file in it, changed within `STALE_SECONDS`."""
    newest = max([path.lstat().st_mtime, *(p.lstat().st_mtime for p in path.iterdir())] if path.is_dir()
                 and not path.is_symlink() else [path.lstat().st_mtime])
    return time.time() - newest < STALE_SECONDS


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts; off POSIX, where
    os.kill would end it, every one counts as alive)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically."""
    return _write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def copy_atomic(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Copy the file `source` to `path` atomically (metadata too)."""
    return _write_atomic(path, lambda tmp: shutil.copy2(source, tmp))


def write_npz_atomic(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write `arrays` as an .npz file atomically."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
    return _write_atomic(path, write)


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model(model: ir.Model, output: str | os.PathLike, serialized: bytes | None = None) -> Path:
    """Write `model` to `output` atomically; large models get `<name>.data` beside them.
    `serialized`: the model's bytes as `write_model` writes them, where a session already
    serialized it whole (`calibrate.session.open_session`)."""
    out = Path(output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked before the work (`check_output_path`); changed since
        raise OnnxqError(f"cannot make the folder {out.parent}: {exc.strerror or exc}; choose another output "
                         "path") from None
    clear_stale(out)
    if weight_bytes(model) > EXTERNAL_DATA_LIMIT:
        return _save_with_data(model, out)
    return _write_atomic(out, lambda tmp: write_model(model, tmp, serialized))


def _save_with_data(model: ir.Model, out: Path) -> Path:
    """The model and its `<name>.data` written in a private folder beside `out`, then moved
    into place: the old model file goes first, then the weights, then the new model file,
    so an interrupted run leaves the old pair, no model file, or the new pair, never a
    model reading another run's weights (they were written straight to their final name)."""
    folder = out.with_name(f".{out.name}.tmp{os.getpid()}.d")
    folder.mkdir(exist_ok=True)
    try:
        ir.save(model, folder / out.name, external_data=f"{out.name}.data")
        out.unlink(missing_ok=True)
        os.replace(folder / f"{out.name}.data", out.with_name(f"{out.name}.data"))
        os.replace(folder / out.name, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# Weights from this size on are written straight from their buffers (`write_model`).
STREAM_MIN_BYTES = 1 << 10


class _Hollow:
    """A tensor's name, type and shape without its data: onnx-ir serializes it with an
    empty raw_data, which `wire.write_filled` fills from the real tensor."""

    def __init__(self, tensor: ir.TensorProtocol) -> None:
        self.name, self.dtype, self.shape = tensor.name, tensor.dtype, tensor.shape
        self.doc_string, self.metadata_props = tensor.doc_string, tensor.metadata_props

    def tobytes(self) -> bytes:
        return b""


@contextlib.contextmanager
def tensors_replaced(
    graph: ir.Graph, replace: Callable[[ir.TensorProtocol], object | None]
) -> Iterator[dict[str, ir.TensorProtocol]]:
    """While the block runs, each initializer of `graph` for which `replace(tensor)` gives
    a stand-in holds that stand-in (to serialize the model without copying those weights);
    yields the replaced tensors by name and puts them back after."""
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    try:
        for value in graph.initializers.values():
            tensor = value.const_value
            stand_in = None if tensor is None else replace(tensor)
            if stand_in is not None:
                swapped.append((value, tensor))
                value.const_value = stand_in
        yield {value.name: tensor for value, tensor in swapped}
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def _streamable(tensor: ir.TensorProtocol) -> _Hollow | None:
    if tensor.nbytes < STREAM_MIN_BYTES or tensor.dtype == ir.DataType.STRING:
        return None
    return _Hollow(tensor)


def _small_external(tensor: ir.TensorProtocol) -> ir.Tensor | None:
    """A small weight still in the input's data file, read into memory: serialized as it
    is, it would name that file, which is not beside the output."""
    if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes < STREAM_MIN_BYTES:
        return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name)
    return None


def write_model(model: ir.Model, path: str | os.PathLike, serialized: bytes | None = None) -> None:
    """Write `model` as one .onnx file without building its weights into one protobuf
    message: the structure is serialized by onnx-ir with the weights hollow, then each
    weight's bytes go to the file from its own buffer (SmolLM2 int4: 1.1 s -> 0.2 s, and
    no second copy of the weights in memory). The bytes are those `onnx.save` writes.
    `serialized`: those bytes, where a session serialized the model whole already."""
    if serialized is not None:
        Path(path).write_bytes(serialized)
        return
    with tensors_replaced(model.graph, _small_external), tensors_replaced(model.graph, _streamable) as weights:
        message = ir.to_proto(model).SerializeToString()
    with open(path, "wb") as f:
        wire.write_filled(f, message, weights)


def proto_without_weights(model: ir.Model) -> tuple[onnx.ModelProto, dict[str, ir.Value]]:
    """The main graph as a ModelProto without its initializers, and those initializers by
    name: for sessions over parts of a big model that serialize only the weights a part
    reads (`optimize/layerwise/replay.py`), instead of copying every weight at once."""
    graph = model.graph
    view = ir.GraphView(graph.inputs, graph.outputs, nodes=list(graph), name=graph.name,
                        opset_imports=dict(model.opset_imports))
    proto = onnx.ModelProto(ir_version=model.ir_version)
    ir.serde.serialize_graph_into(proto.graph, view)
    for domain, version in model.opset_imports.items():
        proto.opset_import.add(domain=domain, version=version)
    return proto, dict(graph.initializers)
