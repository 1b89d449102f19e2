"""Read and write big .onnx files without parsing or building their weights in one
protobuf message. Reading: the protobuf wire format is walked to the main graph's
initializers, everything else is parsed as usual, and each raw weight becomes a read-only
memory map of its bytes in the file. Writing (`write_filled`): the serialized structure is
copied and each weight's bytes are written into it from the weight's own buffer.

`onnx.load` reads the whole file and parses it, so a model with embedded weights briefly
needs twice its size (the bytes and the parsed message) and then keeps every weight in one
protobuf arena until all of them are dropped. Here the proto holds no weight data: peak
memory at load is the graph structure, and a weight's pages are read when a stage reads
it (and can be dropped again, `graph.external_data.drop_pages`).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import onnx
from google.protobuf.message import DecodeError

MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_NAME, TENSOR_RAW_DATA = 7, 5, 8, 9
LENGTH_DELIMITED = 2


class WireError(ValueError):
    """The bytes are not the protobuf this reader expects (the caller falls back)."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(buf: memoryview, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field number, start of the field's bytes, start of its payload, end) of each field
    of the message in buf[start:end]."""
    out = []
    pos = start
    while pos < end:
        first = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            payload = pos
        elif wire == 1:
            payload, pos = pos, pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            payload, pos = pos, pos + length
        elif wire == 5:
            payload, pos = pos, pos + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        if pos > end:
            raise WireError("field runs past its message")
        out.append((number, first, payload, pos))
    return out


def _without(buf: memoryview, parts: list[tuple[int, int, int, int]], skip: int) -> bytes:
    return b"".join(bytes(buf[first:end]) for number, first, _, end in parts if number != skip)


def read_split(path: str | Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model without its main-graph raw initializers' data (those initializers kept
    with empty data), and those weights as read-only memory maps of the file."""
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file
            raise WireError(str(exc)) from None
    buf = memoryview(mapped)
    try:
        top = fields(buf, 0, len(buf))
        graphs = [f for f in top if f[0] == MODEL_GRAPH]
        if len(graphs) != 1:
            raise WireError("not exactly one graph")
        model = onnx.ModelProto.FromString(_without(buf, top, MODEL_GRAPH))
        _, _, g_start, g_end = graphs[0]
        parts = fields(buf, g_start, g_end)
        model.graph.ParseFromString(_without(buf, parts, GRAPH_INITIALIZER))
        weights: dict[str, np.ndarray] = {}
        for number, _, start, end in parts:
            if number != GRAPH_INITIALIZER:
                continue
            tensor_fields = fields(buf, start, end)
            raw = [f for f in tensor_fields if f[0] == TENSOR_RAW_DATA]
            tensor = model.graph.initializer.add()
            if len(raw) != 1:  # typed fields, external or no data: parsed as usual
                tensor.ParseFromString(bytes(buf[start:end]))
                continue
            tensor.ParseFromString(_without(buf, tensor_fields, TENSOR_RAW_DATA))
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            _, _, data_start, data_end = raw[0]
            count = int(np.prod(tensor.dims)) if tensor.dims else 1
            if dtype.itemsize * count != data_end - data_start or tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor.raw_data = bytes(buf[data_start:data_end])  # left to the size check
                continue
            tensor.raw_data = b""
            weights[tensor.name] = np.frombuffer(mapped, dtype=dtype.newbyteorder("<"), count=count,
                                                 offset=data_start).reshape(tuple(tensor.dims))
    except (DecodeError, KeyError, TypeError, ValueError) as exc:
        raise WireError(str(exc)) from None
    finally:
        buf.release()
    return model, weights


def read_structure(path: str | Path) -> onnx.ModelProto:
    """The model at `path` without its main graph's raw weight bytes (external data not
    loaded): what reading its inputs, opsets or data files needs, without parsing the
    weights (all-MiniLM-L6's 90 MB: 0.1 s by `onnx.load`, a few ms here). Raises what
    `onnx.load` raises for a file that is not a model."""
    try:
        return read_split(path)[0]
    except (WireError, OSError):
        return onnx.load(str(path), load_external_data=False)


class Bytes(Protocol):
    """What `write_filled` writes a weight from (an onnx-ir tensor)."""

    nbytes: int

    def tobytes(self) -> bytes: ...


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_header(number: int, length: int) -> bytes:
    return _encode_varint(number << 3 | LENGTH_DELIMITED) + _encode_varint(length)


def _filled_tensor(buf: memoryview, start: int, end: int,
                   raw: Mapping[str, Bytes]) -> list[bytes | Bytes] | None:
    """The tensor message buf[start:end] with its empty raw_data replaced by the bytes of
    its entry in `raw`, as pieces; None if it is not one of them."""
    parts = fields(buf, start, end)
    names = [bytes(buf[p:e]).decode() for n, _, p, e in parts if n == TENSOR_NAME]
    empty = [(first, stop) for n, first, p, stop in parts if n == TENSOR_RAW_DATA and p == stop]
    if len(names) != 1 or names[0] not in raw or len(empty) != 1:
        return None
    (first, stop), weight = empty[0], raw[names[0]]
    return [bytes(buf[start:first]), _field_header(TENSOR_RAW_DATA, weight.nbytes), weight, bytes(buf[stop:end])]


def _length(pieces: list[bytes | Bytes]) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)


def write_filled(f: BinaryIO, message: bytes, raw: Mapping[str, Bytes]) -> None:
    """Write the serialized model `message` to `f`, each main-graph initializer named in
    `raw` (serialized with an empty raw_data) getting `raw[name].tobytes()` as its data:
    the bytes `SerializeToString` gives for the full model, with one weight's bytes in
    memory at a time (the inverse of `read_split`)."""
    buf = memoryview(message)
    pieces: list[bytes | Bytes] = []
    found = 0
    for number, first, start, end in fields(buf, 0, len(buf)):
        if number != MODEL_GRAPH:
            pieces.append(bytes(buf[first:end]))
            continue
        graph: list[bytes | Bytes] = []
        for g_number, g_first, g_start, g_end in fields(buf, start, end):
            tensor = _filled_tensor(buf, g_start, g_end, raw) if g_number == GRAPH_INITIALIZER else None
            if tensor is None:
                graph.append(bytes(buf[g_first:g_end]))
                continue
            found += 1
            graph += [_field_header(GRAPH_INITIALIZER, _length(tensor)), *tensor]
        pieces += [_field_header(MODEL_GRAPH, _length(graph)), *graph]
    if found != len(raw):
        raise WireError(f"{len(raw) - found} weights to write have no empty initializer in the message")
    for piece in pieces:
        if isinstance(piece, bytes):
            f.write(piece)
            continue
        data = piece.tobytes()
        if len(data) != piece.nbytes:
            raise WireError(f"a weight gave {len(data)} bytes, {piece.nbytes} expected")
        f.write(data)
