"""Per-group MatMul weights beside static 8-bit inputs: onnxruntime would fuse the pair into
its integer MatMul, which takes one scale per column and fails at run time, so such a
MatMul keeps its per-group weight and reads float inputs; the summary says which and why.
A MatMul of two activations keeps its quantized inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import op_count, sqnr_db
from helpers import run as run_feeds
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.notes import Topic

PER_GROUP = {"preset": "U8S8", "global_quant_config": {"weight": {"qscheme": "per_group", "group_size": 32}}}


def weighted_and_activation_matmuls() -> onnx.ModelProto:
    """x @ W1 -> Relu -> (@ W2, and @ its own transpose): two weighted MatMuls, one of activations."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((128, 128)) / np.sqrt(128)).astype(np.float32)
    w2 = (rng.standard_normal((128, 32)) / np.sqrt(128)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2"),
             helper.make_node("Transpose", ["r"], ["rT"], name="tr", perm=[1, 0]),
             helper.make_node("MatMul", ["r", "rT"], ["z"], name="mm_aa")]
    graph = helper.make_graph(
        nodes, "pairs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 8])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def calib(n: int = 16, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, 128)).astype(np.float32)} for _ in range(n)]


def test_per_group_matmul_weights_with_static_inputs_run_weight_only():
    proto = weighted_and_activation_matmuls()
    result = onnxq.quantize(proto, None, PER_GROUP, calib(), progress=False)
    out = result.model
    onnx.checker.check_model(out)
    feeds = calib(4, seed=7)
    ref, got = run_feeds(proto, feeds), run_feeds(out, feeds)  # runs: no fused integer MatMul on blocks
    for r, g in zip(ref, got):
        assert sqnr_db(r, g) > 30
    blocked = [n for n in out.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 32 for a in n.attribute)]
    assert len(blocked) == 2  # both weights stay per-group int8
    note = next(n for n in result.summary.notes if n.topic is Topic.FLOAT and "float inputs" in n.text)
    assert set(note.nodes) == {"mm1", "mm2"} and "per_group weights with uint8 inputs" in note.text
    # the activation x activation MatMul keeps its quantized inputs
    producers = {o: n.op_type for n in out.graph.node for o in n.output}
    aa = next(n for n in out.graph.node if n.op_type == "MatMul" and n.output[0] == "z")
    assert [producers.get(i) for i in aa.input] == ["DequantizeLinear", "DequantizeLinear"]


def test_with_matmul_nbits_they_become_matmulnbits():
    config = {**PER_GROUP, "matmul_nbits": True}
    out = onnxq.quantize(weighted_and_activation_matmuls(), None, config, calib(), progress=False).model
    assert op_count(out, "MatMulNBits", "com.microsoft") == 2
    run_feeds(out, calib(2, seed=7))


def test_per_channel_weights_keep_integer_inputs():
    proto = weighted_and_activation_matmuls()
    result = onnxq.quantize(proto, None, "U8S8", calib(), progress=False)
    assert not any("float inputs" in n.text for n in result.summary.notes)
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    weighted = [n for n in result.model.graph.node if n.op_type == "MatMul" and n.output[0] == "y"]
    assert [producers.get(i) for i in weighted[0].input] == ["DequantizeLinear", "DequantizeLinear"]


@pytest.mark.parametrize("weight", [{"dtype": "int4", "symmetric": False}, {"group_size": 128}])
def test_pairs_onnxruntime_runs_keep_their_integer_inputs(weight):
    """4-bit blocks (not fused) and blocks as long as the column (one scale per column,
    which the fused kernel takes) keep static inputs, and run."""
    config = {"preset": "U8S8", "global_quant_config": {"weight": {"qscheme": "per_group", "group_size": 32, **weight}}}
    proto = weighted_and_activation_matmuls()
    result = onnxq.quantize(proto, None, config, calib(), progress=False)
    assert not any("float inputs" in n.text for n in result.summary.notes)
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    first = next(n for n in result.model.graph.node if n.op_type == "MatMul" and "W1" in "".join(n.input))
    assert [producers.get(i) for i in first.input] == ["DequantizeLinear", "DequantizeLinear"]
    feeds = calib(2, seed=7)
    for r, g in zip(run_feeds(proto, feeds), run_feeds(result.model, feeds)):
        assert sqnr_db(r, g) > 15


def test_the_int16_rung_leaves_a_float_input_matmul_as_it_is():
    """The accuracy search's int16 rung gives a node 16-bit inputs; a MatMul reading float
    inputs already would be lowered by it, so the rung leaves it out: the model it scores
    and the config it returns keep the float inputs."""
    from onnxq.search.ladder import effective, with_promotions

    proto = weighted_and_activation_matmuls()
    result = onnxq.quantize(proto, None, PER_GROUP, calib(), progress=False)
    assert set(result.plan.float_inputs) == {"mm1", "mm2"}
    promotions = {"mm1": "int16", "mm2": "float", "mm_aa": "int16"}
    kept = effective(promotions, result.plan)
    assert kept == {"mm2": "float", "mm_aa": "int16"}
    raised = onnxq.quantize(proto, None, with_promotions(onnxq.as_config(PER_GROUP), kept), calib(),
                            progress=False).model
    producers = {o: n for n in raised.graph.node for o in n.output}
    mm1 = next(n for n in raised.graph.node if n.name == "mm1")
    assert mm1.input[0] not in producers  # mm1 reads the model input x as it is: float, as before
    aa = next(n for n in raised.graph.node if n.output[0] == "z")
    dq = producers[aa.input[0]]
    zero_point = next(i for i in raised.graph.initializer if i.name == dq.input[2])
    assert zero_point.data_type in (TensorProto.UINT16, TensorProto.INT16)  # the rung raised mm_aa


def test_the_search_counts_only_the_layers_a_rung_raises():
    """An int16-only ladder over a model whose weighted MatMuls read float inputs: the rung
    raises only the activation x activation MatMul, and the summary counts that one."""
    config = {**PER_GROUP, "mixed_precision": {"target": "sqnr>=200", "ladder": ["int16"]}}
    result = onnxq.quantize(weighted_and_activation_matmuls(), None, config, calib(), progress=False)
    mp = result.summary.mixed_precision
    assert mp.ranked_layers >= 3 and mp.trials  # mm1, mm2 and mm_aa ranked; the int16 rung tried
    assert {t["promoted"] for t in mp.trials} <= {0, 1}  # of them only mm_aa is raised by int16
    assert not any(p.node in ("mm1", "mm2") for p in mp.promotions)
