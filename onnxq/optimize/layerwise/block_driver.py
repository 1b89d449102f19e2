"""Block reconstruction inside the layer-wise walk: a block's layers, then the block.

When the walk reaches a block (`blocks.py`), the replay (`replay.py`) gives the block's
start on the quantized model so far and the float model's values inside it and at its
end, on evenly strided samples that fit `block_budget_mb`. Each layer of the block is
optimised as the walk does any layer, its quantized input computed by the block's own
forward pass (`block_fit.BlockGraph`) with the layers before it already settled; then the
block's rounding is learned together (`block_fit.py`) and kept where the block's output
error drops. Only then does the replay run the block, so the layers after it fit their
rounding, and re-solve their biases, to the block as it will be emitted: a block refined
after the whole walk would invalidate the corrections the later layers made for it
(MobileNet-v1 W4A8 fell from 12.2 to 7.4 dB that way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxq.numerics.weights import QuantizedTensor
from onnxq.optimize.layerwise.block_fit import BlockGraph, Learnable, Rounding, fit_block
from onnxq.optimize.layerwise.blocks import Block
from onnxq.optimize.layerwise.emitted import BiasSlot, dequantized, slot_value, with_codes
from onnxq.optimize.layerwise.grid import code_grid
from onnxq.optimize.layerwise.layers import Layer
from onnxq.optimize.layerwise.replay import Replay
from onnxq.parallel import serial_blas


def _constants(block: Block) -> dict[str, np.ndarray]:
    """The constant inputs of the block's nodes."""
    return {v.name: v.const_value.numpy() for node in block.nodes for v in node.inputs
            if v is not None and v.const_value is not None}


def _biases(block: Block, qnodes: Mapping[str, ir.Node], slots: Mapping[str, BiasSlot | None]) -> dict[str, np.ndarray]:
    """Each layer's bias as the float model now holds it (the layer-wise pass may have
    re-solved it), by the name of the emitted graph's tensor that adds it (`replay_bias`)."""
    values = {}
    for layer in block.layers:
        slot = slots.get(layer.name)
        if slot is not None:
            values[qnodes[slot.node].inputs[slot.index].name] = slot_value(layer, slot, layer.bias_array())
    return values


def _samples(replay: Replay, names: list[str], budget: int) -> dict[str, np.ndarray]:
    """`names` on evenly strided samples whose values fit `budget` bytes."""
    kept: dict[str, list[np.ndarray]] = {n: [] for n in names}
    stride = seen = 0
    for batch in replay.inputs(names):
        if not stride:
            per_sample = sum(batch[n].nbytes for n in names) / max(len(batch[names[0]]), 1)
            stride = max(1, math.ceil(replay.samples * per_sample / max(budget, 1)))
        rows = [i for i in range(len(batch[names[0]])) if (seen + i) % stride == 0]
        seen += len(batch[names[0]])
        for n in names:
            kept[n].append(np.ascontiguousarray(batch[n][rows]))
    return {n: np.concatenate(v) for n, v in kept.items()}


class Kept:
    """Kept samples of a block's tensors, read as a replay's `inputs` are (`problem.layer_statistics`).

    A block's layers read their inputs from here, not from the replay: the replay runs
    each node once, so had it run the block for the layer-wise step, the block's later
    rounding would not reach the tensors after it."""

    CHUNK = 16

    def __init__(self, values: Mapping[str, np.ndarray]) -> None:
        self.values = values
        self.samples = len(next(iter(values.values())))

    def inputs(self, names: list[str]) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, self.samples, self.CHUNK):
            yield {n: self.values[n][i:i + self.CHUNK] for n in names}


@dataclass
class BlockOutcome:
    before: float  # the block's relative output error after the layer-wise pass
    after: float  # after the block pass (before, where it did not help)
    improved: bool


def run_block(block: Block, replay: Replay, qnodes: Mapping[str, ir.Node], slots: Mapping[str, BiasSlot | None],
              current: Callable[[Layer], QuantizedTensor], optimise_layer: Callable[[Layer, Kept, tuple[str, str]], None],
              pin: Callable[[Layer, QuantizedTensor], None], options, schedule: Rounding) -> BlockOutcome:
    """One block (module doc): its layers one by one on the block's kept samples, then the
    block's rounding together; `current(layer)` is a layer's quantized weight so far,
    `optimise_layer` the layer-wise step, `pin` keeps a weight."""
    floats = {layer.name: replay.float_name(layer.node.inputs[0].name) for layer in block.layers}
    target = replay.float_name(block.float_end)
    kept = _samples(replay, list(dict.fromkeys([block.start, *floats.values(), target])),
                    int(options.block_budget_mb) << 20)
    x = kept[block.start]
    weight_of = {layer.name: qnodes[layer.name].inputs[1].name for layer in block.layers}
    graph = BlockGraph(block, {**_constants(block), **_biases(block, qnodes, slots)}, set(weight_of.values()))
    for layer in block.layers:
        graph.values.update(_biases(block, qnodes, slots))
        weights = {weight_of[item.name]: dequantized(current(item)) for item in block.layers}
        xq = qnodes[layer.name].inputs[0].name
        inputs = graph.values_of(x, weights, xq, Kept.CHUNK)
        optimise_layer(layer, Kept({xq: inputs, floats[layer.name]: kept[floats[layer.name]]}),
                       (xq, floats[layer.name]))
    graph.values.update(_biases(block, qnodes, slots))
    learnables = [Learnable.of(layer, qnodes[layer.name], current(layer)) for layer in block.layers]
    with serial_blas(), np.errstate(all="ignore"):
        fit = fit_block(graph, learnables, x, kept[target], schedule, options.block_positions)
    if not fit.after < fit.before:
        return BlockOutcome(fit.before, fit.before, False)
    for item in learnables:
        qt = current(item.layer)
        pin(item.layer, with_codes(item.layer.node, fit.codes[item.layer.name], item.shape, qt, qt.scale,
                                   lambda zp, spec=item.layer.weight.spec: code_grid(spec, zp)))
    return BlockOutcome(fit.before, fit.after, True)


def block_line(blocks: int, outcomes: list[BlockOutcome], refused: Mapping[str, str]) -> str:
    """The summary's part on the block pass."""
    improved = sum(o.improved for o in outcomes)
    text = f"; blocks: {improved} of {blocks} improved on their layer-wise rounding"
    if outcomes:
        before = float(np.median([o.before for o in outcomes]))
        after = float(np.median([o.after for o in outcomes]))
        text += f" (median relative block output error {before:.3g} -> {after:.3g})"
    if refused:
        items = [f"{n} ({r})" for n, r in list(refused.items())[:2]]
        text += f"; {len(refused)} layers not in a block: " + ", ".join(items) + (" ..." if len(refused) > 2 else "")
    return text
