"""Statistics requests: what a pass needs from the calibration data, declared as values.

A pass asks for per-channel reductions of tensors (`Statistic`) instead of streaming the
data itself; `collect` answers any number of requests, together with the calibration
observers when asked in the same call, in one streaming pass. Each reduction runs inside
onnxruntime, so a batch returns N x C numbers per request (N x C x taps for `windows`: each
tap's positions summed by depthwise Convs of ones, `reductions.tap_nodes`; the image summed
over the batch where its size is unknown), not the tensor: ReduceMin/ReduceMax over every
axis but the channel; for means, a float32 ReduceSum (or GlobalAveragePool) over each
sample's positions, then the [N, C] per-sample sums added over the samples in double in
numpy (float32 over thousands of positions, not over the whole data; a double copy of every
tensor doubled peak memory on MobileNet, and returning the tensors to sum them in numpy
cost 120 MB and half of MobileNet's quantize time). Tensors of unknown rank or of a
non-float type, and Gram matrices, come back whole and are reduced in numpy.

Data passes per recipe: calibration 1; bias correction adds none (its means are requested
before calibration and collected in the same pass); SmoothQuant none as the last pass (its
channel maxima come with calibration and the tensors it scales are settled exactly,
`calibrate/rescale.py`), 1 when histogram observers must see the scaled tensors; CLE 1
per data-driven step (clip bounds on the original model, bias absorption on the
equalized one).

An absmax requested with the min and max of the same axis is derived from them, not
reduced again. Min/max reductions stay inside onnxruntime although its per-channel
ReduceMin is about 2x slower than reducing a returned tensor in numpy: returning whole
tensors would make memory grow with the number of requested tensors (an LLM's hidden
states at batch 8 are ~9 MB each).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.reductions import EACH, Taps, reduction_nodes, tap_nodes
from onnxq.graph.edit import values_by_name
from onnxq.graph.layout import ConvGeometry
from onnxq.parallel import ordered_map

Reduce = Literal["min", "max", "absmax", "mean", "windows", "gram"]


@dataclass(frozen=True)
class Statistic:
    """One reduction of one tensor over all calibration samples.

    min / max / absmax / mean: per index of `axis`, over every other axis and sample.
    windows: per channel (`axis`) and tap of the convolution `window`, the mean over output
      positions of the zero-padded input values the tap reads (`ConvGeometry.window_means`),
      over samples: what a convolution's mean output needs beyond channel means.
    gram: E[x x^T] over the rows of the tensor flattened to [rows, last axis] (a layer's
      input Hessian for GPTQ): float32 products (half float64's time; relative error
      ~1e-6, far below GPTQ's 1% damping) of fixed row slices, summed in float64.
    """

    tensor: str
    reduce: Reduce
    axis: int = 0
    window: ConvGeometry | None = None


_FOLD = {"min": np.minimum, "max": np.maximum, "absmax": np.maximum}
# Rows per product of a gram: slices of a fixed size (results independent of the core
# count), one per core (`parallel.ordered_map`: BLAS on one thread each), summed in order.
GRAM_ROWS = 1024


def _gram(rows: np.ndarray) -> np.ndarray:
    """rows^T rows: float32 products of `GRAM_ROWS`-row slices, summed in float64 in place
    (no float64 copy of each product)."""
    total = None
    for part in ordered_map(lambda r: r.T @ r, [rows[i:i + GRAM_ROWS] for i in range(0, max(len(rows), 1), GRAM_ROWS)]):
        if total is None:
            total = part.astype(np.float64)  # 0 + x is x: the sum's bits, without a zeroed K x K
        else:
            np.add(total, part, out=total)
    return total


class Accumulator:
    """Running value of one statistic across batches (float64).

    Minima and maxima fold exactly in any order. Sums (mean, windows, gram) are added along
    a fixed binary tree over the global batch index: the partial sum of every aligned
    block of 2**j batches is computed one way only, and a stack holds the blocks not yet
    paired (at most log2(batches) + 1). The total therefore has the same bits whether
    the batches streamed through one process or through calibration shards whose
    accumulators were merged (`merge`), which plain running sums cannot promise.
    """

    def __init__(self, stat: Statistic) -> None:
        self.stat = stat
        self.value: np.ndarray | None = None  # min / max / absmax
        self.blocks: list[tuple[int, int, np.ndarray]] = []  # sums: (first batch, end, partial sum)
        self.count = 0
        self.consistent = True

    @property
    def additive(self) -> bool:
        return self.stat.reduce not in _FOLD

    def add_reduced(self, value: np.ndarray, count: int, index: int = 0, owned: bool = False) -> None:
        """Fold one batch's reduction in; `index` is the batch's global position (sums).
        `owned`: `value` is a fresh float64 array no one else holds, kept without a copy
        (a gram's K x K: 2.6 s of copies over SmolLM2's GPTQ walk)."""
        value = np.asarray(value, dtype=np.float64)
        before = self.blocks[-1][2] if self.blocks else self.value
        if before is not None and before.shape != value.shape:  # an axis whose size varies between batches
            self.consistent = False
        if not self.consistent:
            return
        self.count += count
        if not self.additive:
            self.value = value.copy() if self.value is None else _FOLD[self.stat.reduce](self.value, value)
            return
        self._push(index, index + 1, value if owned else value.copy())

    def _push(self, start: int, end: int, value: np.ndarray) -> None:
        """Append a block, pairing it with its left sibling while there is one."""
        while self.blocks:
            lo, hi, left = self.blocks[-1]
            size = hi - lo
            if not (hi == start and end - start == size and lo % (2 * size) == 0):
                break
            self.blocks.pop()
            left += value
            start, value = lo, left
        self.blocks.append((start, end, value))

    def merge(self, other: Accumulator) -> None:
        """Fold in the accumulator of batches that all come after this one's."""
        if not other.consistent or not self.consistent or (
                self.blocks and other.blocks and self.blocks[-1][2].shape != other.blocks[0][2].shape) or (
                self.value is not None and other.value is not None and self.value.shape != other.value.shape):
            self.consistent = False
            return
        self.count += other.count
        if other.value is not None:
            self.value = other.value.copy() if self.value is None else _FOLD[self.stat.reduce](self.value, other.value)
        if self.blocks and other.blocks and other.blocks[0][0] < self.blocks[-1][1]:
            raise ValueError("statistics shards overlap or come out of order")
        for start, end, value in other.blocks:
            self._push(start, end, value.copy())

    def add_windows(self, total: np.ndarray, count: int, index: int) -> None:
        """Fold in a batch of `count` samples summed over the batch, [C, *spatial] (the
        statistic's channel axis must be the tensor's second: N, C, spatial...)."""
        if self.stat.window is None or self.stat.axis % (total.ndim + 1) != 1:
            self.consistent = False
            return
        self.add_reduced(self.stat.window.window_means(total), count, index)

    def add_batch(self, x: np.ndarray, index: int = 0) -> None:
        """Reduce a whole batch in numpy (means, tensors of unknown rank)."""
        x = np.asarray(x)
        reduce, axis = self.stat.reduce, self.stat.axis % max(x.ndim, 1)
        others = tuple(i for i in range(x.ndim) if i != axis)
        if reduce == "windows":
            self.add_windows(x.astype(np.float64).sum(axis=0), x.shape[0], index)
        elif reduce == "mean":
            self.add_reduced(x.astype(np.float64).sum(axis=others), x.size // max(x.shape[axis], 1), index)
        elif reduce == "gram":
            rows = x.reshape(-1, x.shape[-1]).astype(np.float32, copy=False)
            self.add_reduced(_gram(rows), rows.shape[0], index, owned=True)
        else:
            y = np.abs(x) if reduce == "absmax" else x
            self.add_reduced((y.min if reduce == "min" else y.max)(axis=others), 0)

    def result(self) -> np.ndarray | None:
        if not self.consistent:
            return None
        if not self.additive:
            return self.value
        if not self.blocks:
            return None
        total = self.blocks[0][2].copy()
        for _, _, value in self.blocks[1:]:
            total += value
        return total / max(self.count, 1)

    def state(self) -> dict[str, np.ndarray]:
        """Arrays that `from_state` turns back into this accumulator (stats files)."""
        out = {"count": np.int64(self.count), "consistent": np.bool_(self.consistent),
               "spans": np.array([(lo, hi) for lo, hi, _ in self.blocks], np.int64).reshape(-1, 2)}
        if self.value is not None:
            out["value"] = self.value
        out.update({f"block{i}": v for i, (_, _, v) in enumerate(self.blocks)})
        return out

    @classmethod
    def from_state(cls, stat: Statistic, arrays: Mapping[str, np.ndarray]) -> Accumulator:
        acc = cls(stat)
        acc.count, acc.consistent = int(arrays["count"]), bool(arrays["consistent"])
        acc.value = np.asarray(arrays["value"], np.float64) if "value" in arrays else None
        acc.blocks = [(int(lo), int(hi), np.asarray(arrays[f"block{i}"], np.float64))
                      for i, (lo, hi) in enumerate(arrays["spans"])]
        return acc


def per_sample_sum(sums: np.ndarray, axis: int) -> np.ndarray:
    """The sum in double over the samples of each sample's float32 sums ([N, ..., C at
    `axis`, ...], the other axes of size 1), as the session's Cast and ReduceSum gave it."""
    axis %= sums.ndim
    return sums.astype(np.float64).sum(axis=tuple(i for i in range(sums.ndim) if i != axis))


def _count(stat: Statistic, got: Mapping[str, np.ndarray], names: list[str]) -> int:
    """Elements per reduced value in one batch, from the shape output of a sum."""
    if len(names) < 2:
        return 0
    shape = [int(d) for d in got[names[1]]]
    if stat.reduce == "windows":
        return shape[0]
    return math.prod(shape) // max(shape[stat.axis % len(shape)], 1)


class StatisticsSet:
    """The requested statistics, fed batch by batch from a session's outputs."""

    def __init__(self, stats: Iterable[Statistic]) -> None:
        requested = list(dict.fromkeys(stats))
        # absmax = max(-min, max), exactly: not reduced again when min and max are requested.
        pairs = {stat: (Statistic(stat.tensor, "min", stat.axis), Statistic(stat.tensor, "max", stat.axis))
                 for stat in requested if stat.reduce == "absmax"}
        self.derived = {stat: pair for stat, pair in pairs.items() if set(pair) <= set(requested)}
        self.order = requested
        self.accumulators = {stat: Accumulator(stat) for stat in requested if stat not in self.derived}
        self.in_session: dict[Statistic, list[str]] = {}  # stat -> session outputs
        self.whole: dict[Statistic, str] = {}  # stat -> tensor returned whole
        self.taps: dict[Statistic, Taps] = {}  # window sums reduced to taps in the session

    def attach(self, model: ir.Model, on_cpu: bool = True) -> tuple[list[ir.Node], list[ir.Value], list[str]]:
        """Reduction nodes to add to `model`, the outputs to add, and the tensors needed whole
        (`on_cpu`: the session runs on onnxruntime's CPU provider, `tap_nodes`)."""
        opset = model.opset_imports.get("", 13)
        values = values_by_name(model.graph)
        nodes: list[ir.Node] = []
        outputs: list[ir.Value] = []
        for stat in self.accumulators:
            taps = tap_nodes(values[stat.tensor], stat, on_cpu) if stat.tensor in values else None
            if taps is not None:
                self.taps[stat] = taps
            built = (taps.nodes, taps.outputs) if taps is not None else (
                reduction_nodes(values[stat.tensor], stat, opset) if stat.tensor in values else None)
            if built is None:
                self.whole[stat] = stat.tensor
                continue
            nodes.extend(built[0])
            outputs.extend(built[1])
            self.in_session[stat] = [v.name for v in built[1]]
        return nodes, outputs, sorted(set(self.whole.values()))

    @property
    def uses_blas(self) -> bool:
        """Whether folding a batch in runs BLAS products (grams; window means not reduced
        to taps in the session, `attach`), which calibration keeps on one thread
        (`parallel.serial_blas`)."""
        return any(stat.reduce == "gram" or (stat.reduce == "windows" and stat not in self.taps)
                   for stat in self.accumulators)

    def update(self, got: Mapping[str, np.ndarray], index: int = 0) -> None:
        """Fold in batch number `index` (its global position in the calibration data)."""
        for stat, names in self.in_session.items():
            if stat in self.taps:
                total, count = self.taps[stat].total(got[names[0]])
                self.accumulators[stat].add_reduced(self.taps[stat].means(total), count, index)
            elif stat.reduce == "windows":
                self.accumulators[stat].add_windows(got[names[0]], _count(stat, got, names), index)
            elif stat.reduce == "mean" and names[0].endswith(EACH):
                self.accumulators[stat].add_reduced(per_sample_sum(got[names[0]], stat.axis),
                                                    _count(stat, got, names), index, owned=True)
            else:
                self.accumulators[stat].add_reduced(got[names[0]], _count(stat, got, names), index)
        for stat, tensor in self.whole.items():
            self.accumulators[stat].add_batch(got[tensor], index)

    def merge(self, other: StatisticsSet) -> None:
        """Fold in the same requests collected on later batches (a calibration shard)."""
        if list(other.accumulators) != list(self.accumulators):
            raise ValueError("statistics shards were collected for different requests")
        for stat, acc in self.accumulators.items():
            acc.merge(other.accumulators[stat])

    def results(self) -> dict[Statistic, np.ndarray | None]:
        found = {stat: acc.result() for stat, acc in self.accumulators.items()}
        for stat, (lo, hi) in self.derived.items():
            found[stat] = None if found[lo] is None or found[hi] is None else np.maximum(-found[lo], found[hi])
        return {stat: found[stat] for stat in self.order}
