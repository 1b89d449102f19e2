"""fold_batchnorm: the folded float model computes what the original computed."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder, op_count, random_feeds, run

from onnxq.config.spec import CalibrationConfig
from onnxq.graph.load import load_model
from onnxq.notes import Topic
from onnxq.optimize import CONTRACTS, PassContext, RunSettings, parse_passes, run_passes
from onnxq.optimize.fold_batchnorm import fold_batchnorm


def batchnorm(b: GraphBuilder, x: str, c: int) -> str:
    """A BN with clearly non-identity statistics (so a wrong fold shows)."""
    scale = b.rng.uniform(0.5, 1.5, c).astype(np.float32) * np.where(b.rng.random(c) < 0.2, -1, 1)
    bias = (b.rng.standard_normal(c) * 0.5).astype(np.float32)
    mean = (b.rng.standard_normal(c) * 0.5).astype(np.float32)
    var = b.rng.uniform(0.5, 1.5, c).astype(np.float32)
    names = [b.const(n, a.astype(np.float32)) for n, a in
             (("bn_scale", scale), ("bn_bias", bias), ("bn_mean", mean), ("bn_var", var))]
    return b.node("BatchNormalization", [x, *names], epsilon=1e-3)


def conv_bn(bias: bool) -> onnx.ModelProto:
    b = GraphBuilder(31)
    x = b.input("x", ["N", 3, 9, 9])
    y = batchnorm(b, b.conv(x, 3, 6, bias=bias), 6)
    return b.build([b.relu(y)])


def conv_transpose_bn(group: int, bias: bool = True) -> onnx.ModelProto:
    b = GraphBuilder(32 + group)
    x = b.input("x", ["N", 4, 5, 5])
    y = b.conv_transpose(x, 4, 6, k=3, stride=2, group=group, bias=bias)
    return b.build([batchnorm(b, y, 6)])


def gemm_bn(trans_b: int, bias: bool = True) -> onnx.ModelProto:
    b = GraphBuilder(40 + trans_b)
    x = b.input("x", ["N", 12])
    y = batchnorm(b, b.gemm(x, 12, 7, trans_b=trans_b, bias=bias), 7)
    return b.build([y])


def no_data() -> RunSettings:
    return RunSettings.of(None, CalibrationConfig())


def fold(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, str]:
    ir_model, _ = load_model(model)
    note = fold_batchnorm(ir_model, CONTRACTS["fold_batchnorm"].parse("fold_batchnorm", options),
                          PassContext(no_data()))
    return ir.to_proto(ir_model), note


def assert_same_function(model: onnx.ModelProto, folded: onnx.ModelProto) -> None:
    onnx.checker.check_model(folded, full_check=True)
    feeds = random_feeds(model, 4, seed=9, batch=2)
    ref, got = run(model, feeds), run(folded, feeds)
    assert ref.shape == got.shape
    rel = np.max(np.abs(ref - got)) / np.max(np.abs(ref))
    assert rel < 1e-4, rel


CASES = {
    "conv_bias": lambda: conv_bn(bias=True),
    "conv_no_bias": lambda: conv_bn(bias=False),
    "conv_transpose_group1": lambda: conv_transpose_bn(1),
    "conv_transpose_group2": lambda: conv_transpose_bn(2),
    "conv_transpose_group2_no_bias": lambda: conv_transpose_bn(2, bias=False),
    "gemm_transB0": lambda: gemm_bn(0),
    "gemm_transB1": lambda: gemm_bn(1),
    "gemm_transB1_no_bias": lambda: gemm_bn(1, bias=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fold_preserves_outputs(case):
    model = CASES[case]()
    folded, note = fold(model)
    assert note == "1 BatchNormalization folded"
    assert op_count(folded, "BatchNormalization") == 0
    assert op_count(folded, "Conv") + op_count(folded, "ConvTranspose") + op_count(folded, "Gemm") == 1
    # The producer now carries a bias, whether it had one or not.
    (producer,) = [n for n in folded.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm")]
    assert len(producer.input) == 3 and producer.input[2]
    assert [o.name for o in folded.graph.output] == [o.name for o in model.graph.output]
    assert_same_function(model, folded)


def test_fold_is_not_a_no_op():
    """Control: dropping the BN (instead of folding it) breaks the comparison."""
    model = conv_transpose_bn(2)
    ir_model, _ = load_model(model)
    bn = next(n for n in ir_model.graph if n.op_type == "BatchNormalization")
    bn.outputs[0].replace_all_uses_with(bn.inputs[0], replace_graph_outputs=True)
    ir_model.graph.remove(bn, safe=True)
    with pytest.raises(AssertionError):
        assert_same_function(model, ir.to_proto(ir_model))


def _bn_after(op: str) -> onnx.ModelProto:
    b = GraphBuilder(50)
    x = b.input("x", ["N", 4, 6, 6])
    y = b.conv(x, 4, 4)
    if op == "Relu":
        y = b.relu(y)
    elif op == "Add":
        y = b.node("Add", [y, x])
    return b.build([batchnorm(b, y, 4)])


@pytest.mark.parametrize("op", ["Relu", "Add"])
def test_bn_after_non_foldable_op_stays_and_is_reported(op):
    model = _bn_after(op)
    folded, note = fold(model)
    (bn,) = [n for n in folded.graph.node if n.op_type == "BatchNormalization"]
    assert note == f"0 BatchNormalization folded, 1 kept: {bn.name} (after {op}, not Conv/ConvTranspose/Gemm)"
    assert_same_function(model, folded)


def test_bn_on_graph_input_stays():
    b = GraphBuilder(51)
    x = b.input("x", ["N", 4, 3, 3])
    model = b.build([batchnorm(b, x, 4)])
    folded, note = fold(model)
    assert op_count(folded, "BatchNormalization") == 1
    assert note.startswith("0 BatchNormalization folded, 1 kept")


def test_conv_with_two_consumers_is_not_folded():
    b = GraphBuilder(52)
    x = b.input("x", ["N", 3, 6, 6])
    y = b.conv(x, 3, 4)
    model = b.build([batchnorm(b, y, 4), b.relu(y)])
    folded, note = fold(model)
    assert op_count(folded, "BatchNormalization") == 1
    assert "1 kept" in note
    feeds = random_feeds(model, 2, seed=1)
    for i in range(2):
        np.testing.assert_allclose(run(folded, feeds, output=i), run(model, feeds, output=i), rtol=1e-5, atol=1e-6)


def test_gemm_with_beta_is_not_folded():
    model = gemm_bn(1)
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    gemm.attribute.append(onnx.helper.make_attribute("beta", 0.5))
    folded, note = fold(model)
    assert op_count(folded, "BatchNormalization") == 1 and "1 kept" in note
    assert_same_function(model, folded)


def test_skip_fusion_layers_option():
    model = conv_bn(bias=True)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    folded, note = fold(model, skip_fusion_layers=[bn.name])
    assert op_count(folded, "BatchNormalization") == 1
    assert note.endswith(f"{bn.name} (skip_fusion_layers)")


def test_fold_runs_by_default_and_can_be_disabled():
    model = conv_bn(bias=False)
    ir_model, _ = load_model(model)
    (note,) = run_passes(ir_model, (), no_data()).notes
    assert (note.topic, note.source, note.text) == (Topic.PASS, "fold_batchnorm",
                                                    "fold_batchnorm: 1 BatchNormalization folded")
    ir_model, _ = load_model(model)
    assert run_passes(ir_model, parse_passes([{"name": "fold_batchnorm", "enabled": False}]), no_data()).notes == []
    assert op_count(ir.to_proto(ir_model), "BatchNormalization") == 1


def test_shared_weight_is_not_rewritten_in_place():
    """Two Convs share one weight; folding the BN after one must not change the other."""
    b = GraphBuilder(53)
    x = b.input("x", ["N", 3, 6, 6])
    w = b.const("shared_w", b.he((3, 3, 3, 3), 27))
    y1 = b.node("Conv", [x, w], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    y2 = b.node("Conv", [x, w], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    model = b.build([batchnorm(b, y1, 3), y2])
    folded, note = fold(model)
    assert note == "1 BatchNormalization folded"
    feeds = random_feeds(model, 2, seed=3)
    for i in range(2):
        ref, got = run(model, feeds, output=i), run(folded, feeds, output=i)
        assert np.max(np.abs(ref - got)) / np.max(np.abs(ref)) < 1e-4


def test_misspelled_option_is_a_config_error_naming_the_option():
    from onnxq.errors import ConfigError

    model = conv_bn(bias=True)
    with pytest.raises(ConfigError, match="unknown option 'skip_fusion_layer'; did you mean 'skip_fusion_layers'"):
        fold(model, skip_fusion_layer=["bn"])


def test_bn_in_training_mode_stays_and_says_why():
    """A BatchNormalization with its five outputs (opset 9-13) is in training mode, even
    with only Y read: onnxruntime normalizes by each batch's statistics, so folding its
    running ones would change the model. It stays, and the note says why; it had said 'no
    foldable producer' after a plain Conv (legacy trial)."""
    b = GraphBuilder(3)
    x = b.input("x", ["N", 4, 8, 8])
    model = b.build([batchnorm(b, b.conv(x, 4, 4), 4)])
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    bn.output.extend(["running_mean", "running_var", "saved_mean", "saved_var"])
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 13
    folded, note = fold(model)
    assert note == f"0 BatchNormalization folded, 1 kept: {bn.name} (in training mode: it outputs its batch statistics)"
    assert_same_function(model, folded)


def test_bn_with_training_mode_set_stays():
    """opset 14 on: training_mode 1 with only Y (a model onnxruntime refuses) is not
    folded into a valid model of another meaning (review)."""
    b = GraphBuilder(4)
    x = b.input("x", ["N", 4, 8, 8])
    model = b.build([batchnorm(b, b.conv(x, 4, 4), 4)])
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    bn.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    _, note = fold(model)
    assert note == f"0 BatchNormalization folded, 1 kept: {bn.name} (in training mode (training_mode 1))"
