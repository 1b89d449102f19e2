"""Weight-only kernel layers (MatMulNBits, GatherBlockQuantized) measured alone, in passes
over groups of them whose exposed tensors fit a memory budget.

A weight-only kernel is one node reading float activations and its own packed weights, so
its copy fed from the float model's tensors is the layer alone (`isolate.py`), as a Q/DQ
layer's is. An LLM has hundreds of them with wide outputs: SmolLM2-135M's 151 in one pass
took its analysis from 2.8 to 6.2 GB. Each pass here isolates one group in a copy of the
float model (its weights shared, not copied) and exposes only that group's tensors: the
copy's output and the float reference of each layer, and the quantized model's own output
of it (the error with every layer before it quantized too).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxq.analyze.accumulate import ErrorStats
from onnxq.analyze.isolate import PREFIX, IsolatedLayer, add_isolated_layers
from onnxq.analyze.qgraph import Layer
from onnxq.calibrate.data import iter_batches
from onnxq.calibrate.inputs import model_inputs, recurrent_axes
from onnxq.calibrate.session import exposed_session, run_quantized
from onnxq.graph.edit import values_by_name
from onnxq.sessions import deployed_options, session_inputs

WEIGHT_KERNELS = frozenset({("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized")})
# Bytes of exposed tensors per pass (three per layer, at one batch): each pass costs a
# session over the float model, so fewer, larger groups are faster.
GROUP_BYTES = 512 << 20


def kernel_layers(model: ir.Model) -> list[Layer]:
    """The weight-only kernels of `model`, in graph order, as layers."""
    return [Layer(node.name, node.op_type, node.outputs[0].name, None) for node in model.graph
            if (node.domain, node.op_type) in WEIGHT_KERNELS and node.outputs and node.outputs[0].name]


@dataclass
class Measured:
    """Each isolated layer with its error alone and with its prefix, and those not isolated."""

    isolated: list[IsolatedLayer]
    own: dict[str, ErrorStats]
    prefix: dict[str, ErrorStats]
    skipped: list[str]
    passes: int


def measure_in_groups(float_model: ir.Model, quant: ir.Model, layers: list[Layer], data: Any, providers: list[str],
                      batch_size: int, max_samples: int | None, budget: int = GROUP_BYTES) -> Measured:
    """`layers` measured alone and with their prefix, a group of them per pass over `data`
    (`float_model` is left as it is)."""
    def feeds(inputs: list) -> Iterator[Mapping[str, np.ndarray]]:
        return iter(iter_batches(data, inputs, batch_size, max_samples, kind="evaluation"))

    quant_values = values_by_name(quant.graph)
    sizes = _batch_bytes(quant, quant_values, layers, next(feeds(model_inputs(float_model)), {}))
    result = Measured([], {}, {}, [], 0)
    for group in _groups(layers, sizes, budget):
        model = float_model.clone()
        isolated, skipped = add_isolated_layers(model, quant, group)
        result.skipped += skipped
        if not isolated:
            continue
        result.passes += 1
        references = list(dict.fromkeys(n for i in isolated for n in (i.reference, i.output)))
        mine = [i.layer.output for i in isolated if i.layer.output in quant_values]
        with contextlib.ExitStack() as stack:
            ref_session = stack.enter_context(exposed_session(model, references, providers,
                                                              options=deployed_options()))
            test_session = stack.enter_context(exposed_session(quant, mine, providers))
            for i in isolated:
                result.own[i.layer.name], result.prefix[i.layer.name] = ErrorStats(), ErrorStats()
            for feed in feeds(session_inputs(ref_session, recurrent_axes(float_model.graph))):
                ref = dict(zip(references, run_quantized(ref_session, references, feed, PREFIX)))
                test = dict(zip(mine, run_quantized(test_session, mine, feed)))
                for i in isolated:
                    result.own[i.layer.name].update(ref[i.reference], ref[i.output])
                    got = test.get(i.layer.output)
                    if got is not None and got.shape == ref[i.reference].shape:
                        result.prefix[i.layer.name].update(ref[i.reference], got)
        del ref_session, test_session, model  # each session holds a copy of the weights: one at a time
        result.isolated += isolated
    return result


def _batch_bytes(quant: ir.Model, values: Mapping[str, ir.Value], layers: list[Layer],
                 feed: Mapping[str, np.ndarray]) -> dict[str, int | None]:
    """Each layer's output bytes at one batch of `feed`: its shape with the model inputs'
    symbolic dimensions bound to the feed's (batch, sequence length); None where a
    dimension stays unknown."""
    bound: dict[str, int] = {}
    for value in quant.graph.inputs:
        array = feed.get(value.name)
        if array is None or value.shape is None:
            continue
        for dim, size in zip(value.shape.dims, np.shape(array)):
            if not isinstance(dim, int) and getattr(dim, "value", None):
                bound.setdefault(str(dim.value), int(size))
    sizes: dict[str, int | None] = {}
    for layer in layers:
        value = values.get(layer.output)
        dims = [] if value is None or value.shape is None else list(value.shape.dims)
        known = [d if isinstance(d, int) else bound.get(str(getattr(d, "value", None))) for d in dims]
        itemsize = value.dtype.itemsize if value is not None and value.dtype is not None else 4
        sizes[layer.name] = int(math.prod(known) * itemsize) if dims and None not in known else None
    return sizes


def _groups(layers: list[Layer], sizes: Mapping[str, int | None], budget: int) -> Iterator[list[Layer]]:
    """`layers` in graph order, cut where three tensors of each (the reference, the copy's
    output and the quantized model's) would pass `budget`; a layer of unknown size counts
    as a quarter of it."""
    group: list[Layer] = []
    used = 0
    for layer in layers:
        size = sizes.get(layer.name)
        cost = 3 * size if size is not None else budget // 4
        if group and used + cost > budget:
            yield group
            group, used = [], 0
        group.append(layer)
        used += cost
    if group:
        yield group
