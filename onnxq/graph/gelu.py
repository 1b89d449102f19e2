"""Find the GELUs an exporter wrote out as elementwise nodes, x * 0.5 * (1 + erf(x / sqrt 2))
or its tanh approximation, x * 0.5 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (or with
the argument factored, sqrt(2/pi) x (1 + 0.044715 x x), as Megatron and BLOOM write it).

torch's `nn.GELU()` exports as Div (or Mul by 1/sqrt 2) -> Erf -> Add 1 -> Mul x -> Mul 0.5,
or with the 0.5 taken first (Mul(x, 0.5) * (1 + erf)). onnxruntime fuses either form into
one float Gelu kernel (its GeluFusion; FastGelu for the tanh form: GPT-2's and HF's
`gelu_new`), and no integer kernel computes it. The planner keeps
such a GELU's inner nodes float (`plan/planner.py`): quantized, each inner tensor (1 + erf,
the products) is rounded once more inside one activation function, and the Q/DQ pairs stop
that fusion, so the model runs five elementwise kernels instead of one.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from onnxq.graph.fold import constant_array

INV_SQRT2 = 1.0 / math.sqrt(2.0)
# How close a matched constant must be to the formula's, relatively: bfloat16's precision
# (2^-8), since a bfloat16 export rounds sqrt(2/pi) to 0.796875, 0.13% off (float16 1/sqrt 2:
# 0.01%). The five constants (0.5, 1, sqrt 2, sqrt(2/pi), 0.044715) stay far apart.
TOLERANCE = 2.0 ** -8


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a constant one-element input, else None."""
    array = constant_array(value) if value is not None else None
    if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    return float(array.reshape(()))


def _near(got: float | None, want: float) -> bool:
    return got is not None and abs(got - want) <= TOLERANCE * abs(want)


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a two-input node that is not `value`."""
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    return second if first is value else first if second is value else None


def _only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node that reads `value`, if it is an `op_type` and `value` is no graph output."""
    readers = [use.node for use in value.uses()]
    if len(readers) != 1 or value.is_graph_output() or readers[0].op_type != op_type:
        return None
    return readers[0]


def _scaled_input(erf: ir.Node) -> tuple[list[ir.Node], ir.Value] | None:
    """The Div(x, sqrt 2) or Mul(x, 1/sqrt 2) before `erf`, and x."""
    value = erf.inputs[0] if erf.inputs else None
    source = value.producer() if value is not None else None
    if source is not None and source.op_type == "Div" and len(source.inputs) == 2 and len(value.uses()) == 1 \
            and _near(_scalar(source.inputs[1]), math.sqrt(2.0)):
        return [source], source.inputs[0]
    found = _scaled_by(value, "Mul", INV_SQRT2)
    return ([found[0]], found[1]) if found is not None else None


def _scaled_by(value: ir.Value | None, op_type: str, constant: float) -> tuple[ir.Node, ir.Value] | None:
    """The `op_type` node making `value` from one other input and a scalar near
    `constant` (its only reader being the chain), and that other input."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or len(node.inputs) != 2 or len(value.uses()) != 1:
        return None
    for other, c in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        if _near(_scalar(c), constant):
            return node, other
    return None


def _exponent(value: ir.Value | None) -> float | None:
    """A Pow's constant one-element exponent, integer (opset 12 on) or float."""
    array = constant_array(value) if value is not None else None
    return float(array.reshape(())) if array is not None and array.size == 1 \
        and np.issubdtype(array.dtype, np.number) else None


def _cubed(value: ir.Value | None, x: ir.Value) -> list[ir.Node] | None:
    """The nodes making x^3 as `value`: Pow(x, 3), or x * x * x in either grouping."""
    node = value.producer() if value is not None else None
    if node is None or len(value.uses()) != 1:
        return None
    if node.op_type == "Pow" and node.inputs[0] is x and _exponent(node.inputs[1]) == 3.0:
        return [node]
    if node.op_type == "Mul" and x in node.inputs:
        square = _other(node, x).producer() if _other(node, x) is not None else None
        if square is not None and square.op_type == "Mul" and list(square.inputs) == [x, x] \
                and len(square.outputs[0].uses()) == 1:
            return [square, node]
    return None


def _polynomial_input(tanh: ir.Node) -> tuple[list[ir.Node], ir.Value] | None:
    """The tanh approximation's argument before `tanh`, as its nodes in graph order and x:
    sqrt(2/pi) (x + 0.044715 x^3) (GPT-2's, HF's `gelu_new`), or its factored form
    sqrt(2/pi) x (1 + 0.044715 x x) (Megatron's and BLOOM's `bias_gelu`; onnxruntime's
    FastGeluFusion takes both)."""
    value = tanh.inputs[0] if tanh.inputs else None
    return _expanded(value) or _factored(value)


def _expanded(value: ir.Value | None) -> tuple[list[ir.Node], ir.Value] | None:
    """sqrt(2/pi) (x + 0.044715 x^3) as `value`."""
    outer = _scaled_by(value, "Mul", SQRT_2_OVER_PI)
    total = outer[1].producer() if outer is not None else None
    if total is None or total.op_type != "Add" or len(total.inputs) != 2 or len(outer[1].uses()) != 1:
        return None
    for x, term in ((total.inputs[0], total.inputs[1]), (total.inputs[1], total.inputs[0])):
        scaled = _scaled_by(term, "Mul", CUBIC)
        cube = _cubed(scaled[1], x) if scaled is not None else None
        if cube is not None:
            return [*cube, scaled[0], total, outer[0]], x
    return None


def _factored(value: ir.Value | None) -> tuple[list[ir.Node], ir.Value] | None:
    """sqrt(2/pi) x (1 + 0.044715 x x) as `value`, grouped (sqrt(2/pi) x) (...) or
    sqrt(2/pi) (x (...))."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Mul" or len(node.inputs) != 2 or len(value.uses()) != 1:
        return None
    for first, second in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        scaled = _scaled_by(first, "Mul", SQRT_2_OVER_PI)  # (sqrt(2/pi) x) * (1 + ...)
        if scaled is not None:
            bracket = _one_plus_square(second, scaled[1])
            if bracket is not None:
                return [*bracket, scaled[0], node], scaled[1]
    inner = _scaled_by(value, "Mul", SQRT_2_OVER_PI)  # sqrt(2/pi) * (x * (1 + ...))
    product = inner[1].producer() if inner is not None else None
    if product is None or product.op_type != "Mul" or len(product.inputs) != 2 or len(inner[1].uses()) != 1:
        return None
    for x, rest in ((product.inputs[0], product.inputs[1]), (product.inputs[1], product.inputs[0])):
        bracket = _one_plus_square(rest, x)
        if bracket is not None:
            return [*bracket, product, node], x
    return None


def _one_plus_square(value: ir.Value | None, x: ir.Value) -> list[ir.Node] | None:
    """The nodes making 1 + 0.044715 x x as `value` (the constant times x first, or x x
    first), in graph order."""
    total = value.producer() if value is not None else None
    if total is None or total.op_type != "Add" or len(total.inputs) != 2 or len(value.uses()) != 1:
        return None
    for one, term in ((total.inputs[0], total.inputs[1]), (total.inputs[1], total.inputs[0])):
        if not _near(_scalar(one), 1.0):
            continue
        scaled = _scaled_by(term, "Mul", CUBIC)  # 0.044715 * (x * x)
        square = scaled[1].producer() if scaled is not None else None
        if square is not None and square.op_type == "Mul" and list(square.inputs) == [x, x] \
                and len(scaled[1].uses()) == 1:
            return [square, scaled[0], total]
        product = term.producer() if term is not None else None  # (0.044715 * x) * x
        if product is not None and product.op_type == "Mul" and len(term.uses()) == 1 and x in product.inputs:
            first = _scaled_by(_other(product, x), "Mul", CUBIC)
            if first is not None and first[1] is x:
                return [first[0], product, total]
    return None


# Where the GELU's x is scaled before the nonlinearity: erf(x / sqrt 2), or the tanh
# approximation's tanh(sqrt(2/pi) (x + 0.044715 x^3)) (FastGelu in onnxruntime).
SQRT_2_OVER_PI, CUBIC = math.sqrt(2.0 / math.pi), 0.044715
ARGUMENTS = {"Erf": _scaled_input, "Tanh": _polynomial_input}


def _gelu_at(seed: ir.Node) -> list[ir.Node] | None:
    """The nodes of the GELU around `seed` (its Erf or Tanh), in graph order, or None
    where it is not one."""
    scaled = ARGUMENTS[seed.op_type](seed)
    if scaled is None:
        return None
    before, x = scaled
    add = _only_reader(seed.outputs[0], "Add")
    if add is None or not _near(_scalar(_other(add, seed.outputs[0])), 1.0):
        return None
    product = _only_reader(add.outputs[0], "Mul")
    if product is None:
        return None
    other = _other(product, add.outputs[0])
    if other is x:  # x * (1 + erf), then * 0.5
        half = _only_reader(product.outputs[0], "Mul")
        if half is None or not _near(_scalar(_other(half, product.outputs[0])), 0.5):
            return None
        return [*before, seed, add, product, half]
    halved = other.producer() if other is not None else None  # (x * 0.5) * (1 + erf)
    if halved is None or halved.op_type != "Mul" or len(other.uses()) != 1 or x not in halved.inputs \
            or not _near(_scalar(_other(halved, x)), 0.5):
        return None
    return [*before, seed, halved, add, product]


def decomposed_gelus(graph: ir.Graph) -> list[list[ir.Node]]:
    """Every GELU written out as elementwise nodes (module doc), each as its nodes; a node
    is in at most one."""
    found: list[list[ir.Node]] = []
    for node in graph:
        if node.op_type in ARGUMENTS and node.domain in ("", "ai.onnx"):
            nodes = _gelu_at(node)
            if nodes is not None:
                found.append(nodes)
    return found
