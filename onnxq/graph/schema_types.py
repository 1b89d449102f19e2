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
def onnx_op_types() -> frozenset[str]:
    """Every op type of onnx's registered schemas (standard and other domains): what a
    config may name as an op type the model lacks."""
    return frozenset(schema.name for schema in onnx.defs.get_all_schemas_with_history())


def is_onnx_op_type(name: str) -> bool:
    """Whether `name` is an op type of onnx's registered schemas (`onnx_op_types`), asked of
    the default domain's registry first: the whole set takes 15 ms to build, a tenth of
    ResNet-20's default quantize, for a config naming op types the model lacks (the
    default's float_op_types: Softmax, LayerNormalization ...)."""
    return onnx.defs.has(name) or name in onnx_op_types()


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


# A formal parameter: its type parameter (or a concrete type), and whether every argument it
# stands for has one type (a variadic parameter may not: Loop's and Scan's carried values).
Formal = tuple[str, bool]


def _formals(params: Sequence[object], onnx_style: bool) -> list[Formal]:
    if onnx_style:
        return [(p.type_str, p.is_homogeneous) for p in params]
    return [(p.typeStr, p.isHomogeneous) for p in params]


Schema = tuple[list[Formal], list[Formal], dict[str, list[str]]]


def _schema(node: ir.Node, opsets: dict[str, int]) -> Schema | None:
    """(input parameters, output parameters, allowed types per type parameter) of the
    version of `node`'s op its model imports; None where no schema is known."""
    domain = "" if node.domain in _STANDARD else node.domain
    return _schema_of(domain, node.op_type, opsets.get(domain, opsets.get("ai.onnx", 1) if domain == "" else 1))


@functools.cache
def _schema_of(domain: str, op_type: str, version: int) -> Schema | None:
    if domain == "":
        try:
            schema = onnx.defs.get_schema(op_type, version, "")
        except onnx.defs.SchemaError:
            return None
        return (_formals(schema.inputs, True), _formals(schema.outputs, True),
                {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints})
    versions = [s for s in _ort_schemas().get((domain, op_type), []) if s.since_version <= version]
    if not versions:
        return None
    schema = max(versions, key=lambda s: s.since_version)
    return (_formals(schema.inputs, False), _formals(schema.outputs, False),
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


def _formal(params: Sequence[Formal], index: int) -> str | None:
    """The type parameter of the `index`-th actual argument (a variadic last one repeats);
    None where the arguments of a heterogeneous variadic parameter share no type."""
    if not params:
        return None
    param, homogeneous = params[min(index, len(params) - 1)]
    return param if homogeneous else None


def fill_dtypes(graph: ir.Graph, opsets: dict[str, int]) -> int:
    """Type the untyped outputs of `graph`'s nodes (not those of its subgraphs) from their
    schemas, in place, until nothing changes (the graph need not be sorted); the number of
    values typed. Only tensors: a value whose arguments' parameter is heterogeneous (Loop's
    and Scan's carried values) or may be a sequence is left as it is."""
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
                if value is not None and isinstance(value.type, ir.TensorType) and param is not None:
                    bound.setdefault(param, value.dtype)
            for j, value in enumerate(node.outputs):
                param = _formal(outputs, j)
                if value.type is not None or param is None:
                    continue
                choices = allowed.get(param, [param])  # a concrete type is its own parameter
                if not all(c.startswith("tensor(") for c in choices):
                    continue  # a sequence or an optional: not a tensor's element type
                dtype = bound.get(param) or (_dtype(choices[0]) if len(choices) == 1 else None)
                if dtype is not None:
                    value.dtype = dtype
                    typed += 1
                    changed = True
    return typed
