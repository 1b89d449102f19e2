"""Element types onnx's shape inference leaves unset, read from the ops' schemas.

onnx's inference knows no op of onnxruntime's contrib domains (Gelu, BiasGelu, FusedMatMul,
SkipLayerNormalization, Attention ... in com.microsoft, what onnxruntime's transformer
optimizer fuses a model into): their outputs stay untyped, and so does everything after
them. A MatMul reading such a value was taken for one with a non-float input and kept its
activation float without a word (weight-only). Each op's schema says which type parameter
each output has; where an input with the same parameter is typed, or the parameter allows
one type, the output gets that type (the element type only: shapes stay as inference left
them). Schemas of the default domain come from onnx, the others from onnxruntime, which
registers its contrib ops' schemas."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import onnx
import onnx_ir as ir

_STANDARD = ("", "ai.onnx")


@functools.cache
def _ort_schemas() -> dict[tuple[str, str], list[object]]:
    """onnxruntime's registered schemas by (domain, op), every version."""
    try:
        from onnxruntime.capi import _pybind_state
        schemas = _pybind_state.get_all_operator_schema()
    except (ImportError, AttributeError):  # a build without schemas: nothing to add
        return {}
    found: dict[tuple[str, str], list[object]] = {}
    for schema in schemas:
        found.setdefault((schema.domain, schema.name), []).append(schema)
    return found


def _schema(node: ir.Node, opsets: dict[str, int]) -> tuple[list[str], list[str], dict[str, list[str]]] | None:
    """(input type parameters, output type parameters, allowed types per parameter) of the
    version of `node`'s op its model imports; None where no schema is known."""
    domain = "" if node.domain in _STANDARD else node.domain
    version = opsets.get(domain, opsets.get("ai.onnx", 1) if domain == "" else 1)
    if domain == "":
        try:
            schema = onnx.defs.get_schema(node.op_type, version, "")
        except onnx.defs.SchemaError:
            return None
        return ([p.type_str for p in schema.inputs], [p.type_str for p in schema.outputs],
                {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints})
    versions = [s for s in _ort_schemas().get((domain, node.op_type), []) if s.since_version <= version]
    if not versions:
        return None
    schema = max(versions, key=lambda s: s.since_version)
    return ([p.typeStr for p in schema.inputs], [p.typeStr for p in schema.outputs],
            {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints})


def _dtype(type_str: str) -> ir.DataType | None:
    """`tensor(float16)` -> FLOAT16; None for sequences, maps and optionals."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return None
    name = type_str[len("tensor("):-1].upper()
    try:
        return ir.DataType(onnx.TensorProto.DataType.Value(name))
    except ValueError:
        return None


def _formal(params: Sequence[str], index: int) -> str | None:
    """The type parameter of the `index`-th actual argument (a variadic last one repeats)."""
    return params[min(index, len(params) - 1)] if params else None


def fill_dtypes(graph: ir.Graph, opsets: dict[str, int]) -> int:
    """Type the untyped outputs of `graph`'s nodes from their schemas, in place, until
    nothing changes (the graph need not be sorted); the number of values typed."""
    typed = 0
    changed = True
    while changed:
        changed = False
        for node in graph:
            if all(o.dtype is not None for o in node.outputs):
                continue
            schema = _schema(node, opsets)
            if schema is None:
                continue
            inputs, outputs, allowed = schema
            bound: dict[str, ir.DataType] = {}
            for i, value in enumerate(node.inputs):
                param = _formal(inputs, i)
                if value is not None and value.dtype is not None and param is not None:
                    bound.setdefault(param, value.dtype)
            for j, value in enumerate(node.outputs):
                param = _formal(outputs, j)
                if value.dtype is not None or param is None:
                    continue
                choices = allowed.get(param, [param])  # a concrete type is its own parameter
                dtype = bound.get(param) or (_dtype(choices[0]) if len(choices) == 1 else None)
                if dtype is not None:
                    value.dtype = dtype
                    typed += 1
                    changed = True
    return typed
