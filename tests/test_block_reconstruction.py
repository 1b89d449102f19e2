"""Block reconstruction (`reconstruct: block`, onnxq/optimize/layerwise/block_*.py): the
numpy block computes what onnxruntime computes on the emitted graph, its gradients are
the derivatives of its output, the blocks are cut where every path passes, and a model
quantized that way is valid, runs, and stays close to float on held-out data."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import image_classifier, run, sqnr_db, uneven_weights
from onnx import helper, numpy_helper

import onnxq
from onnxq.errors import ConfigError
from onnxq.notes import Topic, of
from onnxq.optimize.layerwise.block_fit import BlockGraph
from onnxq.optimize.layerwise.block_ops import OPS
from onnxq.optimize.layerwise.blocks import between, block_start, find_blocks


def residual_net(seed: int = 0) -> onnx.ModelProto:
    """Stem (stride 2, asymmetric pads), depthwise-pointwise with ReLU6, a residual Add,
    pooling and a classifier: the shapes of MobileNet and ResNet blocks."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": uneven_weights(rng, (16, 3, 3, 3), 1.0), "b1": rng.normal(0, 0.1, 16).astype(np.float32),
        "w2": uneven_weights(rng, (16, 1, 3, 3)) * 3, "b2": rng.normal(0, 0.1, 16).astype(np.float32),
        "w3": uneven_weights(rng, (16, 16, 1, 1), 1.0), "b3": rng.normal(0, 0.1, 16).astype(np.float32),
        "w4": uneven_weights(rng, (24, 16, 1, 1), 1.0), "b4": rng.normal(0, 0.1, 24).astype(np.float32),
        "w5": uneven_weights(rng, (10, 24), 1.0), "b5": rng.normal(0, 0.1, 10).astype(np.float32),
        "lo": np.array(0, np.float32), "hi": np.array(6, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[0, 0, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="dw", pads=[1, 1, 1, 1], group=16),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="pw"),
        helper.make_node("Add", ["c3", "r1"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r3"], name="relu3"),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], name="expand"),
        helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),
        helper.make_node("GlobalAveragePool", ["r4"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w5", "b5"], ["y"], name="fc", transB=1),
    ]
    return image_classifier(nodes, inits, "residual")


def images(n: int, seed: int) -> np.ndarray:
    """Smooth random images: a few low-frequency waves per channel."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(0, 2 * np.pi, 16, dtype=np.float32)
    out = np.zeros((n, 3, 16, 16), np.float32)
    for _ in range(3):
        fx, fy = rng.uniform(0.5, 2.5, (2, n, 3, 1, 1)).astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi, (n, 3, 1, 1)).astype(np.float32)
        out += np.sin(fx * grid[None, None, None, :] + fy * grid[None, None, :, None] + phase)
    return out + rng.normal(0, 0.1, out.shape).astype(np.float32)


def _w4a8(reconstruct: str, **extra) -> onnxq.Config:
    config = onnxq.get_preset("W4A8")
    config.edge_weight = config.depthwise_weight = None  # all-int4
    config.algo_config = [{"name": "adaround", "reconstruct": reconstruct, "num_iteration": 100,
                           "block_iterations": 60, "validation_every": 0, **extra}]
    return config


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """The residual net quantized W4A8 (nearest rounding): path and calibration data."""
    folder = tmp_path_factory.mktemp("blocks")
    onnx.save(residual_net(), folder / "f.onnx")
    calib = images(48, 1)
    np.savez(folder / "calib.npz", x=calib)
    config = onnxq.get_preset("W4A8")
    config.algo_config = []
    onnxq.quantize(folder / "f.onnx", folder / "q.onnx", config, folder / "calib.npz")
    return folder


def _blocks_of(folder):
    qmodel = ir.load(folder / "q.onnx")
    fmodel = ir.load(folder / "f.onnx")
    qnodes = {n.name: n for n in qmodel.graph}
    names = ["stem", "dw", "pw", "expand", "fc"]
    fnodes = {n.name: n for n in fmodel.graph}

    spec = SimpleNamespace(dtype="int4", pairs=None)  # a resolved int4 weight spec

    class _L:  # the fields find_blocks reads
        def __init__(self, node):
            self.node, self.name = node, node.name
            self.weight = SimpleNamespace(spec=spec)
    return qmodel, [_L(fnodes[n]) for n in names], qnodes


def test_blocks_are_cut_where_every_path_passes(emitted):
    qmodel, layers, qnodes = _blocks_of(emitted)
    blocks, refused = find_blocks(qmodel.graph, layers, qnodes, "y", 2)
    # dw's and pw's inputs are not cuts (the residual branch passes beside them); the
    # stem joins the residual block, expand joins the classifier through the pooling.
    assert [[layer.name for layer in b.layers] for b in blocks] == [["stem", "dw", "pw"], ["expand", "fc"]]
    assert not refused
    assert blocks[-1].end == "y" and blocks[-1].float_end == "y"
    assert between(qmodel.graph, block_start(qnodes["pw"]), qnodes["expand"].inputs[0]) is None


def test_numpy_block_matches_onnxruntime(emitted):
    """Every block, run by `block_ops` from its start, gives onnxruntime's value at its end."""
    qmodel, layers, qnodes = _blocks_of(emitted)
    blocks, _ = find_blocks(qmodel.graph, layers, qnodes, "y", 2)
    proto = onnx.load(emitted / "q.onnx")
    names = sorted({n for b in blocks for n in (b.start, b.end)})
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n != "y")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = dict(zip([o.name for o in proto.graph.output],
                   ort.InferenceSession(proto.SerializeToString(), options).run(None, {"x": images(6, 9)})))
    for block in blocks:
        consts = {v.name: v.const_value.numpy() for n in block.nodes for v in n.inputs
                  if v is not None and v.const_value is not None}
        out, _ = BlockGraph(block, consts, []).forward(got[block.start], {}, keep=False)
        ref = got[block.end]
        assert np.abs(out - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1), block.end


@pytest.mark.parametrize("op", ["Conv", "Gemm", "GlobalAveragePool", "Add", "Clip"])
def test_backward_is_the_derivative(op):
    """Each op's backward against central differences of its forward (float64 sums)."""
    rng = np.random.default_rng(3)
    if op == "Conv":
        node = ir.node("Conv", [ir.Value(name="x"), ir.Value(name="w")], attributes={"strides": [2, 2],
                       "pads": [0, 1, 1, 0], "group": 2})
        ins = [rng.normal(size=(2, 4, 5, 5)), rng.normal(size=(6, 2, 3, 3))]
    elif op == "Gemm":
        node = ir.node("Gemm", [ir.Value(name="a"), ir.Value(name="b"), ir.Value(name="c")],
                       attributes={"transB": 1, "alpha": 0.5})
        ins = [rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5,))]
    elif op == "GlobalAveragePool":
        node = ir.node(op, [ir.Value(name="x")])
        ins = [rng.normal(size=(2, 3, 4, 4))]
    elif op == "Add":
        node = ir.node(op, [ir.Value(name="a"), ir.Value(name="b")])
        ins = [rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 1))]
    else:
        bounds = [ir.Value(name=n, const_value=ir.tensor(np.array(v, np.float32))) for n, v in (("lo", -0.5), ("hi", 0.7))]
        node = ir.node(op, [ir.Value(name="x"), *bounds])  # constant bounds, as blocks.py requires
        ins = [rng.normal(size=(4, 5)), np.array(-0.5), np.array(0.7)]
    ins = [np.asarray(a, np.float32) for a in ins]
    impl = OPS[op]
    out, cache = impl.forward(node, ins)
    probe = rng.normal(size=out.shape).astype(np.float32)
    wanted = [True, True, True][:len(ins)] if op != "Clip" else [True, False, False]
    grads = impl.backward(node, cache, probe, wanted)
    eps = 1e-2
    for i, (a, g) in enumerate(zip(ins, grads)):
        if not wanted[i]:
            continue
        for idx in list(np.ndindex(a.shape))[:: max(1, a.size // 12)]:
            plus, minus = [x.copy() for x in ins], [x.copy() for x in ins]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            f = lambda v: float(np.sum(impl.forward(node, v)[0].astype(np.float64) * probe))  # noqa: E731
            numeric = (f(plus) - f(minus)) / (2 * eps)
            assert abs(numeric - g[idx]) <= 2e-2 * max(1.0, abs(numeric)), (op, i, idx)


def test_block_reconstruction_end_to_end(tmp_path):
    """All-int4 weights: the block pass runs, says what it did, and the model is valid,
    runs in a default session and is no further from float on held-out images than the
    layer-wise rounding (within 0.5 dB)."""
    onnx.save(residual_net(), tmp_path / "f.onnx")
    np.savez(tmp_path / "calib.npz", x=images(64, 1))
    held_out = {"x": images(64, 2)}
    float_out = run(tmp_path / "f.onnx", held_out)
    scores = {}
    for mode in ("layer", "block"):
        result = onnxq.quantize(tmp_path / "f.onnx", tmp_path / f"{mode}.onnx", _w4a8(mode), tmp_path / "calib.npz")
        onnx.checker.check_model(onnx.load(tmp_path / f"{mode}.onnx"), full_check=True)
        scores[mode] = sqnr_db(float_out, run(tmp_path / f"{mode}.onnx", held_out))
        line = " ".join(n.text for n in of(result.summary.notes, Topic.ALGORITHM) if n.source == "adaround")
        assert ("blocks:" in line) == (mode == "block"), line
    assert "of 2 improved on their layer-wise rounding" in line
    assert scores["block"] >= scores["layer"] - 0.5, scores
    assert scores["block"] > 10, scores


def test_block_reconstruction_is_deterministic(tmp_path):
    onnx.save(residual_net(), tmp_path / "f.onnx")
    np.savez(tmp_path / "calib.npz", x=images(32, 1))
    for name in ("a", "b"):
        onnxq.quantize(tmp_path / "f.onnx", tmp_path / f"{name}.onnx", _w4a8("block", block_iterations=20),
                       tmp_path / "calib.npz")
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_bad_block_options_are_one_line_errors():
    with pytest.raises(ConfigError, match="reconstruct is one of layer, block"):
        onnxq.AdaRoundConfig(reconstruct="blocks")
    with pytest.raises(ConfigError, match="use the adaround algorithm"):
        onnxq.AdaQuantConfig(reconstruct="block")
    with pytest.raises(ConfigError, match="needs inputs: quantized"):
        onnxq.AdaRoundConfig(reconstruct="block", inputs="float")
    with pytest.raises(ConfigError, match="at least 1"):
        onnxq.AdaRoundConfig(reconstruct="block", block_iterations=0)


def test_pair_safe_weights_keep_their_layer_wise_rounding(tmp_path):
    """On x86-avx2 the int8 weights are held pair-safe layer by layer; the block pass,
    which does not hold them, leaves those blocks alone and says why."""
    from helpers import kernel_pair_sums

    from onnxq.config.compose import compose_config
    from onnxq.target.pairs import PAIR_LIMIT

    onnx.save(residual_net(), tmp_path / "f.onnx")
    np.savez(tmp_path / "calib.npz", x=images(32, 1))
    config = compose_config("U8S8", None, {"target": "x86-avx2", "target_algorithms": False})
    config.algo_config = [{"name": "adaround", "reconstruct": "block", "num_iteration": 50, "block_iterations": 20,
                           "validation_every": 0}]
    result = onnxq.quantize(tmp_path / "f.onnx", tmp_path / "q.onnx", config, tmp_path / "calib.npz")
    line = " ".join(n.text for n in of(result.summary.notes, Topic.ALGORITHM) if n.source == "adaround")
    assert "blocks: 0 of" in line and "pair-safe weights" in line, line
    model = onnx.load(tmp_path / "q.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        depthwise = any(a.name == "group" and a.i > 1 for a in node.attribute)  # no pair kernel there
        if node.op_type == "Conv" and not depthwise and node.input[1] in producers:
            codes = inits[producers[node.input[1]].input[0]]
            if codes.dtype == np.int8:
                assert kernel_pair_sums(node, codes).max() <= PAIR_LIMIT, node.name


def test_the_reconstruct_flag(tmp_path, capsys):
    """`--reconstruct block` sets AdaRound's option: over a preset's AdaRound, with the
    --adaround flag, or switching AdaRound on; with --adaquant it is AdaQuant's one-line
    error (exit 2); the CLI run reports its blocks and writes a valid model."""
    import yaml

    from onnxq.cli import main

    onnx.save(residual_net(), tmp_path / "f.onnx")
    np.savez(tmp_path / "calib.npz", x=images(32, 1))

    def shown(*flags: str) -> list[dict]:
        assert main(["config", "show", *flags]) == 0
        return yaml.safe_load(capsys.readouterr().out)["algo_config"]

    assert shown("--preset", "W4A8", "--reconstruct", "block") == [{"name": "adaround", "reconstruct": "block"}]
    assert shown("--adaround", "--reconstruct", "layer") == [{"name": "adaround", "reconstruct": "layer"}]
    assert shown("--reconstruct", "block") == [{"name": "adaround", "reconstruct": "block"}]
    assert main(["quantize", str(tmp_path / "f.onnx"), str(tmp_path / "a.onnx"), "--adaquant", "--reconstruct",
                 "block", "--calib-data", str(tmp_path / "calib.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use the adaround algorithm" in err[0]
    assert not (tmp_path / "a.onnx").exists()
    # a config file's AdaQuant: --reconstruct alone would replace it by AdaRound unasked
    (tmp_path / "aq.yaml").write_text("algo_config: [{name: adaquant, num_iteration: 20}]\n")
    assert main(["config", "show", "--config", str(tmp_path / "aq.yaml"), "--reconstruct", "block"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "runs adaquant" in err and "--adaround" in err and len(err.strip().splitlines()) == 1
    assert shown("--config", str(tmp_path / "aq.yaml"), "--adaround", "--reconstruct", "block") == [
        {"name": "adaround", "reconstruct": "block"}]
    assert main(["quantize", str(tmp_path / "f.onnx"), str(tmp_path / "b.onnx"), "--preset", "W4A8",
                 "--reconstruct", "block", "--algo-option", "adaround.block_iterations=20",
                 "--calib-data", str(tmp_path / "calib.npz")]) == 0
    assert "blocks:" in capsys.readouterr().out
    onnx.checker.check_model(onnx.load(tmp_path / "b.onnx"), full_check=True)
