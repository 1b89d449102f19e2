"""AdaRound and AdaQuant (onnxq/optimize/layerwise): exact statistics, layer inputs that
match the models, better held-out outputs than nearest rounding in a default session,
determinism, and the bad-input paths."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import image_classifier, run, sqnr_db, uneven_weights
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.cli import main
from onnxq.errors import ConfigError
from onnxq.notes import Topic, of
from onnxq.optimize.layerwise import driver
from onnxq.optimize.layerwise.gram import Gram
from onnxq.optimize.layerwise.grid import IntegerGrid
from onnxq.optimize.layerwise.layers import to_matrices
from onnxq.optimize.layerwise.replay import Replay
from onnxq.target.pairs import PAIR_LIMIT, pair_indices


def cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv-Relu, depthwise Conv-Relu, pointwise Conv-Relu, pool, Gemm: a small MobileNet."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": uneven_weights(rng, (16, 3, 3, 3)), "b1": rng.normal(0, 0.1, 16).astype(np.float32),
        "w2": uneven_weights(rng, (16, 1, 3, 3)) * 3, "b2": rng.normal(0, 0.1, 16).astype(np.float32),
        "w3": uneven_weights(rng, (24, 16, 1, 1)), "b3": rng.normal(0, 0.1, 24).astype(np.float32),
        "w4": uneven_weights(rng, (10, 24)), "b4": rng.normal(0, 0.1, 10).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="dw", pads=[1, 1, 1, 1], group=16, strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="pw"),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w4", "b4"], ["y"], name="fc", transB=1),
    ]
    return image_classifier(nodes, inits, "cnn")


def images(n: int, seed: int) -> np.ndarray:
    """Smooth random images: sums of a few low-frequency waves per channel."""
    rng = np.random.default_rng(seed)
    yy, xx = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    out = np.zeros((n, 3, 16, 16), np.float32)
    for _ in range(4):
        fy, fx, phase = rng.uniform(0, 0.6, (3, n, 3, 1, 1))
        out += np.sin(fy * yy + fx * xx + 6 * phase) * rng.uniform(0.2, 1.0, (n, 3, 1, 1))
    return out


CALIB, HELD_OUT = images(64, 1), images(48, 2)
INT4_PER_CHANNEL = {"weight": {"dtype": "int4", "qscheme": "per_channel", "symmetric": True}}


def quantize(model: onnx.ModelProto, algo: list | None = None, **extra) -> onnxq.QuantizationResult:
    config = {"global_quant_config": INT4_PER_CHANNEL, "algo_config": algo or [], **extra}
    return onnxq.quantize(model, None, onnxq.config.compose.compose_config("U8S8", None, config),
                          {"x": CALIB}, progress=False)


def held_out_sqnr(model: onnx.ModelProto, result: onnxq.QuantizationResult) -> float:
    """Output SQNR on data no algorithm saw, in a default (deployed) session."""
    return sqnr_db(run(model, {"x": HELD_OUT}), run(result.model, {"x": HELD_OUT}))


# --- statistics and replay ---------------------------------------------------------------


@pytest.mark.parametrize("attrs, wshape, xshape", [
    (dict(strides=[2, 2], pads=[1, 1, 1, 1]), (8, 4, 3, 3), (3, 4, 9, 9)),
    (dict(group=4, pads=[1, 0, 1, 2], dilations=[2, 1]), (8, 1, 3, 3), (2, 4, 9, 9)),
    (dict(group=2, auto_pad="SAME_UPPER", strides=[2, 2]), (6, 2, 3, 3), (2, 4, 8, 7)),
    (dict(pads=[1, 1]), (5, 3, 3), (2, 3, 11)),
])
def test_statistics_give_the_exact_output_energy(attrs: dict, wshape: tuple, xshape: tuple) -> None:
    """tr(W H W^T) over im2col statistics equals sum(y^2) of onnxruntime's convolution."""
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal(wshape).astype(np.float32), rng.standard_normal(wshape[0]).astype(np.float32)
    x = rng.standard_normal(xshape).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    node = next(iter(ir.from_proto(model).graph))
    wm = to_matrices(node, w.astype(np.float64))
    full = np.concatenate([wm, b.reshape(wm.shape[0], wm.shape[1])[..., None]], axis=2)
    gram = Gram.empty(wm.shape[0], wm.shape[2], wshape[2:])
    gram.update(node, full, x, x)
    expected = float(np.sum(y.astype(np.float64) ** 2))
    assert gram.positions * wshape[0] == y.size
    assert np.sum(full * (full @ gram.h)) == pytest.approx(expected, rel=1e-5)
    assert gram.energy == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(gram.h, gram.c, rtol=1e-5, atol=1e-4)  # same inputs on both sides


def test_in_place_adam_and_regulariser_match_their_formulas() -> None:
    """The scratch-array Adam step and regulariser gradient give the bits the textbook
    expressions give (AdaRound's outputs must not change with them)."""
    from onnxq.optimize.layerwise.adam import Adam
    from onnxq.optimize.layerwise.soft_rounding import regulariser_gradient

    rng = np.random.default_rng(5)
    soft = rng.random((3, 20, 9)).astype(np.float32)
    for beta in (20.0, 7.3, 2.0):
        d = 2 * soft - 1
        expected = np.float32(0.01 * 2 * beta) * np.abs(d) ** np.float32(beta - 1) * np.sign(d)
        got = regulariser_gradient(soft, beta, 0.01, np.empty_like(soft), np.empty_like(soft))
        assert got.dtype == np.float32 and np.array_equal(got, expected)
        assert np.array_equal(regulariser_gradient(soft, beta, 0.01), expected)
    param, reference = (rng.standard_normal((4, 30)).astype(np.float32) for _ in range(2))
    reference[...] = param
    m, v, adam = np.zeros_like(param), np.zeros_like(param), Adam(0.03)
    for t in range(1, 40):
        grad = rng.standard_normal(param.shape).astype(np.float32)
        adam.step(0, param, grad)
        m = 0.9 * m + (1 - 0.9) * grad
        v = 0.999 * v + (1 - 0.999) * grad * grad
        reference -= 0.03 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        assert np.array_equal(param, reference), t


def test_replay_yields_the_tensors_the_models_compute() -> None:
    """Segment by segment (with a residual branch), the replay gives each tensor exactly as
    the whole model computes it, from memory and from disk alike."""
    model = cnn()
    nodes = list(model.graph.node)
    nodes[-1].input[0] = "f2"
    nodes.insert(-1, helper.make_node("Add", ["f", "f"], ["f2"], name="residual"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    batches = [{"x": CALIB[i:i + 8]} for i in range(0, 32, 8)]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in ("r1", "c3", "f2"))
    expected = run(exposed, {"x": CALIB[:32]}, output=None)
    for budget in (1 << 30, 0):
        replay = Replay(model, model, iter(batches), ["CPUExecutionProvider"], budget)
        for name, want in zip(("r1", "c3", "f2"), expected[1:]):
            got = np.concatenate([b[name] for b in replay.inputs([name])])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            got = np.concatenate([b[replay.float_name(name)] for b in replay.inputs([replay.float_name(name)])])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (replay.store.folder is not None) == (budget == 0)
        replay.close()


# --- the algorithms ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def nearest() -> tuple[onnx.ModelProto, onnxq.QuantizationResult]:
    model = cnn()
    return model, quantize(model)


@pytest.mark.parametrize("algo", ["adaround", "adaquant"])
def test_algorithm_beats_nearest_rounding_on_held_out_data(nearest, algo: str) -> None:
    model, plain = nearest
    result = quantize(model, [{"name": algo}])
    onnx.checker.check_model(result.model, full_check=True)
    note = next(n for n in result.summary.note_texts if n.startswith(algo))
    assert "4 of 4 layers improved on nearest rounding (1 of them by their scale and bias alone)" in note
    warning = next(n for n in result.summary.note_texts if n.startswith(f"warning: {algo}"))
    assert "1 layer (fc) has too few calibration rows" in warning and "its scale and bias fitted" in warning
    gain = held_out_sqnr(model, result) - held_out_sqnr(model, plain)
    assert gain > 1.0, (gain, note)


def test_adaround_changes_only_rounding_and_is_deterministic(nearest, tmp_path) -> None:
    """Every learned code is floor or ceil of w / s with the emitted scale; two runs write
    the same bytes."""
    model, plain = nearest
    result = quantize(model, [{"name": "adaround"}])
    again = quantize(model, [{"name": "adaround"}])
    assert result.model.SerializeToString() == again.model.SerializeToString()
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    near = {t.name: numpy_helper.to_array(t) for t in plain.model.graph.initializer}
    flipped = 0
    for name in ("w1", "w2", "w3"):
        q, scale = inits[f"{name}_quantized"], inits[f"{name}_scale"].reshape(-1, *[1] * (w[name].ndim - 1))
        u = w[name] / scale
        assert np.all((q == np.floor(u)) | (q == np.ceil(u)) | (q == -8) | (q == 7))
        flipped += int(np.sum(q != near[f"{name}_quantized"]))
    assert flipped > 0


def test_cache_on_disk_gives_the_same_model(nearest) -> None:
    model, _ = nearest
    memory = quantize(model, [{"name": "adaround", "num_iteration": 50}])
    disk = quantize(model, [{"name": "adaround", "num_iteration": 50, "cache_budget_mb": 0}])
    assert memory.model.SerializeToString() == disk.model.SerializeToString()


def test_typed_config_equals_the_dict_entry(nearest) -> None:
    model, _ = nearest
    typed = onnxq.Config(**{**vars(onnxq.config.compose.compose_config("U8S8", None, {
        "global_quant_config": INT4_PER_CHANNEL})), "algo_config": [onnxq.AdaRoundConfig(num_iteration=40)]})
    a = onnxq.quantize(model, None, typed, {"x": CALIB}, progress=False)
    b = quantize(model, [{"name": "adaround", "num_iteration": 40}])
    assert a.model.SerializeToString() == b.model.SerializeToString()
    text = onnxq.config.config_to_yaml(typed)
    assert "name: adaround" in text and "num_iteration: 40" in text


def test_pair_safe_weights_stay_pair_safe() -> None:
    """On a target whose int8 kernels add weight pairs in int16, learned codes keep every
    pair within the limit."""
    model = cnn()
    config = onnxq.config.compose.compose_config("U8S8", None, {"target": "x86-avx2",
                                                                "algo_config": [{"name": "adaround"}]})
    result = onnxq.quantize(model, None, config, {"x": CALIB}, progress=False)
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    for name in ("w1", "w3"):
        q = inits[f"{name}_quantized"].astype(np.int64)
        for pairs in pair_indices(q.shape, 0, (*range(2, q.ndim), 1)):
            flat = np.append(q.reshape(-1), 0)
            assert np.abs(flat[pairs].sum(axis=2)).max() <= PAIR_LIMIT


def test_per_tensor_weights_bring_equalization_first() -> None:
    model = cnn()
    per_tensor = {"weight": {"qscheme": "per_tensor"}}
    result = quantize(model, [{"name": "adaround", "num_iteration": 20}], global_quant_config=per_tensor)
    (added,) = of(result.summary.notes, Topic.RECIPE, "adaround")
    assert added.text.startswith("adaround adds cle before calibration")
    assert of(result.summary.notes, Topic.PASS, "cle")
    assert any(n.startswith("cle:") for n in result.summary.note_texts)
    result = quantize(model, [{"name": "adaround", "num_iteration": 20, "equalize": "never"}],
                      global_quant_config=per_tensor)
    assert not any("cle" in n for n in result.summary.note_texts)


def test_weight_only_static_layers_are_optimised() -> None:
    """No activation quantization: the layers' inputs carry only earlier weights' errors."""
    model = cnn()
    config = {"global_quant_config": {"input_tensors": None, "output_tensors": None, **INT4_PER_CHANNEL}}
    plain = onnxq.quantize(model, None, onnxq.config.compose.compose_config("U8S8", None, config), {"x": CALIB},
                           progress=False)
    learned = quantize(model, [{"name": "adaround"}], **{k: v for k, v in config.items() if k != "global_quant_config"},
                       global_quant_config=config["global_quant_config"])
    assert held_out_sqnr(model, learned) > held_out_sqnr(model, plain) + 1.0


# --- what goes wrong -----------------------------------------------------------------------


def test_model_level_check_undoes_everything(nearest, monkeypatch) -> None:
    """When the whole model comes out worse than with nearest rounding, nothing changes."""
    model, plain = nearest
    monkeypatch.setattr(driver, "keep_learned", lambda *a, **k: (False, 1.0, 2.0))
    result = quantize(model, [{"name": "adaquant"}])
    assert "undone" in next(n for n in result.summary.note_texts if n.startswith("adaquant"))
    assert result.model.SerializeToString() == plain.model.SerializeToString()
    # figures equal to a tenth of a dB show their difference (the style-transfer trial read
    # "fell to 15.7 dB from nearest rounding's 15.7 dB")
    monkeypatch.setattr(driver, "keep_learned", lambda *a, **k: (False, 15.7012, 15.7344))
    note = next(n for n in quantize(model, [{"name": "adaquant"}]).summary.note_texts if n.startswith("adaquant"))
    assert "fell to 15.701 dB from nearest rounding's 15.734 dB" in note


def test_check_batches_are_fitted_unless_held_out(nearest) -> None:
    """The model-level check reads every 4th batch of 8; those samples feed the statistics
    too, unless hold_out keeps them out (then new values there leave the rounding as it is)."""
    model, _ = nearest
    other = CALIB.copy()
    other[24:32] = images(8, 3)  # the 4th batch

    def fit(data: np.ndarray, hold_out: bool) -> tuple[bytes, str]:
        config = onnxq.config.compose.compose_config("U8S8", None, {
            "global_quant_config": INT4_PER_CHANNEL, "calibration": {"batch_size": 8},
            "algo_config": [{"name": "adaround", "num_iteration": 50, "hold_out": hold_out}]})
        result = onnxq.quantize(model, None, config, {"x": data}, progress=False)
        note = next(n for n in result.summary.note_texts if n.startswith("adaround"))
        weights = [i.SerializeToString() for i in result.model.graph.initializer if "weight" in i.name.lower()
                   or i.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)]
        return b"".join(weights), note

    held, note = fit(CALIB, True)
    assert "on 2 held-out calibration batches" in note, note
    assert fit(other, True)[0] == held
    fitted, note = fit(CALIB, False)
    assert "on 2 calibration batches" in note, note
    assert fit(other, False)[0] != fitted and fitted != held


def test_non_finite_loss_keeps_nearest(nearest, monkeypatch) -> None:
    model, plain = nearest
    monkeypatch.setattr("onnxq.optimize.adaround.learn_rounding",
                        lambda problem, options: driver.Solution(np.full(problem.w.shape, np.nan)))
    monkeypatch.setitem(onnxq.optimize.ALGORITHMS, "adaround",
                        lambda m, p, r, o, c: driver.reconstruct("adaround", onnxq.optimize.adaround.learn_rounding,
                                                                 m, p, r, o, c))
    result = quantize(model, [{"name": "adaround", "skip_layers": ["fc"]}])  # fc: too few rows, only fitted
    note = next(n for n in result.summary.note_texts if n.startswith("adaround"))
    assert "0 of 3 layers improved" in note and "not finite" in note
    assert result.model.SerializeToString() == plain.model.SerializeToString()


def test_layers_it_cannot_optimise_are_named(nearest) -> None:
    model, _ = nearest
    result = quantize(model, [{"name": "adaround", "op_types": ["Gemm"], "num_iteration": 10}])
    note = next(n for n in result.summary.note_texts if n.startswith("adaround"))
    warning = next(n for n in result.summary.note_texts if n.startswith("warning: adaround"))
    assert "of 1 layer improved" in note and "its scale and bias fitted" in warning, (note, warning)
    # the samples the user gave (64), held-out check batches included, and as many more
    assert "calibrate on at least" in warning and "samples (now 64)" in warning, warning


def test_data_read_once_is_reported(nearest) -> None:
    model, _ = nearest
    feeds = iter([{"x": CALIB[i:i + 8]} for i in range(0, 64, 8)])
    config = onnxq.config.compose.compose_config("U8S8", None, {"algo_config": [{"name": "adaround"}]})
    result = onnxq.quantize(model, None, config, feeds, progress=False)
    assert any("read only once" in n for n in result.summary.note_texts)


@pytest.mark.parametrize("entry, message", [
    ({"name": "adaround", "num_iteratoin": 5}, "did you mean 'num_iteration'"),
    ({"name": "adaround", "beta_range_start": 1.0}, "beta_range_start >= beta_range_end"),
    ({"name": "adaquant", "inputs": "noisy"}, "inputs is one of"),
    ({"name": "adaroud"}, "did you mean 'adaround'"),
])
def test_bad_options_fail_before_loading(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        onnxq.quantize("does-not-exist.onnx", None, {"algo_config": [entry]}, None)


def test_cli_flags_and_options(tmp_path, capsys) -> None:
    model_path, data = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(cnn(), model_path)
    np.savez(data, x=CALIB)
    out = tmp_path / "q.onnx"
    code = main(["quantize", str(model_path), str(out), "--calib-data", str(data), "--adaround",
                 "--algo-option", "num_iteration=30", "--quiet"])
    assert code == 0 and out.exists()
    assert main(["quantize", str(model_path), str(out), "--calib-data", str(data), "--adaround", "--adaquant",
                 "--algo-option", "adaround.num_iteration=30"]) == 2
    assert "both learn the layers' rounding, and one would undo the other; give one" in capsys.readouterr().err
    assert main(["quantize", str(model_path), str(out), "--calib-data", str(data), "--adaround",
                 "--algo-option", "warm_start=2"]) == 2
    assert "warm_start" in capsys.readouterr().err


def test_matmul_layers_of_a_transformer_block_improve() -> None:
    """MatMul weights (with their bias Adds left alone) on token sequences."""
    rng = np.random.default_rng(3)
    inits = {"w1": uneven_weights(rng, (48, 32)).T.copy(), "b1": rng.normal(0, 0.1, 48).astype(np.float32),
             "w2": uneven_weights(rng, (16, 48)).T.copy()}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="up_bias"),
             helper.make_node("Relu", ["hb"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="down")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 12, 16])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    mix = rng.standard_normal((32, 32)) * np.exp(-np.arange(32) / 6)[:, None]  # correlated features
    calib, held = ((rng.standard_normal((n, 12, 32)) @ mix).astype(np.float32) for n in (64, 32))

    def sqnr(algo: list) -> float:
        config = onnxq.config.compose.compose_config("U8S8", None, {"global_quant_config": INT4_PER_CHANNEL,
                                                                    "algo_config": algo})
        result = onnxq.quantize(model, None, config, {"x": calib}, progress=False)
        return sqnr_db(run(model, {"x": held}), run(result.model, {"x": held}))

    assert sqnr([{"name": "adaround"}]) > sqnr([]) + 2.0


def test_narrow_weights_keep_their_bit_width(nearest) -> None:
    """6-bit weights in an int8 container (AMCT ARQ): learned codes stay within 6 bits."""
    model, _ = nearest
    config = onnxq.config.compose.compose_config("U8S8", None, {
        "global_quant_config": {"weight": {"bits": 6}}, "algo_config": [{"name": "adaround"}]})
    result = onnxq.quantize(model, None, config, {"x": CALIB}, progress=False)
    assert "4 of 4 layers improved" in next(n for n in result.summary.note_texts if n.startswith("adaround"))
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    for name in ("w1", "w2", "w3"):
        q = inits[f"{name}_quantized"].astype(np.int64)
        assert q.min() >= -32 and q.max() <= 31


@pytest.mark.parametrize("algo", ["adaround", "adaquant"])
def test_bias_correction_after_it_corrects_only_unfitted_biases(nearest, algo: str) -> None:
    """Biases the algorithm fitted are left alone by a bias correction after it (a second
    correction, from float inputs, would undo theirs); with `bias: false` it measures the
    learned weights' error against the float weights (which the algorithm leaves alone)."""
    model, _ = nearest
    alone = quantize(model, [{"name": algo}])
    both = quantize(model, [{"name": algo}, {"name": "bias_correction"}])
    assert both.model.SerializeToString() == alone.model.SerializeToString()
    assert "fitted by " + algo in next(n for n in both.summary.note_texts if n.startswith("bias_correction"))
    corrected = quantize(model, [{"name": "bias_correction"}])
    unfitted = quantize(model, [{"name": algo, "bias": False}, {"name": "bias_correction"}])
    # the learned weights still help: 21.95 (AdaRound) and 19.47 dB (AdaQuant) against 18.58 on
    # an EPYC with AVX512-BF16; the float kernels' rounding differs between CPUs, and with it
    # the fit (AdaQuant's margin was over 1 dB on an earlier EPYC)
    assert held_out_sqnr(model, unfitted) > held_out_sqnr(model, corrected) + 0.5


@pytest.mark.parametrize("algo", ["adaround", "adaquant"])
def test_learned_rounding_survives_a_bias_floor(algo: str) -> None:
    """A dead channel whose bias forces a raised weight scale (int32 bias range) is rounded
    again at emission; the layer's other channels keep their learned codes, also when the
    raised scale, stored as float32, lands a rounding step below the float64 floor.
    (Requantizing the whole weight there undid AdaRound on most MobileNet layers: int4
    top-1 18% -> 72%.)"""
    model = cnn()
    w3 = next(t for t in model.graph.initializer if t.name == "w3")
    b3 = next(t for t in model.graph.initializer if t.name == "b3")
    w, b = numpy_helper.to_array(w3).copy(), numpy_helper.to_array(b3).copy()
    w[0] = 1e-9
    w3.CopyFrom(numpy_helper.from_array(w, "w3"))
    s_in = float(numpy_helper.to_array(next(t for t in quantize(model).model.graph.initializer
                                            if t.name == "r2_scale")))
    limit = np.iinfo(np.int32).max / 2
    # a bias whose floor |b| / (s_in * limit) rounds down when stored as float32
    b[0] = next(v for v in np.float32(0.5) + np.arange(1, 200, dtype=np.float32) * np.float32(1e-3)
                if float(np.float32(v / (s_in * limit))) < float(v) / (s_in * limit))
    b3.CopyFrom(numpy_helper.from_array(b, "b3"))
    plain, learned = quantize(model), quantize(model, [{"name": algo}])
    q = {t.name: numpy_helper.to_array(t) for t in learned.model.graph.initializer}
    near = {t.name: numpy_helper.to_array(t) for t in plain.model.graph.initializer}
    assert q["w3_scale"][0] == near["w3_scale"][0] > 1e-9  # raised from 1e-9 / 8 by the floor
    assert np.any(q["w3_quantized"][1:] != near["w3_quantized"][1:])  # learned codes emitted
    assert held_out_sqnr(model, learned) > held_out_sqnr(model, plain) + 1.0


@pytest.mark.parametrize("scale_type", ["float32", "power_of_two"])
def test_scale_search_lowers_every_channels_output_error(scale_type: str) -> None:
    """Clipping outlier weights buys finer steps: the searched scale of each channel has an
    output error no larger than min/max's (smaller where a channel has an outlier), stays
    above the bias floor, and keeps the scale type."""
    from onnxq.numerics.weights import stored_scale
    from onnxq.optimize.layerwise.clip import channel_losses, search_scale

    rng = np.random.default_rng(3)
    m, k, rows = 16, 64, 4096
    w = rng.standard_normal((1, m, k))
    w[0, :8, 0] = 6.0  # one outlier in half the channels
    x = np.concatenate([rng.standard_normal((rows, k)), np.ones((rows, 1))], axis=1)
    h = (x.T @ x / rows)[None]
    full = np.concatenate([w, np.zeros((1, m, 1))], axis=2)
    scale = stored_scale(np.abs(w).max(axis=2, keepdims=True) / 7, scale_type, 0.0).astype(np.float64)
    floor = np.full((1, m, 1), 1e-6)
    floor[0, 0, 0] = scale[0, 0, 0]  # this channel's bias allows no smaller scale
    lo, hi = np.full((1, m, 1), -8.0), np.full((1, m, 1), 7.0)
    nearest = np.clip(np.rint(w / scale), lo, hi)
    problem = driver.Problem(w, np.zeros((1, m)), scale, IntegerGrid(lo, hi), nearest, h, full @ h, 1.0, True, True)
    searched = search_scale(problem, floor, scale_type)
    before = channel_losses(problem, problem.nearest * problem.scale)
    after = channel_losses(searched, searched.nearest * searched.scale)
    assert np.all(after <= before) and np.all(after[0, 1:8] < 0.8 * before[0, 1:8])
    assert searched.scale[0, 0, 0] == scale[0, 0, 0] and np.all(searched.scale >= floor)
    if scale_type == "power_of_two":
        assert np.all(np.log2(searched.scale) == np.round(np.log2(searched.scale)))


def test_a_trial_emission_starts_without_the_base_runs_fitted_biases(monkeypatch) -> None:
    """`PipelineState.emit` (a mixed-precision trial) reruns the algorithms on a fresh
    context: biases AdaRound fitted in the base run do not stop the trial's bias correction
    when the trial's AdaRound fits none."""
    from onnxq.quantize import run_pipeline

    config = onnxq.config.compose.compose_config("U8S8", None, {"global_quant_config": INT4_PER_CHANNEL,
                                                                "algo_config": [{"name": "adaround"}]})
    base = run_pipeline(cnn(), None, config, {"x": CALIB}, progress=False, keep_state=True)
    assert "bias_correction: nothing to correct: the biases of all 4 layers were fitted by adaround" in \
        base.summary.note_texts
    monkeypatch.setattr(driver, "_one_layer", lambda *args, **kwargs: None)  # the trial fits nothing
    trial = ir.to_proto(base.state.emit(config))
    fresh = run_pipeline(cnn(), None, config, {"x": CALIB}, progress=False)
    assert "4 of 4 biases corrected" in " ".join(fresh.summary.note_texts)
    assert trial.SerializeToString() == fresh.model.SerializeToString()


def test_one_output_channel_keeps_its_scale_shape() -> None:
    """A per-channel weight with one output channel: the searched scale keeps shape [1],
    like its zero point (the ONNX spec wants them alike)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((1, 3, 3, 3)) / 5).astype(np.float32)
    w[0, 0, 0, 0] = 2.0  # an outlier the scale search clips
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["y"], name="conv1", pads=[1, 1, 1, 1])], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 16, 16])],
        [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(np.array([0.1], np.float32), "b1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    plain, learned = quantize(model), quantize(model, [{"name": "adaround"}])
    inits = {t.name: numpy_helper.to_array(t) for t in learned.model.graph.initializer}
    assert inits["w1_scale"].shape == inits["w1_zero_point"].shape == (1,)
    assert inits["w1_scale"][0] < numpy_helper.to_array(
        next(t for t in plain.model.graph.initializer if t.name == "w1_scale"))[0]  # clipped
    assert held_out_sqnr(model, learned) > held_out_sqnr(model, plain)


# --- the loss through the activation after a layer (`activation: true`) --------------------


ACTIVATION_NODES = [
    ("Relu", {}, None), ("Clip", {}, (np.float32(0), np.float32(6))), ("LeakyRelu", {"alpha": 0.2}, None),
    ("PRelu", {}, np.linspace(0.05, 0.4, 6, dtype=np.float32).reshape(6, 1, 1)), ("Sigmoid", {}, None),
    ("Tanh", {}, None), ("Gelu", {}, None), ("Gelu", {"approximate": "tanh"}, None),
]


def _conv_then(op: str, attrs: dict, extra) -> onnx.ModelProto:
    """x -> Conv (6 channels) -> `op` -> y, opset 20."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(uneven_weights(rng, (6, 3, 3, 3)), "w"),
             numpy_helper.from_array(rng.normal(0, 0.3, 6).astype(np.float32), "b")]
    inputs = ["c"]
    if isinstance(extra, tuple):
        inits += [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(("lo", "hi"), extra)]
        inputs += ["lo", "hi"]
    elif extra is not None:
        inits.append(numpy_helper.from_array(extra, "slope"))
        inputs.append("slope")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node(op, inputs, ["y"], name="act", **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


@pytest.mark.parametrize("op, attrs, extra", ACTIVATION_NODES)
def test_each_activation_matches_onnxruntime_and_its_derivative(op: str, attrs: dict, extra) -> None:
    """f is the op as onnxruntime computes it (to 1e-5) and f' its finite difference."""
    from onnxq.optimize.layerwise.activation import following

    model = _conv_then(op, attrs, extra)
    graph = ir.from_proto(model).graph
    conv = next(n for n in graph if n.op_type == "Conv")
    act = following(graph, conv, (1, 6), 2)
    assert act is not None and act.op_type == op
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = CALIB[:2]
    pre = run(onnx.helper.make_model(
        helper.make_graph([model.graph.node[0]], "c", list(model.graph.input),
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                          list(model.graph.initializer)[:2]),
        opset_imports=[helper.make_opsetid("", 20)], ir_version=9), {"x": x})
    y = pre.transpose(1, 0, 2, 3).reshape(1, 6, -1)  # [g, M, P]
    expected = sess.run(None, {"x": x})[0].transpose(1, 0, 2, 3).reshape(1, 6, -1)
    np.testing.assert_allclose(act.forward(y), expected, atol=1e-5, rtol=1e-5)
    away = np.abs(y) > 1e-2  # off the kinks
    eps = np.float32(1e-3)
    numeric = (act.forward(y + eps).astype(np.float64) - act.forward(y - eps)) / (2 * eps)
    np.testing.assert_allclose(act.derivative(y)[away], numeric[away], atol=2e-3)


def test_no_activation_when_the_output_also_goes_elsewhere_or_a_slope_is_per_position() -> None:
    from onnxq.optimize.layerwise.activation import following

    model = _conv_then("Relu", {}, None)
    model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, None))
    graph = ir.from_proto(model).graph
    assert following(graph, next(n for n in graph if n.op_type == "Conv"), (1, 6), 2) is None
    # a PRelu slope that varies along the last axis, as many values as there are channels
    for slope in (np.full((1, 6), 0.2, np.float32), np.full(6, 0.2, np.float32)):
        graph = ir.from_proto(_conv_then("PRelu", {}, slope)).graph
        assert following(graph, next(n for n in graph if n.op_type == "Conv"), (1, 6), 2) is None
    graph = ir.from_proto(_conv_then("PRelu", {}, np.full((1, 6, 1, 1), 0.2, np.float32))).graph
    assert following(graph, next(n for n in graph if n.op_type == "Conv"), (1, 6), 2) is not None


def _through_problem(seed: int = 0):
    """A matrix layer followed by ReLU, its statistics and its sample from the same positions."""
    from onnxq.optimize.layerwise.activation import ACTIVATIONS
    from onnxq.optimize.layerwise.sampled import ThroughActivation

    rng = np.random.default_rng(seed)
    g, m, k, p = 1, 5, 6, 4096
    xf = rng.standard_normal((g, k, p))
    xq = xf + 0.05 * rng.standard_normal((g, k, p))
    ones = np.ones((g, 1, p))
    xq1, xf1 = np.concatenate([xq, ones], 1), np.concatenate([xf, ones], 1)
    w, b = rng.standard_normal((g, m, k)), rng.normal(0, 0.5, (g, m))
    full = np.concatenate([w, b[..., None]], axis=2)
    h, c = xq1 @ xq1.transpose(0, 2, 1) / p, xq1 @ xf1.transpose(0, 2, 1) / p
    yf = full @ xf1
    relu = ACTIVATIONS["Relu"](None, (g, m), 0)
    through = ThroughActivation.build(relu, xq1, yf, batch=p)
    problem = driver.Problem(w, b, np.full((g, m, 1), 0.1), IntegerGrid(np.full((g, m, 1), -8.0), np.full((g, m, 1), 7.0)),
                             np.rint(w / 0.1), h, full @ c.transpose(0, 2, 1), float(np.mean(yf ** 2)), True, True,
                             through)

    def exact(v: np.ndarray, bias: np.ndarray) -> float:  # the error after ReLU, relative
        yq = np.concatenate([v, bias[..., None]], axis=2) @ xq1
        return float(np.mean((np.maximum(yq, 0) - np.maximum(yf, 0)) ** 2)) / float(np.mean(np.maximum(yf, 0) ** 2))
    return problem, exact, rng


def test_loss_through_the_activation_and_its_gradient_are_exact() -> None:
    """Statistics plus the sampled correction give the error after the ReLU exactly when
    the sample holds every position: the gradient is its derivative; the loss that judges
    a layer is the error on the sample alone."""
    problem, exact, rng = _through_problem()
    v = problem.w + 0.1 * rng.standard_normal(problem.w.shape)
    assert problem.loss(v, problem.bias) == pytest.approx(exact(v, problem.bias), rel=1e-5)
    full = np.concatenate([v, problem.bias[..., None]], axis=2).astype(np.float32)
    grad, loss = problem.gradient(full, 0, False, with_loss=True)
    grad = grad * 2 / (problem.outputs * problem.reference)
    assert loss == pytest.approx(exact(v, problem.bias), rel=1e-4)
    eps = 1e-4
    for index in [(0, 0, 0), (0, 2, 3), (0, 4, 5)]:
        step = np.zeros_like(v)
        step[index] = eps
        numeric = (exact(v + step, problem.bias) - exact(v - step, problem.bias)) / (2 * eps)
        assert grad[index] == pytest.approx(numeric, rel=1e-3, abs=1e-7)


def test_bias_through_the_activation_beats_the_linear_one() -> None:
    problem, exact, rng = _through_problem(1)
    v = problem.w + 0.2 * rng.standard_normal(problem.w.shape)
    linear, best = problem.linear_bias(v), problem.best_bias(v)
    assert exact(v, best) < exact(v, linear) - 1e-3
    for channel in range(best.shape[1]):  # no bias on a fine grid around it does better
        trials = best[0, channel] + np.linspace(-0.3, 0.3, 61)
        losses = [exact(v, np.where(np.arange(best.shape[1]) == channel, t, best)) for t in trials]
        assert exact(v, best) <= min(losses) + 1e-6


def test_adaround_through_the_activation_beats_nearest(nearest) -> None:
    """`activation: true`: each layer's error after its ReLU is what AdaRound minimises;
    the held-out output still beats nearest rounding's by more than 1 dB."""
    model, plain = nearest
    result = quantize(model, [{"name": "adaround", "activation": True}])
    note = next(n for n in result.summary.note_texts if n.startswith("adaround"))
    assert "error measured after the activation on 3 layers (Relu)" in note
    assert held_out_sqnr(model, result) > held_out_sqnr(model, plain) + 1.0
    again = quantize(model, [{"name": "adaround", "activation": True}])
    assert again.model.SerializeToString() == result.model.SerializeToString()
