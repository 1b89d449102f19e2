"""Where a big model's weights live: external data read into memory when small, else left
in its files (memory-mapped when read); a big file's raw weights mapped from the file
itself (`graph.wire`), an in-memory model's spilled to temporary mapped files; and the
pages of a weight a stage is done with dropped again."""

from __future__ import annotations

import atexit
import contextlib
import mmap
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxq.graph.wire import WireError, read_split

# Up to this many bytes of external weights are read into memory at load. Bigger models
# keep them in their files, memory-mapped when read; sessions read those from their files
# themselves, and take the others as arrays (`calibrate.session.open_session`), from any
# working directory.
INLINE_LIMIT = 1 << 30


def follow_links(model: ir.Model) -> None:
    """Point external weights stored through a symbolic or hard link (a model folder that
    shares its data with a cache or another folder) at the file itself. onnx-ir refuses
    such files as a possible path-traversal attack; the checks (`graph.checks`) have
    already confined each location to the model's folder, and following the link there is
    the user's intent, as onnxruntime follows it."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor) or not tensor.base_dir:
            continue
        path = Path(tensor.base_dir) / tensor.location
        if path.is_symlink() or (path.exists() and path.stat().st_nlink > 1):
            value.const_value = ir.ExternalTensor(
                str(path.resolve()), tensor.offset, tensor.length, tensor.dtype, shape=tensor.shape,
                name=tensor.name, base_dir="")  # an absolute location, checked above


def inline_external(model: ir.Model) -> None:
    """Read the external weights of `model` into memory when they total at most `INLINE_LIMIT`."""
    external = [v.const_value for v in model.graph.initializers.values()
                if isinstance(v.const_value, ir.ExternalTensor)]
    if external and sum(t.nbytes for t in external) <= INLINE_LIMIT:
        ir.external_data.load_to_model(model)


# Models whose embedded weights pass this many bytes keep them out of the parsed protobuf,
# which holds every weight until all of them die: a file's raw weights are memory maps of
# the file itself (`graph.wire`), an in-memory model's are moved into temporary mapped
# files (`spill_embedded`). A weight replaced by its int4 form then leaves memory
# (SmolLM2 RTN: peak RSS 2.2x -> 1.4x the model file).
SPILL_LIMIT = 256 << 20
_SPILL_MIN_BYTES = 1 << 16  # smaller tensors are copied into memory instead
# Model files past this size are read by the wire reader whatever their size: their raw
# weights memory maps of the file, neither parsed into the protobuf nor copied out of it
# again (all-MiniLM-L6, 90 MB: load 0.215 -> 0.051 s; MobileNet-v1, 10 MB: 0.018 -> 0.014 s).
MAP_MIN_BYTES = 4 << 20


def read_mapped(path: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The proto of a file past `MAP_MIN_BYTES` and its raw weights as memory maps of the
    file (left out of the proto, `graph.wire`); None for a smaller file or one the wire
    reader cannot split (it is read as usual)."""
    # a spill limit set lower (tests set it to 0) maps those files too
    if not (path.is_file() and path.stat().st_size > min(MAP_MIN_BYTES, SPILL_LIMIT)):
        return None
    try:
        return read_split(path)
    except (WireError, OSError):
        return None  # read as usual; a broken file gets the usual error


def _owned(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """A tensor that holds its own bytes (not a view into the parsed protobuf): its array
    where the proto has raw data (what `ir.Tensor` writes back the same), else a copy of
    its proto alone (typed fields written back as they were)."""
    if not isinstance(tensor, ir.serde.TensorProtoTensor):
        return tensor
    proto = tensor.raw
    if not proto.HasField("raw_data"):
        alone = onnx.TensorProto()
        alone.CopyFrom(proto)
        return ir.serde.TensorProtoTensor(alone)
    # numpy() reads the bytes out of the proto into a buffer of their own (read-only, as a
    # memory-mapped weight is): no second copy
    return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string,
                     metadata_props=dict(tensor.metadata_props) or None)


def spill_embedded(model: ir.Model) -> None:
    """Move the embedded weights out of the parsed protobuf, which holds every weight until
    all of them die, and copies a weight's bytes each time it is read (all-MiniLM-L6's
    weights were read 423 times in one quantize, 0.11 s; AlexNet's 150 times, 1.4 s): into
    owned arrays, attribute tensors included; a model's past `SPILL_LIMIT` big ones into
    temporary files mapped read-only (each deleted with its tensor, or at exit)."""
    values = [v for g in (model.graph, *model.graph.subgraphs()) for v in g.initializers.values()]
    embedded = [v for v in values if isinstance(v.const_value, ir.serde.TensorProtoTensor)]
    spill = sum(v.const_value.nbytes for v in embedded) > SPILL_LIMIT
    folder = Path(tempfile.mkdtemp(prefix="onnxq-weights-")) if spill else None
    if folder is not None:
        atexit.register(shutil.rmtree, folder, True)
    for i, value in enumerate(embedded):
        tensor = value.const_value
        if folder is None or tensor.nbytes < _SPILL_MIN_BYTES or tensor.dtype.bitwidth < 8:
            value.const_value = _owned(tensor)
            continue
        path = folder / f"w{i}.bin"
        array = tensor.numpy()
        array.tofile(path)
        # A read-only memory map, wrapped like any array: serializing the model inlines it.
        mapped = np.memmap(path, dtype=array.dtype, mode="r", shape=array.shape)
        del array
        spilled = ir.Tensor(mapped, dtype=tensor.dtype, name=tensor.name)
        weakref.finalize(spilled, _remove, path)
        value.const_value = spilled
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.serde.TensorProtoTensor):
                node.attributes[attr.name] = ir.AttrTensor(attr.name, _owned(attr.value))


def drop_pages(tensor: object) -> None:
    """Let the pages of a weight mapped from a file (`graph.wire`, `spill_embedded`, or an
    external data file onnx-ir has mapped) leave the process's memory (they are read again
    from the file if anything reads it later): for weights a stage is done with that a
    copy of the model (a fallback's pristine clone) still references."""
    if isinstance(tensor, ir.ExternalTensor):  # the file's map, once the tensor was read
        if isinstance(tensor.raw, mmap.mmap):
            _advise(tensor.raw, tensor.offset or 0, tensor.length or tensor.nbytes)
        return
    if isinstance(tensor, ir.Tensor) and isinstance(tensor.raw, np.ndarray):
        drop_array_pages(tensor.raw)


def drop_array_pages(array: np.ndarray) -> None:
    """`drop_pages` for a C-contiguous array (or slice of rows) viewing a mapped file: the
    model file (`graph.wire`), a spilled file or an external data file; others are left."""
    base = array.base
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    if isinstance(base, mmap.mmap) and array.flags.c_contiguous:
        origin = np.frombuffer(base, np.uint8, count=1).ctypes.data
        _advise(base, array.ctypes.data - origin, array.nbytes)


def _advise(mapped: mmap.mmap, start: int, length: int) -> None:
    """Drop the whole pages of mapped[start:start + length] from the process."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + length) // page * page
    if last > first:
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(mmap.MADV_DONTNEED, first, last - first)


def release(tensor: object) -> None:
    """Let a weight replaced by its quantized form leave the process: unmap it when it is
    kept in an external data file (skipped while something still holds a view of it),
    else drop its mapped pages (`drop_pages`); a >2 GB model otherwise ends with every
    weight resident."""
    drop_pages(tensor)
    if isinstance(tensor, ir.ExternalTensor):
        with contextlib.suppress(BufferError):
            tensor.release()


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
