"""Empirical bias correction (Nagel et al., "Data-Free Quantization", ICCV 2019, sec. 4.2).

Rounding weights shifts the mean of every output channel: E[y_q - y] = (W_q - W) E[x].
This algorithm runs after calibration, quantizes each weight exactly as the emitter will
(same spec, axis and bias-safe scale floor), measures E[x] of the layer's input on the
calibration data (collected in the calibration pass: per-channel sums inside onnxruntime) and subtracts the expected
error from the bias.

- Gemm / MatMul: the error is (W_q - W) applied to the per-channel mean of the input.
- Conv: the error is conv(E[x], W_q - W) averaged over output positions: the weight error
  times, per channel and kernel tap, the mean of the zero-padded input values the tap
  reads (window means, summed inside onnxruntime with calibration), so padding and
  strides are accounted for exactly; a 1x1, stride-1, unpadded Conv needs channel means
  alone.
- Bias: Conv and Gemm without one get one (int32, like the model's other biases);
  a MatMul is corrected through the Add of a constant [N] vector that alone consumes
  its output, and skipped without one (adding an Add would add a quantized op).
- Layers whose weight or bias initializer is shared with other nodes are skipped, and so
  are layers whose bias AdaRound/AdaQuant fitted (`bias: true`): their bias already
  corrects the mean output error against the quantized model's own inputs, and a second
  correction from float inputs undoes that (MobileNet-v1 per-tensor int8: 85.25 -> 60.9).

This file is the algorithm (its options, the analytic and empirical passes);
`bias_layers.py` finds the layers and their input means, `bias_solve.py` solves one
layer's corrected bias as emission will quantize it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from onnxq.calibrate.access import refusal
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.resolve import ResolvedSpec
from onnxq.numerics.qmath import MAX_QUANTIZABLE_RANGE
from onnxq.optimize.bias_layers import (
    InputMean,
    Layer,
    find_layers,
    input_means,
    means_of,
    requests,
)
from onnxq.optimize.bias_solve import (
    Emission,
    ErrorFn,
    correct,
    float_bias,
    output_error,
    planned_bias_spec,
)
from onnxq.optimize.context import AlgorithmContext
from onnxq.optimize.registry import register_algorithm, statistics_of
from onnxq.plan import QuantPlan

OP_TYPES = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class BiasCorrectionConfig:
    """Options of the `bias_correction` algorithm.

    op_types: layer types to correct. skip_layers: node names left alone.
    add_bias: give Conv/Gemm layers without a bias one to hold the correction.
    empirical: after the correction from float inputs, set each bias, layer by layer in
      graph order, so that the layer's mean output over its inputs in the quantized model
      (as emitted, the layers before it corrected) equals the float layer's (Nagel et
      al.'s empirical correction): it also removes the mean shift that upstream rounding
      and clipping carry through nonlinearities. One pass over the calibration data per
      layer.
    """

    ALGORITHM: ClassVar[str] = "bias_correction"

    op_types: tuple[str, ...] = OP_TYPES
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    add_bias: bool = True
    empirical: bool = False


@statistics_of("bias_correction")
def bias_correction_requests(model: ir.Model, plan: QuantPlan, opts: BiasCorrectionConfig) -> list[Statistic]:
    """Requested before calibration, so the calibration pass collects them too."""
    layers, _ = find_layers(model.graph, plan, opts)
    return requests(layers)


# Every target adds it to static plans with quantized Conv/Gemm layers (`Contract.target_default`):
# rounding shifts each output channel's mean, and depthwise layers with few taps per channel
# keep much of it; narrowed weights (7-bit, pair-safe) raise it (MobileNet v1 0.75, default
# session: full 8-bit weights 83.5 -> 85.5 top-1 on an AVX512-VNNI CPU, pair-safe weights
# 83.25 -> 85.0 on AVX2; float 85.5; ResNet-20 unchanged).
@register_algorithm("bias_correction", options=BiasCorrectionConfig, data="required", rewrites=("biases",),
                    runs_last=True, flag=0, target_default={"op_types": ["Conv", "Gemm"]},
                    flag_help="correct the mean output error that weight quantization adds to each bias")
def bias_correction(
    model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]],
    opts: BiasCorrectionConfig, ctx: AlgorithmContext,
) -> str | tuple[str, QuantPlan]:
    """Remove the mean output error that weight rounding causes (see module doc)."""
    layers, skipped = find_layers(model.graph, plan, opts)
    fitted = [x for x in layers if x.node.name in ctx.fitted_biases]
    layers = [x for x in layers if x.node.name not in ctx.fitted_biases]
    if fitted and not layers and not skipped:
        by = sorted({ctx.fitted_biases[x.node.name] for x in fitted})
        return f"nothing to correct: the biases of all {len(fitted)} layers were fitted by {' and '.join(by)}"
    skipped += [f"{x.node.name} (bias fitted by {ctx.fitted_biases[x.node.name]})" for x in fitted]
    if not layers:
        dynamic = plan.nodes_for("dynamic")
        why = (f" ({len(dynamic)} quantized dynamically: their activations' grid is set at run time, and "
               "their kernels take no separate bias)" if dynamic else "")
        return "no statically quantized layer to correct" + why + (
            f"; skipped {', '.join(skipped[:5])}" if skipped else "")
    means = input_means(model, layers, ctx)
    emission = Emission(model, plan, ranges, ctx.weights)
    bias_spec = planned_bias_spec(plan)
    added = sum(1 for layer in layers if layer.bias_index >= len(layer.bias_node.inputs)
                or layer.bias_node.inputs[layer.bias_index] is None)
    base = {layer.node.name: float_bias(layer) for layer in layers}
    corrected = set()
    for layer in layers:
        mean = means.get(layer.node.inputs[0].name)
        if mean is None:
            continue
        if not mean.usable:
            skipped.append(f"{layer.node.name} (input mean beyond +-{MAX_QUANTIZABLE_RANGE:g}: a masking value in "
                           "the data)")
            continue
        new_plan = correct(model, plan, layer, _analytic(layer, mean), emission, bias_spec)
        if new_plan is not None:
            plan = new_plan
            corrected.add(layer.node.name)
    note = f"{len(corrected)} of {len(layers)} biases corrected"
    if added:
        note += f" ({added} added)"
    if opts.empirical and corrected:
        plan, extra = _empirical(model, plan, ranges, [x for x in layers if x.node.name in corrected], means,
                                 base, ctx, bias_spec)
        note += extra
    if skipped:
        note += f"; {len(skipped)} skipped: {', '.join(skipped[:3])}" + (" ..." if len(skipped) > 3 else "")
    return note, plan


def _analytic(layer: Layer, mean: InputMean) -> ErrorFn:
    """E[(W_q - W) x] over the float inputs."""
    return lambda wq, w: output_error(layer, np.subtract(wq, w, dtype=np.float64), mean)


def _empirical_error(layer: Layer, float_mean: InputMean, quant_mean: InputMean) -> ErrorFn:
    """E[W_q x_q] - E[W x]: the quantized layer's mean output over its quantized inputs
    against the float layer's over float inputs (biases aside)."""
    return lambda wq, w: (output_error(layer, wq.astype(np.float64), quant_mean)
                          - output_error(layer, w.astype(np.float64), float_mean))


def _empirical(model: ir.Model, plan: QuantPlan, ranges: Mapping[str, tuple[float, float]], layers: list[Layer],
               float_means: Mapping[str, InputMean], base: Mapping[str, np.ndarray], ctx: AlgorithmContext,
               bias_spec: ResolvedSpec | None) -> tuple[QuantPlan, str]:
    """Empirical correction, one layer at a time in graph order: emit the model as it is
    (the layers before already corrected), measure the layer's quantized input means in a
    pass over the data, and re-solve its bias from its original value. Sequential on
    purpose: correcting every layer from one measurement counts each upstream shift twice
    (once in the upstream bias, once downstream), and on MobileNet v1 that compounded
    through the depth to 2 dB of output SQNR. Re-emitting per layer (rather than replaying
    one emitted graph, as AdaRound does) keeps every emission layout right by construction
    and streams the data: MobileNet v1 18.6 s and 420 MB peak, against 9.0 s and 889 MB
    replayed."""
    if not ctx.settings.access.rereadable:
        return plan, f"; not empirical: {refusal(ctx.settings.access)}"
    done = 0
    for layer in layers:
        fmean = float_means.get(layer.node.inputs[0].name)
        if fmean is None:
            continue
        emitted = model.clone()
        ctx.emit_trial(emitted, plan, ranges, ctx.weights)
        twin = next((n for n in emitted.graph if n.name == layer.node.name), None)
        if twin is None:
            continue
        stats = requests([dataclasses.replace(layer, node=twin)])
        name = twin.inputs[0].name
        _prefix(emitted, twin.inputs[0])  # the layer itself goes too
        found = collect(emitted, stats, ctx.settings.data, ctx.settings.calibration, False,
                        "bias correction (empirical)")
        quant = means_of(name, stats, found)
        if quant is None:
            continue
        emission = Emission(model, plan, ranges, ctx.weights)
        new_plan = correct(model, plan, layer, _empirical_error(layer, fmean, quant), emission, bias_spec,
                           base[layer.node.name])
        plan = new_plan if new_plan is not None else plan
        done += 1
    return plan, f"; {done} empirical (on the quantized model's own inputs, layer by layer)"


def _prefix(model: ir.Model, value: ir.Value) -> None:
    """Cut `model` down to the nodes `value` needs, with `value` its only output (each
    layer's pass then runs the model up to that layer, not the whole of it)."""
    if value.is_graph_input():
        return
    model.graph.outputs.clear()
    model.graph.outputs.append(value)
    RemoveUnusedNodesPass()(model)
