"""Outputs whose rows the data picks and orders: a detector's boxes after
NonMaxSuppression, the entries after a TopK or a NonZero.

Where two candidates score within a rounding error of each other, quantization may swap
them, or keep one more or one fewer: the output then differs row by row while the
detections are the same (SSDlite in float16, whose top-10 boxes match float's at IoU
1.000: 'boxes' at 7.1 dB element by element). The output check and `compare` still give
such an output's figures, but say what they are and do not warn on them.
"""

from __future__ import annotations

import onnx_ir as ir

SELECTION_OPS = ("NonMaxSuppression", "TopK", "NonZero", "Unique")


def selected_outputs(graph: ir.Graph) -> dict[str, str]:
    """Each graph output computed from a selection op's result (through any nodes after
    it, a subgraph's included), and that op's type."""
    out: dict[str, str] = {}
    for value in graph.outputs:
        producer = value.producer()
        stack, seen = ([producer], {producer}) if producer is not None else ([], set())
        while stack:  # the output's ancestors, each once, until a selection op
            node = stack.pop()
            op = _own_selection(node)
            if op is not None:
                out[value.name] = op
                break
            for read in _reads(node):
                if (above := read.producer()) is not None and above not in seen:
                    seen.add(above)
                    stack.append(above)
    return out


def first_output_pick(graph: ir.Graph) -> str | None:
    """The selection op whose rows the graph's scored output holds (`scored_output`: what
    the accuracy search and the analysis's ranking score), None where it holds none."""
    scored = scored_output(graph)
    return selected_outputs(graph).get(scored.name) if scored is not None else None


FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
SESSION_FLOAT_TYPES = frozenset({"tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"})


def scored_index(floats: list[bool]) -> int:
    """Which output the accuracy search and the analysis's ranking score: the first
    float one, else the first. An sklearn classifier's first output is its predicted
    labels (int64 or class names), which carry no signal to measure noise on; its
    probabilities come next."""
    return next((i for i, is_float in enumerate(floats) if is_float), 0)


def scored_output(graph: ir.Graph) -> ir.Value | None:
    """The graph output `scored_index` picks, None in a graph without outputs."""
    if not graph.outputs:
        return None
    return graph.outputs[scored_index([v.dtype in FLOAT_TYPES for v in graph.outputs])]


def session_scored(session: object) -> str:
    """The name of the session output `scored_index` picks."""
    outputs = session.get_outputs()  # type: ignore[attr-defined]
    return outputs[scored_index([o.type in SESSION_FLOAT_TYPES for o in outputs])].name


def _own_selection(node: ir.Node) -> str | None:
    """The selection op this node is, or holds in its subgraphs."""
    if node.domain in ("", "ai.onnx") and node.op_type in SELECTION_OPS:
        return node.op_type
    for sub in _subgraphs(node):
        for inner in ir.traversal.RecursiveGraphIterator(sub):
            if inner.domain in ("", "ai.onnx") and inner.op_type in SELECTION_OPS:
                return inner.op_type
    return None


def _reads(node: ir.Node) -> list[ir.Value]:
    """The values a node reads: its inputs, and the outer values its subgraphs use."""
    values = [v for v in node.inputs if v is not None]
    for sub in _subgraphs(node):
        for inner in ir.traversal.RecursiveGraphIterator(sub):
            values += [v for v in inner.inputs if v is not None and v.producer() is not None
                       and v.producer().graph is not inner.graph and v.producer().graph is not sub]
    return values


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.GRAPH:
            graphs.append(attribute.as_graph())
        elif attribute.type == ir.AttributeType.GRAPHS:
            graphs.extend(attribute.as_graphs())
    return graphs
