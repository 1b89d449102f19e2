"""AWQ (Lin et al. 2023), activation-aware weight quantization, for the MatMul weights
lowered to MatMulNBits, in numpy.

Input channels that carry large activations matter most. AWQ scales each input row k of
W [K, N] by s_k = m_k^alpha (m: the channel's RMS over calibration data), or by
m_k^alpha / w_k^(1 - alpha) (AutoAWQ's duo scaling, w_k: the row's relative weight
magnitude; by default both families are searched), quantizes W s
and divides the input by s, so the important rows get finer steps; then each block's
clipping is searched against the output error on the scaled input (importance
E[x_k^2] / s_k^2), and the result is pinned for the MatMulNBits lowering. alpha is searched on a grid per layer; each candidate's output error
E[|x (W - Q(W s) / s)|^2] = sum over columns of e^T H e is exact under H = E[x x^T],
which the calibration pass collects once (the `gram` statistic GPTQ uses), so no
candidate runs the model. The grid is scored coarse to fine, a heuristic that assumes
the error changes smoothly with alpha: every second alpha of each family, then the two
beside each family's best. On SmolLM2-135M's 120 groups it picked the full grid's
candidate in 114, with an output error 0.05% above the full grid's on average and 1.9%
at most (a random layer can lose more: 2.3% in tests/test_awq.py's duo case), in 25
scorings instead of 41; that run went from 70.8 to 61.2 s. The MatMuls sharing one input (q/k/v, gate/up: AWQ's scaling
layers) share one s, searched on their summed error, and 1/s goes into the weights of
the norm that produces that input where the group alone reads it (`norm_fold.py`, as
AutoAWQ scales the LayerNorm), else into one Mul on that input (float, per channel); a
group whose best alpha is 0 is left as it is. Groups go in graph
order with H taken from the model whose earlier groups are already scaled and quantized
(`gptq.sequential_walk`, `true_sequential`), so memory holds one group's H; without it,
every H comes from the float model in the calibration pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnxq.calibrate.statistics import Statistic
from onnxq.config.resolve import ResolvedSpec
from onnxq.errors import ConfigError
from onnxq.graph.edit import GraphEditor
from onnxq.graph.external_data import drop_pages
from onnxq.graph.fold import constant_array
from onnxq.numerics.blocks import (
    BlockQuantized,
    dequantize_blockwise,
    quantize_blockwise,
    rounded_blockwise,
)
from onnxq.optimize.context import AlgorithmContext, AlgorithmResult
from onnxq.optimize.gptq import NO_LAYERS, Layer, hessian_requests, walk_groups
from onnxq.optimize.norm_fold import fold_input_scale
from onnxq.optimize.registry import register_algorithm, statistics_of
from onnxq.parallel import ordered_map
from onnxq.plan import QuantPlan
from onnxq.plan.strategies.matmul_nbits import FLOAT_TYPES, weight_dtype

SCALINGS = ("activation", "duo", "both")


@dataclass(frozen=True)
class AWQConfig:
    """Options of `awq` (bits, sym and group_size come from the weight spec). grid:
    alpha candidates in (0, 1] per family, scored coarse to fine (module doc). scaling: the candidate families, `activation`
    (s = m^alpha, the paper's), `duo` (s = m^alpha / w^(1 - alpha), AutoAWQ's
    duo_scaling, w: the input channel's mean weight magnitude relative to its block's
    largest) or `both` (the candidates of the two; SmolLM2 int4 b32 perplexity 18.90
    with `activation`, 18.70 with `duo`, 18.39 with `both`). min_gain: the share by which
    the output error must drop for a layer to be scaled (its Mul costs time; a smaller
    gain is noise). search_columns: output columns each candidate is scored on (evenly
    spaced; 0: all); the chosen scaling then quantizes every column (SmolLM2 int4 b128:
    perplexity 22.1 with all columns, 21.9 with 256, the whole run in half the time)."""

    ALGORITHM: ClassVar[str] = "awq"

    grid: int = 20
    scaling: str = "both"
    min_gain: float = 0.02
    search_columns: int = 256
    true_sequential: bool = True
    cache_budget_mb: int = 256

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise ConfigError(f"awq: grid must be at least 1, got {self.grid}")
        if self.scaling not in SCALINGS:
            raise ConfigError(f"awq: scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"awq: min_gain must be in [0, 1), got {self.min_gain}")
        if self.search_columns < 0:
            raise ConfigError(f"awq: search_columns must be >= 0 (0: all), got {self.search_columns}")
        if self.cache_budget_mb < 0:
            raise ConfigError(f"awq: cache_budget_mb must be >= 0, got {self.cache_budget_mb}")


@statistics_of("awq")
def awq_requests(model: ir.Model, plan: QuantPlan, options: AWQConfig) -> list[Statistic]:
    return [] if options.true_sequential else hessian_requests(model, plan)


# Output columns handled at once: an LLM head (49152 columns) never gets whole float64
# error copies.
COLUMN_CHUNK = 4096


def output_error(w: np.ndarray, w_hat: np.ndarray, hessian: np.ndarray) -> float:
    """E[|x (w - w_hat)|^2] for inputs x with second moment `hessian` (w: [K, N]): the
    product in float32 (2-3x faster than float64 on these shapes, equal to 7 digits, far
    finer than candidates differ), summed in float64."""
    e = (w - w_hat).astype(np.float32)
    return float(np.sum(e * (hessian.astype(np.float32, copy=False) @ e), dtype=np.float64))


def _rounded(w: np.ndarray, s: np.ndarray, spec: ResolvedSpec, scale_dtype: type) -> np.ndarray:
    """Q(W s) / s: what the MatMul computes on the unscaled input, with plain rounding
    (an HQQ weight spec's zero-point solver runs once, on the chosen scaling), without
    packing the codes (`rounded_blockwise`)."""
    plain = dataclasses.replace(spec, calib_method="minmax") if spec.calib_method == "hqq" else spec
    return rounded_blockwise((w * s[:, None]).astype(np.float32), plain, scale_dtype) / s[:, None]


def scaled_error(w: np.ndarray, s: np.ndarray, spec: ResolvedSpec, scale_dtype: type, hessian: np.ndarray) -> float:
    """`output_error` of `_rounded(w, s)`, a slice of output columns at a time."""
    return sum(output_error(w[:, i:i + COLUMN_CHUNK], _rounded(w[:, i:i + COLUMN_CHUNK], s, spec, scale_dtype),
                            hessian) for i in range(0, w.shape[1], COLUMN_CHUNK))


def weight_magnitude(weights: list[np.ndarray], block: int) -> np.ndarray:
    """Per input channel, the mean over `weights` (which share the input) of |w| relative
    to the largest |w| of its quantization block: AutoAWQ's w_mean."""
    total, count = None, 0
    for w in weights:
        k, n = w.shape
        k_blocks = -(-k // block)
        padded = np.zeros((k_blocks * block, n), dtype=np.float32)
        padded[:k] = np.abs(w)
        blocks = padded.reshape(k_blocks, block, n)
        relative = blocks / np.maximum(blocks.max(axis=1, keepdims=True), 1e-12)
        part = relative.reshape(-1, n)[:k].sum(axis=1, dtype=np.float64)
        total, count = part if total is None else total + part, count + n
    return total / count


def candidates(rms: np.ndarray, magnitude: np.ndarray | None, grid: int,
               scaling: str) -> list[tuple[float, np.ndarray]]:
    """(alpha, s) of each candidate of the `scaling` families (`AWQConfig`), s centred so
    the weights keep their magnitude; `magnitude` (`weight_magnitude`) only for duo."""
    out = []
    families = ("activation", "duo") if scaling == "both" else (scaling,)
    for family in families:
        for alpha in np.arange(1, grid + 1) / grid:
            s = rms ** alpha if family == "activation" else rms ** alpha / np.maximum(magnitude, 1e-4) ** (1 - alpha)
            out.append((float(alpha), s / np.sqrt(s.max() * s.min())))
    return out


def sampled_columns(w: np.ndarray, count: int) -> np.ndarray:
    """About `count` evenly spaced output columns of `w` [K, N] (all when 0 or N <= count):
    each column's error is a sum over its own blocks, so a spread subset ranks the
    candidates as all of them do, at a fraction of the cost."""
    step = w.shape[1] // count if count else 1
    return w if step <= 1 else np.ascontiguousarray(w[:, ::step])


def search_scales(weights: list[np.ndarray], hessian: np.ndarray, specs: list[ResolvedSpec],
                  scale_dtypes: list[type], grid: int, min_gain: float = 0.0,
                  scaling: str = "activation", columns: int = 0) -> tuple[float, np.ndarray]:
    """The candidate of least summed output error over `weights` (which share the input),
    scored on `columns` output columns of each (`sampled_columns`): its alpha and
    per-input-channel scales (module doc); alpha 0 (no scaling) unless the error drops by
    at least `min_gain`. Candidates are scored on every core."""
    rms = np.sqrt(np.maximum(np.diag(hessian), 1e-12))
    magnitude = None if scaling == "activation" else weight_magnitude(weights, int(specs[0].group_size))
    weights = [sampled_columns(w, columns) for w in weights]
    h32 = hessian.astype(np.float32)  # once, not per candidate (`output_error`)

    def error(s: np.ndarray) -> float:
        return sum(scaled_error(w, s, sp, dt, h32) for w, sp, dt in zip(weights, specs, scale_dtypes))

    ones = np.ones(len(rms))
    best = (error(ones) * (1 - min_gain), 0.0, ones)
    options = candidates(rms, magnitude, grid, scaling)
    coarse = coarse_indices(len(options), grid)
    scored = dict(zip(coarse, ordered_map(lambda i: error(options[i][1]), coarse)))
    near = beside_best(scored, grid)
    scored.update(zip(near, ordered_map(lambda i: error(options[i][1]), near)))
    for i in sorted(scored):  # in candidate order: ties keep the earlier one, as a serial search does
        if scored[i] < best[0]:
            best = (scored[i], *options[i])
    return best[1], best[2]


def coarse_indices(count: int, grid: int) -> list[int]:
    """The candidates scored first: every second alpha of each family (0.1, 0.2, ..., 1.0
    of a grid of 20); the two beside each family's best are scored next (`search_scales`),
    which finds the full grid's choice in most groups at a little over half its cost
    (module doc). A grid under 6 is scored whole: coarse, then fine, would save at most
    one scoring per family there."""
    if grid < 6:
        return list(range(count))
    return [i for i in range(count) if i % grid % 2 == 1]


def beside_best(scored: dict[int, float], grid: int) -> list[int]:
    """The unscored candidates next to each family's best scored one (families are runs
    of `grid` candidates; ties: the earlier), in candidate order."""
    families: dict[int, int] = {}
    for i in sorted(scored):
        family = i // grid
        if family not in families or scored[i] < scored[families[family]]:
            families[family] = i
    return sorted(j for best in families.values() for j in (best - 1, best + 1)
                  if j // grid == best // grid and j not in scored)


def clipped(w: np.ndarray, s: np.ndarray, spec: ResolvedSpec, scale_dtype: type,
            hessian: np.ndarray) -> BlockQuantized:
    """W s quantized with each block's clipping searched against the output error of the
    MatMul's input x / s (importance E[x_k^2] / s_k^2): AWQ's clipping step."""
    importance = np.diag(hessian) / np.square(s)
    return quantize_blockwise((w * s[:, None]).astype(np.float32), spec, scale_dtype, True, importance)


def _scaled_initializer(edit: GraphEditor, weight: ir.Value, s: np.ndarray) -> ir.Value:
    """An initializer W s computed only when read: the lowering stores the pinned int4
    result, so a big model never holds a second float copy of its scaled weights."""
    original = weight.const_value

    def scaled() -> ir.Tensor:
        w = original.numpy()
        return ir.Tensor((w * s[:, None].astype(w.dtype)).astype(w.dtype))

    name = edit.unique(f"{weight.name}_awq")
    value = ir.Value(name=name, shape=ir.Shape(original.shape), type=ir.TensorType(original.dtype),
                     const_value=ir.LazyTensor(scaled, original.dtype, ir.Shape(original.shape), name=name))
    edit.graph.register_initializer(value)
    return value


@register_algorithm("awq", options=AWQConfig, data="required", rewrites=("weights", "graph"), flag=4,
                    rounds_blocks=True,
                    flag_help="AWQ for int4 MatMul weights lowered to MatMulNBits: input channels with large "
                              "activations get finer steps (per-layer alpha search on the calibration data)")
def awq(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], options: AWQConfig,
        ctx: AlgorithmContext) -> str | AlgorithmResult:
    """Scale the input rows of every MatMul lowered to MatMulNBits (module doc)."""
    edit = GraphEditor(model.graph)
    alphas: list[float] = []
    folds: list[bool] = []  # per group: its scale went into the norm before it (`norm_fold.py`)

    tied = {tie.head for tie in plan.tied.values() if tie.block_size}

    def scale_group(group: list[Layer], hessian: np.ndarray) -> list[np.ndarray | None]:
        """The group's layers whose weight only they read get one shared scale; the rest
        (a shared weight, or a tied LM head's: the embedding reads its codes unscaled) keep
        round-to-nearest. Results are aligned with `group`."""
        own = [(node, spec) for node, spec in group if len(node.inputs[1].uses()) == 1 and node.name not in tied]
        if not own:
            return [None] * len(group)
        weights = [np.asarray(constant_array(node.inputs[1])) for node, _ in own]
        dtypes = [FLOAT_TYPES[weight_dtype(node)] for node, _ in own]
        alpha, s = search_scales(weights, hessian, [spec for _, spec in own], dtypes, options.grid,
                                 options.min_gain, options.scaling, options.search_columns)
        alphas.append(alpha)
        x = own[0][0].inputs[0]
        folded = alpha > 0.0 and len(own) == len(group) and fold_input_scale(
            edit, x, {node.name for node, _ in group}, (1.0 / s).astype(weights[0].dtype))
        folds.append(folded)
        if alpha > 0.0 and not folded:
            inverse = edit.initializer(f"{own[0][0].name}_awq_inverse_scale", (1.0 / s).astype(weights[0].dtype))
            scaled = edit.add_node("Mul", [x, inverse], f"{x.name}_awq", dtype=x.dtype, shape=x.shape)
        effective: dict[str, np.ndarray] = {}
        for (node, spec), w, dtype in zip(own, weights, dtypes):
            original = node.inputs[1].const_value
            if alpha > 0.0:
                node.replace_input_with(1, _scaled_initializer(edit, node.inputs[1], s))
                if not folded:
                    node.replace_input_with(0, scaled)
            result = clipped(w, s, spec, dtype, hessian)
            ctx.weights.pin_node(node.name, node.inputs[1], result)
            drop_pages(original)
            effective[node.name] = (dequantize_blockwise(result) / s[:, None]).astype(w.dtype)
        return [effective.get(node.name) for node, _ in group]

    _, total, _ = walk_groups(model, plan, ctx, "awq", scale_group, options.true_sequential, options.cache_budget_mb)
    if not total:
        return NO_LAYERS
    model.graph.sort()
    moved = sum(a > 0 for a in alphas)
    return (f"{moved} of {len(alphas)} input groups ({total} MatMul weights) scaled (alpha median "
            f"{float(np.median(alphas)) if alphas else 0:.2f}; {sum(folds)} folded into the norm before them, "
            f"{moved - sum(folds)} by a Mul); every block's clipping searched against its output error")
