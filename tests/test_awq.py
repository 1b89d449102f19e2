"""AWQ for MatMulNBits weights (issue 14): when a few input channels carry large
activations, scaling their weight rows up before round-to-nearest (and the input down by
a Mul) lowers the output error on held-out data; where it cannot help, the layer stays."""

from __future__ import annotations

import numpy as np
import onnx
from helpers import GraphBuilder, run, sqnr_db

import onnxq

K, N = 256, 96
GAIN = np.exp(np.random.default_rng(9).uniform(-1.5, 1.5, K))
GAIN[:8] *= 20  # outlier channels, as LLM hidden states have


def _model() -> onnx.ModelProto:
    b = GraphBuilder(1)
    x = b.input("x", ["N", 8, K])
    w = (np.random.default_rng(0).standard_normal((K, N)) * 0.05).astype(np.float32)
    return b.build([b.node("MatMul", [x, b.const("w", w)])], name="mm")


def _data(n: int, seed: int, gain: np.ndarray = GAIN) -> dict[str, np.ndarray]:
    return {"x": (np.random.default_rng(seed).standard_normal((n, 8, K)) * gain).astype(np.float32)}


def _quantize(algorithms: list[dict], data: dict) -> onnxq.QuantizationResult:
    config = {"preset": "W4_GROUP128", "algo_config": algorithms,
              "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}
    return onnxq.quantize(_model(), None, onnxq.as_config(config), data, progress=False)


def test_awq_protects_channels_with_large_activations():
    calib, held_out = _data(48, 1), _data(24, 2)
    ref = run(_model(), held_out)
    rtn = sqnr_db(ref, run(_quantize([], calib).model, held_out))
    result = _quantize([{"name": "awq"}], calib)
    onnx.checker.check_model(result.model)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops == ["Mul", "MatMulNBits"], ops
    assert "1 of 1 input groups (1 MatMul weights) scaled" in " ".join(result.summary.note_texts)
    assert sqnr_db(ref, run(result.model, held_out)) > rtn + 1.5


def test_awq_leaves_a_layer_it_cannot_help():
    flat = np.ones(K)
    result = _quantize([{"name": "awq", "grid": 4}], _data(16, 3, flat))
    assert [n.op_type for n in result.model.graph.node] == ["MatMulNBits"]
    assert "0 of 1 input groups (1 MatMul weights) scaled" in " ".join(result.summary.note_texts)


def _shared_input_model() -> onnx.ModelProto:
    """q/k/v-like: three MatMuls reading one input, their outputs summed."""
    rng = np.random.default_rng(1)
    b = GraphBuilder(1)
    x = b.input("x", ["N", 8, K])
    mms = [b.node("MatMul", [x, b.const(f"w{i}", (rng.standard_normal((K, N)) * 0.05).astype(np.float32))])
           for i in range(3)]
    add = b.node("Add", [mms[0], mms[1]])
    return b.build([*mms, add, b.node("Add", [add, mms[2]])], name="qkv")


def test_matmuls_sharing_an_input_share_one_scale():
    """AWQ's scaling layers: one Mul feeds all three, from the sequential walk and from the
    calibration pass alike, and the output gets closer to float than round-to-nearest."""
    model, calib, held_out = _shared_input_model(), _data(32, 1), _data(16, 2)
    ref = run(model, held_out)
    base = {"preset": "W4_GROUP128", "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}}
    rtn = sqnr_db(ref, run(onnxq.quantize(model, None, base, calib, progress=False).model, held_out))
    for sequential in (True, False):
        config = {**base, "algo_config": [{"name": "awq", "true_sequential": sequential}]}
        result = onnxq.quantize(model, None, config, calib, progress=False)
        ops = [n.op_type for n in result.model.graph.node]
        assert ops.count("Mul") == 1 and ops.count("MatMulNBits") == 3, ops
        mul = next(n for n in result.model.graph.node if n.op_type == "Mul")
        assert sum(mul.output[0] in n.input for n in result.model.graph.node) == 3
        assert "1 of 1 input groups (3 MatMul weights) scaled" in " ".join(result.summary.note_texts)
        assert sqnr_db(ref, run(result.model, held_out)) > rtn + 1.0


def test_searching_both_scale_families_is_never_worse():
    """`scaling: both` scores every candidate of the activation-only and the duo family,
    so its output error is at most the better of the two alone; a bad value is refused."""
    import pytest

    from onnxq.config.resolve import ResolvedSpec
    from onnxq.errors import ConfigError
    from onnxq.numerics.qmath import DType
    from onnxq.optimize.awq import AWQConfig, _rounded, output_error, search_scales

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    w[:, :4] *= 6  # a few large output columns: the weights' own per-channel magnitudes vary
    x = (rng.standard_normal((512, K)) * GAIN).astype(np.float32)
    hessian = (x.T.astype(np.float64) @ x) / len(x)
    spec = ResolvedSpec(DType.INT4, True, "per_group", None, 32, "minmax", 99.99, 2048, (), None, None,
                        "float32", "half_even", False)
    errors = {}
    for scaling in ("activation", "duo", "both"):
        _, s = search_scales([w], hessian, [spec], [np.float32], 10, 0.0, scaling)
        errors[scaling] = output_error(w, _rounded(w, s, spec, np.float32), hessian)
    assert errors["duo"] != errors["activation"]  # the families differ here
    assert errors["both"] <= min(errors["activation"], errors["duo"]) * (1 + 1e-9)
    with pytest.raises(ConfigError, match="scaling must be one of"):
        AWQConfig(scaling="weights")


def test_alpha_search_scores_coarse_then_beside_the_best(monkeypatch):
    """A grid of 20 per family scores every second alpha (0.1, 0.2, ..., 1.0), then the
    two beside each family's best: 25 scorings instead of 41. With an error least at
    alpha 0.36, the coarse step finds 0.4 and the fine step 0.35, the full grid's choice;
    scoring on ties keeps the earlier candidate."""
    from onnxq.config.resolve import ResolvedSpec
    from onnxq.numerics.qmath import DType
    from onnxq.optimize import awq

    spec = ResolvedSpec(DType.INT4, True, "per_group", None, 32, "minmax", 99.99, 2048, (), None, None,
                        "float32", "half_even", False)
    w = np.ones((K, N), np.float32)
    hessian = np.eye(K)
    # candidate s encodes its alpha (and family: duo's are shifted by 10); error |alpha - 0.36|, duo's worse
    monkeypatch.setattr(awq, "candidates", lambda rms, magnitude, grid, scaling: [
        (a, np.full(K, a + 10 * f)) for f in range(2) for a in np.arange(1, grid + 1) / grid])
    scored: list[float] = []

    def error(w, s, spec, dtype, h):
        first = not scored  # alpha 0 (s = 1) is scored first, alone
        scored.append(float(s[0]))
        return 10.0 if first else 1.0 + abs(s[0] % 10 - 0.36) + 0.5 * (s[0] // 10)

    monkeypatch.setattr(awq, "scaled_error", error)
    alpha, s = awq.search_scales([w], hessian, [spec], [np.float32], 20, 0.0, "both")
    assert alpha == 0.35 and s[0] == 0.35
    coarse = [f * 10 + 0.1 * i for f in range(2) for i in range(1, 11)]
    beside = [0.35, 0.45, 10.35, 10.45]  # duo's best coarse alpha is 0.4 too
    assert sorted(round(a, 2) for a in scored[1:]) == sorted(round(a, 2) for a in coarse + beside)


def test_awq_on_hqq_weights_scales_then_solves_zero_points():
    """uint4 asymmetric weights with `calib_method: hqq`: AWQ scores its candidates with
    plain rounding and quantizes the chosen scaling with HQQ's float zero points; better
    than HQQ alone on inputs with outlier channels."""
    calib, held_out = _data(48, 1), _data(24, 2)
    ref = run(_model(), held_out)
    hqq_weight = {"dtype": "uint4", "symmetric": False, "calib_method": "hqq", "group_size": 32}

    def quantize(algorithms: list[dict]) -> onnxq.QuantizationResult:
        config = {"preset": "W4_GROUP128", "algo_config": algorithms,
                  "layer_type_quant_config": {"MatMul": {"weight": hqq_weight}}}
        return onnxq.quantize(_model(), None, onnxq.as_config(config), calib, progress=False)

    hqq, awq = quantize([]), quantize([{"name": "awq"}])
    onnx.checker.check_model(awq.model)
    assert [n.op_type for n in awq.model.graph.node] == ["Mul", "MatMulNBits"]
    zero_points = next(i for i in awq.model.graph.initializer if i.name.endswith("zero_points"))
    assert zero_points.data_type == onnx.TensorProto.FLOAT  # HQQ's float zero points
    assert sqnr_db(ref, run(awq.model, held_out)) > sqnr_db(ref, run(hqq.model, held_out)) + 1.0


def _normed_model() -> onnx.ModelProto:
    """gate/up-like: two MatMuls reading a LayerNormalization's output, summed."""
    rng = np.random.default_rng(4)
    b = GraphBuilder(1)
    x = b.input("x", ["N", 8, K])
    normed = b.node("LayerNormalization", [x, b.const("gamma", (1 + GAIN / 40).astype(np.float32)),
                                           b.const("beta", (rng.standard_normal(K) * 0.1).astype(np.float32))],
                    axis=-1)
    mms = [b.node("MatMul", [normed, b.const(f"w{i}", (rng.standard_normal((K, N)) * 0.05).astype(np.float32))])
           for i in range(2)]
    return b.build([b.node("Add", mms)], opset=17, name="normed")


def test_awq_scale_goes_into_the_norm_before_the_group(monkeypatch):
    """The shared input's 1/s is folded into the LayerNormalization's gamma and beta
    instead of a Mul on the activations; the outputs are those of the Mul form."""
    import onnxq.optimize.awq as awq_module

    calib, held_out = _data(48, 1), _data(24, 2)
    config = onnxq.as_config({"preset": "W4_GROUP128", "algo_config": [{"name": "awq"}],
                              "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}}})
    folded = onnxq.quantize(_normed_model(), None, config, calib, progress=False)
    onnx.checker.check_model(folded.model)
    assert [n.op_type for n in folded.model.graph.node] == ["LayerNormalization", "MatMulNBits", "MatMulNBits", "Add"]
    assert "1 folded into the norm before them, 0 by a Mul" in " ".join(folded.summary.note_texts)
    monkeypatch.setattr(awq_module, "fold_input_scale", lambda *args: False)
    with_mul = onnxq.quantize(_normed_model(), None, config, calib, progress=False)
    assert "Mul" in [n.op_type for n in with_mul.model.graph.node]
    a, b = run(folded.model, held_out), run(with_mul.model, held_out)
    assert sqnr_db(b, a) > 60  # the same model up to float rounding
    assert sqnr_db(run(_normed_model(), held_out), a) > 15
