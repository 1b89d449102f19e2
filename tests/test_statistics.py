"""Statistics requests (`onnxq.calibrate.statistics`): in-session reductions equal numpy's,
and bias correction's statistics come with the calibration pass (no pass of its own)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, random_feeds, stack_feeds

import onnxq
from onnxq.calibrate import runner
from onnxq.calibrate.runner import collect
from onnxq.calibrate.statistics import Statistic
from onnxq.config.spec import CalibrationConfig
from onnxq.graph.layout import ConvGeometry
from onnxq.graph.load import load_model


def conv_net():
    b = GraphBuilder(7)
    x = b.input("x", ["N", 3, 6, 6])
    h = b.relu(b.conv(x, 3, 8))
    return b.build([b.conv(h, 8, 4)], name="stats_net")


GEOMETRY = ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1, 1, 1))


def test_in_session_reductions_match_numpy():
    proto = conv_net()
    model, _ = load_model(proto)
    feeds = random_feeds(proto, 5, seed=3)
    x = stack_feeds(feeds)["x"].astype(np.float64)
    stats = [Statistic("x", "min", 1), Statistic("x", "max", 1), Statistic("x", "absmax", 1),
             Statistic("x", "mean", 1), Statistic("x", "mean", -1), Statistic("x", "windows", 1, GEOMETRY)]
    found = collect(model, stats, feeds, CalibrationConfig(batch_size=2))
    np.testing.assert_allclose(found[stats[0]], x.min(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(found[stats[1]], x.max(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(found[stats[2]], np.abs(x).max(axis=(0, 2, 3)), rtol=1e-6)
    # means: float32 sums over each sample's positions, double across samples
    np.testing.assert_allclose(found[stats[3]], x.mean(axis=(0, 2, 3)), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(found[stats[4]], x.mean(axis=(0, 1, 2)), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(found[stats[5]], GEOMETRY.window_means(x.sum(axis=0)) / len(x), rtol=1e-6, atol=1e-9)
    # every one of them is reduced in the session: no tensor comes back whole
    seen: list[list[str]] = []
    real = runner.exposed_session

    def spy(model, names, *args, **kwargs):
        seen.append(list(names))
        return real(model, names, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "exposed_session", spy)
        collect(model, stats, feeds, CalibrationConfig(batch_size=2))
    assert seen and all("x" not in names for names in seen)
    # absmax alone is reduced in the session; with min and max of the same axis, derived from them
    alone = collect(model, [stats[2]], feeds, CalibrationConfig(batch_size=2))
    np.testing.assert_array_equal(alone[stats[2]], found[stats[2]])


def test_tensors_of_unknown_rank_are_reduced_in_numpy():
    proto = conv_net()
    model, _ = load_model(proto)
    hidden = next(iter(model.graph)).outputs[0]
    hidden.shape = None  # as if shape inference had failed
    feeds = random_feeds(proto, 4, seed=4)
    stat = Statistic(hidden.name, "absmax", 1)
    found = collect(model, [stat], feeds, CalibrationConfig(batch_size=3))
    assert found[stat].shape == (8,) and np.all(found[stat] > 0)


def test_bias_correction_statistics_come_with_calibration(monkeypatch: pytest.MonkeyPatch):
    purposes: list[str] = []
    real = runner.stream_tensors

    def spy(model, names, data, options, progress=None, purpose="calibrating", *args, **kwargs):
        purposes.append(purpose)
        return real(model, names, data, options, progress, purpose, *args, **kwargs)

    monkeypatch.setattr(runner, "stream_tensors", spy)
    proto = conv_net()
    feeds = random_feeds(proto, 6, seed=5)
    config = onnxq.get_preset("U8S8")
    config.global_quant_config.weight.qscheme = "per_tensor"
    config.algo_config = [{"name": "bias_correction"}]
    config.target_algorithms = False
    result = onnxq.quantize(proto, None, config, feeds)
    assert purposes == ["calibrating"]  # one pass over the data for calibration and bias correction
    assert any(n.startswith("bias_correction: 2 of 2 biases corrected") for n in result.summary.note_texts)


def test_reductions_run_right_after_their_tensor():
    """The session runs nodes in graph order: each reduction sits right after its tensor's
    producer, so the tensor can be freed before the next layer runs (appended at the end,
    every observed tensor stayed alive to the end of the run)."""
    from onnxq.calibrate.session import place_observers
    from onnxq.calibrate.statistics import StatisticsSet

    model, _ = load_model(conv_net())
    layers = list(model.graph)
    stats = StatisticsSet([Statistic(n.outputs[0].name, r, 1) for n in layers for r in ("min", "mean")])
    nodes, _, whole = stats.attach(model)
    assert not whole  # all reduced in the session
    place_observers(model.graph, nodes)
    order = list(model.graph)
    starts = [order.index(layer) for layer in layers] + [len(order)]
    for i, layer in enumerate(layers):
        after = order[starts[i] + 1:starts[i + 1]]
        readers = [n for n in nodes if layer.outputs[0] in n.inputs]
        assert len(readers) >= 2 and all(n in after for n in readers), layer.name


def test_bounded_image_ranges_read_their_bound_and_the_true_max():
    """A Relu's output and a Clip(0.5, 4)'s reach calibration as [bound, true max] (one
    reduction instead of two); an unbounded tensor as its true [min, max]."""
    import onnx

    from onnxq.calibrate.runner import stream_tensors

    b = GraphBuilder(8)
    x = b.input("x", ["N", 3, 9, 9])
    conv = b.conv(x, 3, 8)
    relu = b.relu(conv)
    low, high = b.const("low", np.float32(0.5)), b.const("high", np.float32(4.0))
    clipped = b.node("Clip", [b.conv(relu, 8, 8), low, high])
    lifted = b.relu(b.node("Add", [relu, b.const("ten", np.float32(10.0))]))  # every value above 10
    names = [conv, relu, clipped, lifted]
    proto = b.build([b.conv(clipped, 8, 4), lifted], name="bounded")
    model, _ = load_model(proto)
    feeds = random_feeds(proto, 6, seed=9)
    lows, highs = {n: np.inf for n in names}, {n: -np.inf for n in names}
    for _, values in stream_tensors(model, names, feeds, CalibrationConfig(batch_size=4), reduced=set(names)):
        for n in names:
            lows[n], highs[n] = min(lows[n], values[n][0]), max(highs[n], values[n][1])
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    reference = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = dict(zip(names, reference.run(names, stack_feeds(feeds))))
    assert lows[relu] == 0.0 and lows[clipped] == 0.5
    assert outs[lifted].min() >= 10 and lows[lifted] == 0.0  # the bound, not the data's minimum
    assert lows[conv] == pytest.approx(outs[conv].min(), rel=1e-5)
    for n in names:
        assert highs[n] == pytest.approx(outs[n].max(), rel=1e-5), n



@pytest.mark.parametrize("channels", [3, 4])  # MatMuls; Convs of ones (`tap_nodes`)
@pytest.mark.parametrize("shape, geometry, in_session", [
    (["N", 3, 11], ConvGeometry((3,), (2,), (2,), (1, 2)), True),  # 1-d, dilated, uneven pads
    (["N", 3, 7, 9], ConvGeometry((3, 2), (1, 2), (1, 1), (0, 0, 0, 0), "SAME_UPPER"), True),
    (["N", 3, 7, 9], ConvGeometry((5, 5), (3, 3), (1, 1), (2, 2, 2, 2)), True),  # kernel past the edges
    (["N", 3, 8, 8], ConvGeometry((3, 3), (2, 2), (1, 1), (1, 1, 1, 1)), True),  # stride 2 (MobileNet's)
    (["N", 3, 11, 10], ConvGeometry((2, 3), (3, 4), (2, 1), (0, 1, 0, 0)), True),  # more positions than taps
    (["N", 3, 6, 6], ConvGeometry((3, 3), (1, 1), (1, 1), (4, 0, 0, 4)), True),  # a tap that reads nothing
    (["N", 3, "H", "W"], GEOMETRY, False),  # spatial size unknown: the samples summed, contracted in numpy
])
def test_window_sums_in_the_session_match_numpy(shape, geometry, in_session, channels):
    """Window means reduced by MatMuls or Convs of ones inside onnxruntime (`tap_nodes`)
    equal `ConvGeometry.window_means` of the batch sum in float64; a tensor of unknown
    spatial size takes the ReduceSum path."""
    from onnxq.calibrate.statistics import StatisticsSet

    b = GraphBuilder(3)
    x = b.input("x", [shape[0], channels, *shape[2:]])
    model, _ = load_model(b.build([b.node("Relu", [x])], name="windows"))
    spatial = [7, 9] if not in_session else shape[2:]
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal([2, channels, *spatial]).astype(np.float32)} for _ in range(3)]
    stat = Statistic("x", "windows", 1, geometry)
    found = collect(model, [stat], feeds, CalibrationConfig(batch_size=2))
    xs = np.concatenate([f["x"] for f in feeds]).astype(np.float64)
    np.testing.assert_allclose(found[stat], geometry.window_means(xs.sum(axis=0)) / len(xs), rtol=1e-5, atol=1e-7)
    requests = StatisticsSet([stat])
    ops = {node.op_type for node in requests.attach(model)[0]}
    assert (stat in requests.taps) == in_session
    if in_session:
        assert ops - {"Constant"} == ({"Conv"} if channels == 4 and len(shape) == 4 else {"MatMul"})
        # a GPU provider first: its GEMMs, not the CPU's blocked convolutions
        assert {node.op_type for node in StatisticsSet([stat]).attach(model, on_cpu=False)[0]} - {"Constant"} == {
            "MatMul"}


def test_calibration_batches_keep_a_samples_largest_image_in_cache():
    """`calibration_batch`: at most batch_size samples, fewer where one sample's largest
    activation times the batch passes BATCH_IMAGE_BYTES; unknown sizes keep batch_size."""
    from onnxq.calibrate.runner import BATCH_IMAGE_BYTES, calibration_batch

    def model(shape):
        b = GraphBuilder(1)
        return load_model(b.build([b.relu(b.conv(b.input("x", shape), 3, 8))], name="big"))[0]

    large = model(["N", 3, 256, 256])  # the Conv's output: 8 x 256 x 256 float32 = 2 MiB a sample
    assert calibration_batch(large, CalibrationConfig(batch_size=8)) == BATCH_IMAGE_BYTES // (2 << 20) == 3
    assert calibration_batch(large, CalibrationConfig(batch_size=2)) == 2
    assert calibration_batch(model(["N", 3, 16, 16]), CalibrationConfig(batch_size=8)) == 8
    assert calibration_batch(model(["N", 3, "H", "W"]), CalibrationConfig(batch_size=8)) == 8
    # max_batches counts batches of batch_size (AMCT's batch_num): not cut
    assert calibration_batch(large, CalibrationConfig(batch_size=8, max_batches=2)) == 8


def test_image_means_of_unknown_size_weigh_every_position():
    """Channel means of fixed-size images come per sample from GlobalAveragePool; where the
    size can change between batches they are sums over positions, so every position
    weighs the same whatever its batch's size."""
    from onnxq.calibrate.statistics import StatisticsSet

    b = GraphBuilder(3)
    x = b.input("x", ["N", 2, "H", "W"])
    model, _ = load_model(b.build([b.node("Relu", [x])], name="sizes"))
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32) - 5},
             {"x": rng.standard_normal((1, 2, 32, 32)).astype(np.float32)}]
    stat = Statistic("x", "mean", 1)
    found = collect(model, [stat], feeds, CalibrationConfig(batch_size=1))
    every = np.concatenate([f["x"].reshape(2, -1) for f in feeds], axis=1).astype(np.float64)
    np.testing.assert_allclose(found[stat], every.mean(axis=1), rtol=1e-6)
    requests = StatisticsSet([stat])
    nodes, _, _ = requests.attach(model)
    assert not any(n.op_type == "GlobalAveragePool" for n in nodes)


@pytest.mark.parametrize("channels", [24, 32])
def test_window_sums_of_a_conv_output_on_the_blocked_layout(channels):
    """Window sums of a Conv's output, where onnxruntime runs the Conv and the Convs of ones
    on its blocked layout (channels a multiple of the block and not): the same means as the
    tensor returned whole and reduced in numpy."""
    b = GraphBuilder(3)
    x = b.input("x", ["N", 3, 12, 12])
    relu = b.relu(b.conv(x, 3, channels))
    proto = b.build([relu], name="blocked")
    model, _ = load_model(proto)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal([2, 3, 12, 12]).astype(np.float32)} for _ in range(2)]
    stat = Statistic(relu, "windows", 1, GEOMETRY)
    found = collect(model, [stat], feeds, CalibrationConfig(batch_size=2))
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = np.concatenate([reference.run([relu], f)[0] for f in feeds]).astype(np.float64)
    assert np.abs(outs).max() > 0
    np.testing.assert_allclose(found[stat], GEOMETRY.window_means(outs.sum(axis=0)) / len(outs), rtol=1e-5, atol=1e-7)


def test_a_failed_opening_leaves_the_model_as_it_was(monkeypatch):
    """Whatever stops the calibration session opening (here an interrupt), the reductions
    added to the model are taken out again: the next session on it would otherwise meet
    their names twice."""
    from onnxq.calibrate import session as session_module

    b = GraphBuilder(3)
    model, _ = load_model(b.build([b.relu(b.conv(b.input("x", ["N", 3, 8, 8]), 3, 4))], name="restore"))
    before = (len(list(model.graph)), len(model.graph.outputs))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_module, "open_session", interrupted)
    names = [v.name for v in model.graph.outputs]
    with pytest.raises(KeyboardInterrupt), session_module.exposed_session(model, names, ["CPUExecutionProvider"],
                                                                          reduced=set(names)):
        pass
    assert (len(list(model.graph)), len(model.graph.outputs)) == before
