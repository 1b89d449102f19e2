"""Read a big .onnx file without parsing its weights: the protobuf wire format is walked
to the main graph's initializers, everything else is parsed as usual, and each raw weight
becomes a read-only memory map of its bytes in the file.

`onnx.load` reads the whole file and parses it, so a model with embedded weights briefly
needs twice its size (the bytes and the parsed message) and then keeps every weight in one
protobuf arena until all of them are dropped. Here the proto holds no weight data: peak
memory at load is the graph structure, and a weight's pages are read when a stage reads
it (and can be dropped again, `graph.load.drop_pages`).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA = 7, 5, 9


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
