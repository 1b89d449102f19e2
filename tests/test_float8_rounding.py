"""Learned rounding on float8 weights (AdaRound/AdaQuant on the float8 grid), the FP8
recipe around it (first/last layer inputs in float, bias correction last), and the
trial emission those algorithms measure: float8 activations centred as emitted, a
fitted bias set where the float8 layout adds it."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import run, sqnr_db
from onnx import TensorProto, helper, numpy_helper
from test_layerwise import CALIB, HELD_OUT, cnn, held_out_sqnr

import onnxq
from onnxq.config.compose import compose_config
from onnxq.notes import Topic, of
from onnxq.numerics.qmath import FLOAT8_TYPES
from onnxq.optimize.layerwise import emitted
from onnxq.optimize.layerwise.grid import FloatGrid, IntegerGrid
from onnxq.optimize.layerwise.replay import Replay
from onnxq.pipeline import emission

FP8 = {"global_quant_config": {"input_tensors": {"dtype": "float8_e4m3fn"},
                               "output_tensors": {"dtype": "float8_e4m3fn"},
                               "weight": {"dtype": "float8_e4m3fn", "qscheme": "per_channel"}},
       "target_algorithms": False}


def fp8(algos: list, **extra) -> onnxq.QuantizationResult:
    config = compose_config("FP8_E4M3", None, {**FP8, "edge_input": None, **extra})
    config.algo_config = algos
    return onnxq.quantize(cnn(), None, config, {"x": CALIB}, progress=False)


# --- the grid ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(FLOAT8_TYPES))
def test_float_grid_brackets_each_value_between_neighbours(dtype) -> None:
    f8 = FLOAT8_TYPES[dtype]
    grid = FloatGrid(f8)
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.standard_normal(2000) * 10 ** rng.uniform(-3, 2.5, 2000), [0.0, -0.0, f8.max_value]])
    down, free = grid.brackets(u)
    up = grid.up(down)
    inside = np.abs(u) < f8.max_value
    assert np.array_equal(free, inside)
    assert np.all(down[free] <= u[free]) and np.all(u[free] < up[free])
    # neighbours: no value of the type lies strictly between them
    between = np.searchsorted(grid.values, up[free]) - np.searchsorted(grid.values, down[free], side="right")
    assert np.all(between == 0)
    expected = np.clip(u, -f8.max_value, f8.max_value).astype(np.float32).astype(f8.np_dtype).astype(np.float64)
    assert np.array_equal(grid.round(u), expected)


def test_integer_grid_is_floor_and_the_next_integer() -> None:
    grid = IntegerGrid(np.array(-8.0), np.array(7.0))
    down, free = grid.brackets(np.array([-9.0, -7.5, 0.2, 6.9, 7.0]))
    assert down.tolist() == [-9, -8, 0, 6, 7] and free.tolist() == [False, True, True, True, False]
    assert grid.round(np.array([-9.0, 2.5, 3.5, 8.0], np.float32)).tolist() == [-8, 2, 4, 7]


# --- the algorithms on float8 weights ------------------------------------------------------


def _float8_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_type == TensorProto.FLOAT8E4M3FN and t.dims and len(t.dims) > 1}


@pytest.mark.parametrize("algo", ["adaround", "adaquant"])
def test_learned_float8_rounding_beats_nearest_on_held_out_data(algo: str) -> None:
    model = cnn()
    nearest, learned = fp8([]), fp8([{"name": algo}])
    onnx.checker.check_model(learned.model, full_check=True)
    note = next(n for n in learned.summary.note_texts if n.startswith(algo))
    assert "4 of 4 layers improved on nearest rounding" in note, note
    gain = held_out_sqnr(model, learned) - held_out_sqnr(model, nearest)
    assert gain > 1.0, (gain, note)
    # still float8 weights, and some codes differ from nearest rounding
    before, after = _float8_weights(nearest.model), _float8_weights(learned.model)
    assert before.keys() == after.keys() and len(after) == 4
    assert any(not np.array_equal(before[k].astype(np.float64), after[k].astype(np.float64)) for k in after)


@pytest.mark.parametrize("weight", [{"dtype": "float8_e5m2"}, {"qscheme": "per_tensor"}])
def test_adaround_on_e5m2_and_per_tensor_float8_weights(weight: dict) -> None:
    model = cnn()
    spec = {"global_quant_config": {"weight": weight}}
    nearest, learned = fp8([], **spec), fp8([{"name": "adaround", "equalize": "never"}], **spec)
    onnx.checker.check_model(learned.model, full_check=True)
    note = next(n for n in learned.summary.note_texts if n.startswith("adaround:"))
    assert "4 of 4 layers improved on nearest rounding" in note, note
    assert held_out_sqnr(model, learned) > held_out_sqnr(model, nearest) + 0.5


def test_adaround_moves_each_float8_weight_to_a_neighbour_at_most() -> None:
    """AdaRound chooses between the float8 values just below and above w / scale."""
    result = fp8([{"name": "adaround", "search_scale": False}])
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    grid = FloatGrid(FLOAT8_TYPES[onnxq.config.spec.DType.FLOAT8_E4M3FN])
    w = {t.name: numpy_helper.to_array(t) for t in cnn().graph.initializer}["w3"].astype(np.float64)
    codes = inits["w3_quantized"].astype(np.float64)
    scale = inits["w3_scale"].astype(np.float64).reshape(-1, 1, 1, 1)
    down, _ = grid.brackets(w / scale)
    assert np.all((codes == down) | (codes == grid.up(down)))
    assert inits["w3_quantized"].dtype == ml_dtypes.float8_e4m3fn


def test_trial_emission_centres_float8_after_another_algorithm(monkeypatch) -> None:
    """An algorithm after another still measures the model as emitted: float8
    activations centred by the calibration pass's channel means (which the first
    algorithm's changes do not clear)."""
    seen = []
    real = emission.emit_trial

    def spy(model, plan, ranges, **kwargs):
        seen.append(len(kwargs["statistics"]))
        return real(model, plan, ranges, **kwargs)

    monkeypatch.setattr(emission, "emit_trial", spy)
    fp8([{"name": "adaquant", "enabled": False}, {"name": "adaround"}])  # one learner runs (EXCLUSIVE)
    assert len(seen) >= 2 and all(n > 0 for n in seen), seen


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_a_fitted_bias_lands_where_the_emitted_graph_adds_it(op: str) -> None:
    """The replay gives a layer its fitted bias in the float8 layout's bias Add (Conv),
    or as its own bias input divided by Gemm's beta: added once, whatever the layout."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 3, 3) if op == "Conv" else (2, 4)).astype(np.float32)
    w = rng.standard_normal((3, 4, 1, 1) if op == "Conv" else (3, 4)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    shape = ["N", 4, 3, 3] if op == "Conv" else ["N", 4]
    out = ["N", 3, 3, 3] if op == "Conv" else ["N", 3]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    attrs = {"beta": 0.5, "transB": 1} if op == "Gemm" else {}
    if op == "Conv":  # as emit/float8.bias_to_add lays it out
        nodes = [helper.make_node("Conv", ["x", "w"], ["y0"], name="layer"),
                 helper.make_node("Add", ["y0", "b_add"], ["y"], name="layer_bias_add")]
        qinits = [inits[0], numpy_helper.from_array(b.reshape(1, 3, 1, 1), "b_add")]
    else:
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="layer", **attrs)]
        qinits = inits

    def model(nodes, inits):
        graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])

    float_model = model([helper.make_node(op, ["x", "w", "b"], ["y"], name="layer", **attrs)], inits)
    quant = model(nodes, qinits)
    replay = Replay(float_model, quant, [{"x": x}], ["CPUExecutionProvider"], 1 << 20)
    qnode = next(n for n in ir.from_proto(quant).graph if n.name == "layer")
    beta = attrs.get("beta", 1.0)
    layer = types.SimpleNamespace(name="layer", beta=lambda: beta)
    added = np.array([1.0, -2.0, 3.0])
    slot = emitted.bias_slot(qnode, layer)
    assert slot == emitted.BiasSlot("layer_bias_add", 1, (1, 3, 1, 1)) if op == "Conv" else emitted.BiasSlot(
        "layer", 2, None)
    emitted.replay_bias(replay, layer, slot, added)
    got = next(replay.inputs(["y"]))["y"]
    product = np.einsum("nchw,oc->nohw", x, w[:, :, 0, 0]) if op == "Conv" else x @ w.T
    expected = product + added.reshape((1, 3, 1, 1) if op == "Conv" else (1, 3))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# --- the recipe --------------------------------------------------------------------------


def test_fp8_preset_on_data_read_once_skips_adaround_and_still_corrects() -> None:
    """A generator can be read once, by the calibration pass: the preset's AdaRound is
    skipped (a note says why and the fix) and its bias correction, first then, takes its
    statistics from that pass."""
    feeds = iter([{"x": CALIB[i:i + 8]} for i in range(0, 64, 8)])
    notes = onnxq.quantize(cnn(), None, "FP8_E4M3", feeds, progress=False).summary.notes
    (skipped,) = of(notes, Topic.SKIPPED, "adaround")
    assert "can be read only once; pass a path" in skipped.text
    (corrected,) = of(notes, Topic.ALGORITHM, "bias_correction")
    assert corrected.text.startswith("bias_correction: 4 of 4 biases corrected")
    assert not of(notes, Topic.ALGORITHM, "adaround")


def test_bias_correction_runs_after_the_other_algorithms() -> None:
    """Listed first, bias correction still runs last: its corrected biases would shift
    the float model AdaRound fits the quantized layers to."""
    first = fp8([{"name": "bias_correction"}, {"name": "adaround"}])
    last = fp8([{"name": "adaround"}, {"name": "bias_correction"}])
    assert first.model.SerializeToString() == last.model.SerializeToString()
    (moved,) = of(first.summary.notes, Topic.RECIPE, "bias_correction")
    assert moved.text.startswith("bias_correction runs after adaround")
    assert not of(last.summary.notes, Topic.RECIPE)


def test_cli_flags_put_bias_correction_last_without_a_note(tmp_path, capsys) -> None:
    """--bias-correction with --adaround lists bias correction last already: nothing moves."""
    from onnxq.cli import main

    model_path, data, out = tmp_path / "m.onnx", tmp_path / "calib.npz", tmp_path / "q.onnx"
    onnx.save(cnn(), model_path)
    np.savez(data, x=CALIB)
    assert main(["quantize", str(model_path), str(out), "--calib-data", str(data), "--bias-correction",
                 "--adaround", "--algo-option", "adaround.num_iteration=20"]) == 0
    printed = capsys.readouterr().out
    assert 0 < printed.index("note: adaround: ") < printed.index("note: bias_correction: "), printed
    assert "runs after" not in printed


def test_a_relu_after_a_layer_with_float_input_says_so() -> None:
    """The first layer reads its input in float (edge_input), so it writes a float output
    and its Relu runs in float: the summary says that, not that the Conv stays float."""
    result = onnxq.quantize(cnn(), None, "FP8_E4M3", {"x": CALIB}, progress=False)
    reason = result.summary.float_nodes["relu1"][1]
    assert reason.startswith("the Conv before it writes a float output (its input is not quantized)"), reason


def test_fp8_preset_reads_the_model_input_in_float_and_gains() -> None:
    """FP8_E4M3 keeps the first and last weighted layers' inputs float (`edge_input`):
    an input with 8-bit levels (pixels) would lose its low bits in a 3-bit mantissa."""
    model = cnn()
    pixels = {"x": np.round((CALIB + 2) * 60) / 60 - 2}
    held = {"x": np.round((HELD_OUT + 2) * 60) / 60 - 2}
    results = {}
    for edge in ("float32", None):
        config = compose_config("FP8_E4M3", None, {"edge_input": {"dtype": edge} if edge else None})
        results[edge] = onnxq.quantize(model, None, config, pixels, progress=False)
    preset = results["float32"].model
    onnx.checker.check_model(preset, full_check=True)
    conv1 = next(n for n in preset.graph.node if n.name == "conv1")
    fc = next(n for n in preset.graph.node if n.name == "fc")
    producers = {o: n.op_type for n in preset.graph.node for o in n.output}
    assert conv1.input[0] == "x" and producers.get(fc.input[0]) == "Flatten", (conv1.input, fc.input)
    assert any(n.startswith("edge_input: the first and last weighted layers (conv1, fc) take float32 inputs")
               for n in results["float32"].summary.note_texts)
    reference = run(model, held)
    gain = sqnr_db(reference, run(preset, held)) - sqnr_db(reference, run(results[None].model, held))
    assert gain > 5.0, gain
