"""GPTQ (Frantar et al. 2022) for the MatMul weights lowered to MatMulNBits, in numpy.

Each MatMul y = x W (W [K, N]) is quantized one input row of W (a column of W^T) at a
time; the rounding error of each row is spread over the rows not yet quantized in
proportion to the inverse of H = E[x x^T], the Hessian of the layer's squared output
error, so later rows compensate it. Rows go in blocks of `block_size` with the updates
of the rest applied once per block (the paper's lazy batch updates). Per-group scales and
zero points follow the weight spec (int4/uint4, symmetric or not, `group_size`), computed
when their group is reached from the weights as updated so far (`static_groups`: from the
original weights, needed with `desc_act`, which quantizes rows in order of decreasing
H diagonal). The result is pinned for the MatMulNBits lowering, which stores exactly
these codes.

H is E[x x^T] (float32 products summed in float64), accumulated while the data
streams (memory independent of the number of samples). With `true_sequential` (the default) each layer's x comes from the
model whose earlier layers already hold their GPTQ weights, so later layers compensate
the error of earlier ones: the MatMuls are taken in groups sharing one input (q/k/v,
gate/up), in graph order, and `layerwise.replay` runs only the nodes between one group
and the next, from the tensors kept per batch, so the whole walk costs one forward pass
and holds one group's Hessians. Without it, every H comes from the float model in the
calibration pass (mergeable across calibration shards; `--stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.access import refusal
from onnxq.calibrate.data import iter_batches, model_inputs
from onnxq.calibrate.statistics import Accumulator, Statistic
from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.external_data import drop_pages
from onnxq.graph.fold import constant_array
from onnxq.graph.save import proto_without_weights
from onnxq.numerics.blocks import BlockQuantized, dequantize_codes, packed
from onnxq.numerics.linalg import inverse_cholesky_upper
from onnxq.numerics.qmath import int_type
from onnxq.numerics.weights import cast_scale, search_clip_scales, searchable, weight_qparams
from onnxq.optimize.context import AlgorithmContext, AlgorithmResult
from onnxq.optimize.layerwise.replay import Replay
from onnxq.optimize.registry import register_algorithm, statistics_of
from onnxq.parallel import cpu_count, in_background, ordered_map, serial_blas
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.matmul_nbits import FLOAT_TYPES, weight_dtype
from onnxq.progress import bar as progress_bar


@dataclass(frozen=True)
class GPTQConfig:
    """Options of `gptq` (Quark's GPTQConfig fields where they apply; bits, sym and
    group_size come from the weight spec). damp_percent: share of H's mean diagonal added
    to it. desc_act (default on: SmolLM2 int4 b128 perplexity 19.35 -> 18.66): rows in
    order of decreasing H diagonal (implies static_groups). block_size: rows per lazy
    update. true_sequential: Hessians from the quantized prefix (module doc);
    cache_budget_mb: tensors its replay keeps in memory before spilling to disk.
    clip_search: each group's scale clipped where that lowers the group's output error
    weighted by H's diagonal (the RTN clipping search, activation-aware).
    hessian_shrink: H's off-diagonal part (the inputs' correlations) is scaled by 1 minus
    this, a shrinkage toward its diagonal: the correlations of a few thousand calibration
    tokens are partly those of their text, and GPTQ trusting them whole fits its error
    feedback to that text. SmolLM2-135M int4 b128, perplexity STS-B / GPL-3 (float 17.53 /
    27.77) on 64 STS-B calibration windows: 0 18.40 / 32.71, 0.1 18.32 / 32.40, 0.3 18.12 /
    32.27, 0.5 18.14 / 31.87, 0.7 18.17 / 32.21; on 64 other windows 0 19.09 / 32.41, 0.5
    18.62 / 31.94; all-MiniLM-L6 W4 sentence embeddings 12.13 dB (0), 12.23 (0.3), 12.09
    (0.5) on 2400 held-out sentences. In [0, 1): at 1, a diagonal H, no error would be
    fed back at all (round-to-nearest with GPTQ's clipping)."""

    ALGORITHM: ClassVar[str] = "gptq"

    damp_percent: float = 0.01
    desc_act: bool = True
    static_groups: bool = False
    block_size: int = 128
    true_sequential: bool = True
    cache_budget_mb: int = 256
    clip_search: bool = True
    hessian_shrink: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.damp_percent < 1:
            raise ConfigError(f"gptq: damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.block_size < 1:
            raise ConfigError(f"gptq: block_size must be at least 1, got {self.block_size}")
        if self.cache_budget_mb < 0:
            raise ConfigError(f"gptq: cache_budget_mb must be >= 0, got {self.cache_budget_mb}")
        if not 0 <= self.hessian_shrink < 1:
            raise ConfigError(f"gptq: hessian_shrink must be in [0, 1), got {self.hessian_shrink}")


def matmul_nbits_layers(model: ir.Model, plan: QuantPlan) -> list[tuple[ir.Node, ResolvedSpec]]:
    """The MatMuls the plan lowers to MatMulNBits whose weight is a constant."""
    names = plan.nodes_for("matmul_nbits")
    return [(node, names[node.name]) for node in model.graph
            if node.name in names and constant_array(node.inputs[1]) is not None]


def hessian_requests(model: ir.Model, plan: QuantPlan, options: object = None) -> list[Statistic]:
    """E[x x^T] of each such MatMul's input (the `gram` statistic)."""
    return list(dict.fromkeys(Statistic(node.inputs[0].name, "gram", -1) for node, _ in matmul_nbits_layers(model, plan)))


def _group_params(w: np.ndarray, spec: ResolvedSpec, scale_dtype: type,
                  importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point (float64) of each row of `w` [N, group], as RTN computes them;
    with `importance` [group] (H's diagonal: E[x_k^2]), or [P, group] for rows that cycle
    through P groups, each scale is then clipped where that lowers the group's output
    error (`search_clip_scales`)."""
    scale, zp = weight_qparams(w.min(axis=1), w.max(axis=1), spec, 1e-12, signed=True)
    scale = cast_scale(scale, scale_dtype)
    if importance is not None and searchable(spec):
        _, scale = search_clip_scales(w.astype(np.float32), scale, zp, spec, importance=np.atleast_2d(importance))
    return scale.astype(np.float64), zp.astype(np.float64)


# Output rows quantized at once, at most: rows are independent given H, so the rows of a
# layer, or of the layers of one input group stacked, go in equal slices of up to 1024, on
# every core (`ordered_map`, BLAS on one thread each), and an LLM head's (49152 rows)
# working copies stay small. The slices depend on the shapes alone, so the result does not
# depend on the core count (nor, in practice, on the slice size: SmolLM2's outputs were
# byte-identical with 512, 1024 and 2048; a BLAS may sum a product's terms in another
# order for another width). Each slice's row loop is
# Python-bound and holds the GIL between numpy calls, so fewer, wider slices are faster
# than more threads: SmolLM2 GPTQ on 16 windows 39.1 s at 512, 34.7 s at 1024.
ROW_CHUNK = 1024
# Weights per piece of the static groups' search (`_static_params`): its float64 copy stays
# at 32 MB whatever the layer (a 7B model's LM head would be 4 GB whole).
STATIC_ELEMENTS = 1 << 22
# Rows updated one step at a time inside a lazy block (`_quantize_rows`): the rest of the
# block takes them as one product. 16 measured fastest on 576- and 1536-wide layers.
INNER = 16


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, spec: ResolvedSpec, options: GPTQConfig,
                  scale_dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [N, K] (signed, in the spec's range), scales and zero points [N, groups] of
    W^T = `w` [N, K] under input Hessian `hessian` [K, K] (module doc)."""
    dead = np.diag(hessian) <= 0
    diag = np.diag(hessian).astype(np.float32)
    with serial_blas():  # held here across both: the limit is set and restored by this thread (`in_background`)
        factor = in_background(_factor, hessian, dead, options)  # beside the static groups' search
        static = _static_params(w, dead, diag, spec, options, scale_dtype)
        order, upper = factor.result()
    cuts = np.linspace(0, len(w), -(-len(w) // ROW_CHUNK) + 1).round().astype(int)
    parts = list(ordered_map(lambda c: _quantize_rows(
        w[c[0]:c[1]], dead, order, upper, diag, spec, options, scale_dtype,
        None if static is None else (static[0][c[0]:c[1]], static[1][c[0]:c[1]])), zip(cuts[:-1], cuts[1:])))
    return tuple(np.concatenate(p) for p in zip(*parts))  # type: ignore[return-value]


def _factor(hessian: np.ndarray, dead: np.ndarray, options: GPTQConfig) -> tuple[np.ndarray, np.ndarray]:
    """The quantization order (decreasing H diagonal with `desc_act`) and the damped,
    permuted H^-1's upper Cholesky factor U (H^-1 = U^T U), float32; H's off-diagonal
    part shrunk (`hessian_shrink`), dead inputs' rows of H set to the identity's."""
    k = len(hessian)
    h = np.array(hessian, dtype=np.float64)  # one copy: the shrinkage and the damping write into it
    if options.hessian_shrink:
        diagonal = np.diag(h).copy()
        h *= 1.0 - options.hessian_shrink
        h[np.diag_indices(k)] = diagonal
    h[dead, dead] = 1.0
    order = np.argsort(-np.diag(h), kind="stable") if options.desc_act else np.arange(k)
    h = h[np.ix_(order, order)]
    h[np.diag_indices(k)] += options.damp_percent * np.mean(np.diag(h))
    return order, inverse_cholesky_upper(h, np.float32)  # the K x K float64 goes with this frame


def _static_params(w: np.ndarray, dead: np.ndarray, diag: np.ndarray, spec: ResolvedSpec, options: GPTQConfig,
                   scale_dtype: type) -> tuple[np.ndarray, np.ndarray] | None:
    """Every group's scales and zero points [N, groups] from the original weights (dead
    inputs zeroed), when `static_groups` or `desc_act` asks for them; None otherwise.
    All groups of all rows in one search where K is a whole number of groups (each row's
    result is its own, as group by group: the same values in fewer, larger numpy calls,
    which held the GIL for 16 s of SmolLM2's GPTQ when made per slice and group)."""
    if not (options.static_groups or options.desc_act):
        return None
    n, k = w.shape
    group = int(spec.group_size)
    groups = -(-k // group)
    step = max(1, min(STATIC_ELEMENTS // k, -(-n // cpu_count())))  # a piece per core at least

    def piece(r: int) -> tuple[np.ndarray, np.ndarray]:
        part = np.where(dead, np.float32(0.0), w[r:r + step]).astype(np.float64)
        if k % group == 0:
            scale, zero = _group_params(part.reshape(-1, group), spec, scale_dtype,
                                        diag.reshape(groups, group) if options.clip_search else None)
            return scale.reshape(-1, groups), zero.reshape(-1, groups)
        params = [_group_params(part[:, g * group:(g + 1) * group], spec, scale_dtype,
                                diag[g * group:(g + 1) * group] if options.clip_search else None) for g in range(groups)]
        return np.stack([p[0] for p in params], axis=1), np.stack([p[1] for p in params], axis=1)

    scales, zeros = zip(*ordered_map(piece, range(0, n, step)))
    return np.concatenate(scales), np.concatenate(zeros)


def _quantize_rows(w: np.ndarray, dead: np.ndarray, order: np.ndarray, upper: np.ndarray, diag: np.ndarray,
                   spec: ResolvedSpec, options: GPTQConfig, scale_dtype: type,
                   static: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ of some rows of W^T, with the permuted inverse Hessian's Cholesky factor
    (float32).

    Works on W (rows of W^T as columns, in quantization order) so that each step reads
    and updates contiguous rows, in float32 (the inverse Hessian's factor comes from
    float64): on random layers the codes differ from float64's in 2-5 weights per 10^6
    with equal output error, at a third of the time; SmolLM2 int4 b128 perplexity 18.72
    -> 18.77, the size of change any rounding difference gives GPTQ. Within a lazy
    block only the next `INNER` rows are updated per step; the rest of the block and the
    rows after it take the errors as one matrix product each."""
    info = int_type(spec.dtype, spec.bits)
    n, k = w.shape
    group = int(spec.group_size)
    w = w.astype(np.float64)  # a copy
    w[:, dead] = 0.0
    groups = -(-k // group)
    scales, zeros = (np.zeros((n, groups)), np.zeros((n, groups))) if static is None else static
    rows = np.ascontiguousarray(w[:, order].T, dtype=np.float32)  # [k, n]: row i is the i-th quantized
    s32, z32 = scales.T.astype(np.float32), zeros.T.astype(np.float32)  # [groups, n]
    codes = np.empty((k, n), np.float32)
    for i1 in range(0, k, options.block_size):
        i2 = min(i1 + options.block_size, k)
        errors = np.empty((i2 - i1, n), np.float32)
        for j1 in range(i1, i2, INNER):
            j2 = min(j1 + INNER, i2)
            for i in range(j1, j2):
                col = order[i]
                g = col // group
                if static is None and col % group == 0:  # first row of its group: parameters from now
                    current = rows[i:i + group].T.astype(np.float64)
                    scales[:, g], zeros[:, g] = _group_params(current, spec, scale_dtype,
                                                              diag[col:col + group] if options.clip_search else None)
                    s32[g], z32[g] = scales[:, g], zeros[:, g]
                s, z = s32[g], z32[g]
                q = np.rint(rows[i] / s + z)
                np.clip(q, info.qmin, info.qmax, out=q)
                codes[i] = q
                err = errors[i - i1]
                np.subtract(rows[i], (q - z) * s, out=err)
                err /= upper[i, i]
                if i + 1 < j2:
                    rows[i + 1:j2] -= upper[i, i + 1:j2, None] * err
            if j2 < i2:
                rows[j2:i2] -= upper[j1:j2, j2:i2].T @ errors[j1 - i1:j2 - i1]
        if i2 < k:
            rows[i2:] -= upper[i1:i2, i2:].T @ errors
    out = np.empty((n, k), np.int8)
    out[:, order] = codes.T
    return out, scales, zeros


def to_block_quantized(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, spec: ResolvedSpec,
                       scale_dtype: type) -> BlockQuantized:
    """GPTQ's result in MatMulNBits' layout (`numerics.blocks.packed`), K padded with
    zero-valued codes."""
    block = int(spec.group_size)
    n, k = codes.shape
    k_blocks = scales.shape[1]
    padded = np.repeat(zeros.astype(np.int16), block, axis=1)
    padded[:, :k] = codes
    return packed(padded.reshape(n, k_blocks, block), scales.astype(scale_dtype), zeros.astype(np.int16), spec, k)


NO_LAYERS = AlgorithmResult("no MatMul lowered to MatMulNBits (weight-only int4 blocks, e.g. W4_GROUP128)", idle=True)


@statistics_of("gptq")
def gptq_requests(model: ir.Model, plan: QuantPlan, options: GPTQConfig) -> list[Statistic]:
    """The Hessians of the calibration pass; none when true-sequential (they come later)."""
    return [] if options.true_sequential else hessian_requests(model, plan)


Layer = tuple[ir.Node, ResolvedSpec]
# Quantizes one group of layers sharing an input, given that input's H; returns, per
# layer, the weight [K, N] the model now computes with on the original input (None: kept).
GroupQuantizer = Callable[[list[Layer], np.ndarray], list[np.ndarray | None]]


def input_groups(model: ir.Model, layers: list[Layer]) -> list[list[Layer]]:
    """The layers grouped by input tensor, groups in the order their input is produced
    (a group's input never depends on a later group's weights)."""
    position = {id(node): i for i, node in enumerate(model.graph)}
    groups: dict[str, list[Layer]] = {}
    for node, spec in layers:
        groups.setdefault(node.inputs[0].name, []).append((node, spec))

    def produced_at(group: list[Layer]) -> int:
        producer = group[0][0].inputs[0].producer()
        return position.get(id(producer), -1) if producer is not None else -1

    return sorted(groups.values(), key=produced_at)


def sequential_walk(model: ir.Model, layers: list[Layer], ctx: AlgorithmContext, name: str,
                    quantize: GroupQuantizer, budget_mb: int) -> tuple[int, int | None]:
    """Call `quantize(group, H)` for each group of layers sharing an input, H from the
    inputs the model computes with every earlier group's returned weights in place
    (module doc); the number of layers quantized and the input rows each H summed. `quantize` may rewrite the model (AWQ
    inserts a Mul): the replay runs the graph as it was, with the returned weights."""
    data, calibration = ctx.settings.data, ctx.settings.calibration
    if not ctx.settings.access.readable:
        raise CalibrationDataError(f"{name} with true_sequential reads the calibration data layer by layer; pass "
                                   "calibration_data, or calibration.text for an LLM decoder (statistics files do not "
                                   "carry it), or set true_sequential: false")
    if not ctx.settings.access.rereadable:
        raise CalibrationDataError(f"{name} with true_sequential reads the calibration data again, but "
                                   f"{refusal(ctx.settings.access)}, or set true_sequential: false")
    groups = input_groups(model, layers)
    batches = iter_batches(data, model_inputs(model), calibration.batch_size, calibration.max_samples,
                           f"{name} data", calibration.max_batches)
    structure, weights = proto_without_weights(model)
    replay = Replay(None, structure, batches, calibration.providers, budget_mb << 20, weights)
    bar = progress_bar(groups, name, "group", ctx.settings.progress)
    done, rows = 0, None
    try:
        for group in bar:
            x = group[0][0].inputs[0].name
            weights = [node.inputs[1].name for node, _ in group]  # as the replay knows them
            gram = Accumulator(Statistic(x, "gram", -1))
            for index, batch in enumerate(replay.inputs([x])):
                gram.add_batch(batch[x], index)
            hessian = gram.result()
            if hessian is None:
                continue
            rows = gram.count
            with serial_blas():  # the factor's LAPACK beside onnxruntime's threads; slices thread themselves
                quantized = quantize(group, hessian)
            for weight_name, weight in zip(weights, quantized):
                if weight is not None:
                    replay.set_initializer(weight_name, weight)
                    done += 1
    finally:
        bar.close()
        replay.close()
    return done, rows


def walk_groups(model: ir.Model, plan: QuantPlan, ctx: AlgorithmContext, name: str, quantize: GroupQuantizer,
                sequential: bool, budget_mb: int) -> tuple[int, int, int | None]:
    """Call `quantize(group, H)` for each group of MatMuls lowered to MatMulNBits that
    share an input, in graph order: H from the quantized prefix (`sequential_walk`), or
    from the float model in the calibration pass (collected by the `statistics_of`
    request). Returns (layers quantized, layers, input rows per H where known)."""
    layers = matmul_nbits_layers(model, plan)
    if not layers:
        return 0, 0, None
    if sequential:
        done, rows = sequential_walk(model, layers, ctx, name, quantize, budget_mb)
        return done, len(layers), rows
    found = ctx.collect(model, hessian_requests(model, plan), name)
    done = 0
    for group in input_groups(model, layers):
        hessian = found.get(Statistic(group[0][0].inputs[0].name, "gram", -1))
        if hessian is not None:
            with serial_blas():
                done += sum(w is not None for w in quantize(group, hessian))
    return done, len(layers), None


@register_algorithm("gptq", options=GPTQConfig, data="required", rewrites=("weights",), flag=3,
                    rounds_blocks=True, serial_blas=True,
                    flag_help="GPTQ for int4 MatMul weights lowered to MatMulNBits (e.g. --preset W4_GROUP128): "
                              "rounding errors compensated through the calibration inputs' Hessian")
def gptq(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], options: GPTQConfig,
         ctx: AlgorithmContext) -> str | AlgorithmResult:
    """Quantize every MatMul lowered to MatMulNBits with GPTQ; pin the result for emission."""
    def quantize(layers: list[Layer], hessian: np.ndarray) -> list[np.ndarray | None]:
        """Layers of one spec and scale type in one `gptq_quantize`: their rows stacked
        share H's factor (rows are independent given H: the codes are each layer's own)."""
        scale_dtype = FLOAT_TYPES[weight_dtype(layers[0][0])]
        spec = layers[0][1]
        ws = [np.asarray(constant_array(node.inputs[1])) for node, _ in layers]
        stacked = ws[0].T if len(ws) == 1 else np.concatenate([w.T for w in ws])
        codes, scales, zeros = gptq_quantize(stacked, hessian, spec, options, scale_dtype)
        out: list[np.ndarray | None] = []
        start = 0
        for (node, _), w in zip(layers, ws):
            rows = slice(start, start + w.shape[1])
            start = rows.stop
            result = to_block_quantized(codes[rows], scales[rows], zeros[rows], spec, scale_dtype)
            ctx.weights.pin_node(node.name, node.inputs[1], result)
            drop_pages(node.inputs[1].const_value)  # read once; a mapped weight's pages may go
            out.append(dequantize_codes(codes[rows], scales[rows], zeros[rows], int(spec.group_size), scale_dtype)
                       .astype(w.dtype))
        return out

    def quantize_group(group: list[Layer], hessian: np.ndarray) -> list[np.ndarray | None]:
        kinds: dict[tuple, list[int]] = {}  # layers that may stack: one spec, one scale type
        for i, (node, spec) in enumerate(group):
            kinds.setdefault((spec, weight_dtype(node)), []).append(i)
        out: list[np.ndarray | None] = [None] * len(group)
        for members in kinds.values():
            for i, weight in zip(members, quantize([group[i] for i in members], hessian)):
                out[i] = weight
        return out

    done, total, rows = walk_groups(model, plan, ctx, "gptq", quantize_group, options.true_sequential,
                                    options.cache_budget_mb)
    if not total:
        return NO_LAYERS
    how = "true-sequential inputs" if options.true_sequential else "float-model inputs"
    return f"{done} of {total} MatMul weights quantized with GPTQ ({how})" + few_rows(rows, model, plan)


def few_rows(rows: int | None, model: ir.Model, plan: QuantPlan) -> str:
    """A warning, for the algorithm's note, where each Hessian summed fewer input rows
    than the widest layer has inputs: H is singular there, and the rows' error is pushed
    into directions the data never showed (SmolLM2-135M, 24 rows against 1536 inputs)."""
    widest = max((int(node.inputs[1].shape[0]) for node, _ in matmul_nbits_layers(model, plan)
                  if node.inputs[1].shape is not None and isinstance(node.inputs[1].shape[0], int)), default=0)
    if rows is None or rows >= widest:
        return ""
    return (f"; warning: only {rows} calibration rows (tokens of an LLM) for layers of up to {widest} inputs: the "
            f"Hessians are singular; give at least {widest} rows, better tens of times that")
