"""Cross-layer equalization: float outputs unchanged, paired channel ranges equalized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import run
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.calibrate.data import CalibrationSource
from onnxq.config.spec import CalibrationConfig
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.graph.fold import constant_array
from onnxq.graph.load import load_model
from onnxq.optimize import RunSettings, parse_passes, run_passes
from onnxq.optimize.cle import find_pairs, in_ranges, out_ranges

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def uneven(rng: np.random.Generator, shape: tuple[int, ...], axis: int = 0) -> np.ndarray:
    """He-normal weights whose channels along `axis` differ in range by up to ~50x."""
    w = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
    factor = np.exp(rng.uniform(-2.0, 2.0, shape[axis]))
    factor /= np.sqrt(np.mean(factor**2))  # keep the output variance of He init
    return (w * factor.reshape([-1 if i == axis else 1 for i in range(len(shape))])).astype(np.float32)


def build(nodes: list, inits: dict[str, np.ndarray], x_shape: list) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "cle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def conv(name: str, x: str, out: str, group: int = 1, pad: int = 1) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [out], name=name, group=group, pads=[pad] * 4)


def conv_relu_conv(seed: int = 0, act: str = "Relu") -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {"c1_w": uneven(rng, (16, 8, 3, 3)), "c1_b": rng.normal(0, 0.1, 16).astype(np.float32),
             "c2_w": uneven(rng, (12, 16, 3, 3), axis=1), "c2_b": rng.normal(0, 0.1, 12).astype(np.float32)}
    nodes = [conv("c1", "x", "h")]
    if act == "Relu":
        nodes.append(helper.make_node("Relu", ["h"], ["a"], name="act"))
    else:  # ReLU6
        inits.update(lo=np.array(0.0, np.float32), hi=np.array(6.0, np.float32))
        nodes.append(helper.make_node("Clip", ["h", "lo", "hi"], ["a"], name="act"))
    nodes.append(conv("c2", "a", "y"))
    return build(nodes, inits, ["N", 8, 10, 10])


def conv_dw_conv(seed: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = {"c1_w": uneven(rng, (16, 4, 3, 3)), "c1_b": rng.normal(0, 0.1, 16).astype(np.float32),
             "dw_w": uneven(rng, (16, 1, 3, 3)), "dw_b": rng.normal(0, 0.1, 16).astype(np.float32),
             "c2_w": uneven(rng, (8, 16, 1, 1), axis=1), "c2_b": rng.normal(0, 0.1, 8).astype(np.float32)}
    nodes = [conv("c1", "x", "h1"), helper.make_node("Relu", ["h1"], ["a1"]),
             conv("dw", "a1", "h2", group=16), helper.make_node("Relu", ["h2"], ["a2"]),
             conv("c2", "a2", "y", pad=0)]
    return build(nodes, inits, ["N", 4, 8, 8])


def grouped(seed: int = 2) -> onnx.ModelProto:
    """Conv -> Relu -> grouped conv (4 groups), then MaxPool -> 1x1 conv."""
    rng = np.random.default_rng(seed)
    inits = {"c1_w": uneven(rng, (16, 3, 3, 3)), "c1_b": rng.normal(0, 0.1, 16).astype(np.float32),
             "g_w": uneven(rng, (8, 4, 3, 3)), "g_b": rng.normal(0, 0.1, 8).astype(np.float32),
             "c2_w": uneven(rng, (6, 8, 1, 1), axis=1), "c2_b": rng.normal(0, 0.1, 6).astype(np.float32)}
    nodes = [conv("c1", "x", "h1"), helper.make_node("Relu", ["h1"], ["a1"]),
             conv("g", "a1", "h2", group=4), helper.make_node("MaxPool", ["h2"], ["p"], kernel_shape=[2, 2]),
             conv("c2", "p", "y", pad=0)]
    return build(nodes, inits, ["N", 3, 8, 8])


def gemm_relu_gemm(trans_b: int, seed: int = 3) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = uneven(rng, (32, 16)) if trans_b else uneven(rng, (16, 32), axis=1)
    w2 = uneven(rng, (10, 32), axis=1) if trans_b else uneven(rng, (32, 10), axis=0)
    inits = {"g1_w": w1, "g1_b": rng.normal(0, 0.1, 32).astype(np.float32),
             "g2_w": w2, "g2_b": rng.normal(0, 0.1, 10).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "g1_w", "g1_b"], ["h"], name="g1", transB=trans_b),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "g2_w", "g2_b"], ["y"], name="g2", transB=trans_b)]
    return build(nodes, inits, ["N", 16])


def feeds(model: onnx.ModelProto, n: int = 8, seed: int = 7) -> dict[str, np.ndarray]:
    shape = [n if not d.dim_value else d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {model.graph.input[0].name: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def context(data: dict | None = None) -> RunSettings:
    return RunSettings(CalibrationSource(data), CalibrationConfig())


def apply(model: onnx.ModelProto, options: dict | None = None, data: dict | None = None) -> tuple[ir.Model, list[str]]:
    ir_model, _ = load_model(model)
    notes = [n.text for n in run_passes(ir_model, parse_passes([{"name": "cle", **(options or {})}]), context(data)).notes]
    return ir_model, notes


def assert_same_outputs(before: onnx.ModelProto, after: ir.Model, feed: dict, rtol: float = 1e-5) -> None:
    ref, got = run(before, feed), run(ir.to_proto(after), feed)
    assert np.max(np.abs(ref - got)) <= rtol * np.max(np.abs(ref)), np.max(np.abs(ref - got))


def pair_ranges(model: ir.Model) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (out_ranges(p.first, constant_array(p.first.inputs[1])), in_ranges(p.second, constant_array(p.second.inputs[1])))
        for p in find_pairs(model.graph, set())
    ]


@pytest.mark.parametrize("build_model", [conv_relu_conv, conv_dw_conv, grouped,
                                         lambda: gemm_relu_gemm(0), lambda: gemm_relu_gemm(1)],
                         ids=["conv_relu_conv", "conv_dw_conv", "grouped", "gemm_transB0", "gemm_transB1"])
def test_float_outputs_unchanged_and_ranges_equalized(build_model):
    model = build_model()
    before = pair_ranges(load_model(model)[0])
    after_model, notes = apply(model, {"steps": 200})
    assert_same_outputs(model, after_model, feeds(model))
    assert "equalized" in notes[-1]
    after = pair_ranges(after_model)
    assert len(after) == len(before) >= 1
    for (r1, r2), (b1, b2) in zip(after, before):
        np.testing.assert_allclose(r1, r2, rtol=1e-3)
        # the product of the two ranges is what equalization preserves (single pairs)
        if len(after) == 1:
            np.testing.assert_allclose(r1 * r2, b1 * b2, rtol=1e-4)
    spread = [float(np.ptp(np.log(r1))) for r1, _ in after]
    assert max(spread) < max(float(np.ptp(np.log(b1))) for b1, _ in before)


def test_one_sweep_equalizes_a_single_pair_exactly():
    after_model, _ = apply(conv_relu_conv(), {"steps": 1})
    [(r1, r2)] = pair_ranges(after_model)
    np.testing.assert_allclose(r1, r2, rtol=1e-5)


def test_clip_pairs_skipped_without_data():
    model = conv_relu_conv(act="Clip")
    after_model, notes = apply(model)
    assert "skipped (no calibration data)" in notes[-1]
    assert_same_outputs(model, after_model, feeds(model), rtol=0.0)


def test_clip_pairs_keep_the_clip_exact_on_the_data():
    model = conv_relu_conv(act="Clip")
    data = feeds(model, 16, seed=3)
    data = {k: v * 4.0 for k, v in data.items()}  # make some channels reach 6
    after_model, notes = apply(model, data=data)
    assert "kept unscaled" in notes[-1]
    assert sum(n.op_type == "Clip" for n in after_model.graph) == 1
    assert_same_outputs(model, after_model, data)


def test_clip_pairs_on_empty_data_are_the_one_line_error(tmp_path):
    """Clip bounds read from data that holds no sample raised a KeyError (per-tensor
    AdaQuant brings CLE first)."""
    model = conv_relu_conv(act="Clip")
    empty = {k: v[:0] for k, v in feeds(model).items()}
    config = {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}, "pre_quant_opt_config": [{"name": "cle"}]}
    with pytest.raises(CalibrationDataError, match="calibration data is empty"):
        onnxq.quantize(model, tmp_path / "q.onnx", config, empty, progress=False)
    assert not (tmp_path / "q.onnx").exists()


def test_relu6_to_relu_replaces_the_clip():
    after_model, notes = apply(conv_relu_conv(act="Clip"), {"relu6_to_relu": True})
    assert "replaced by Relu" in notes[-1]
    assert [n.op_type for n in after_model.graph] == ["Conv", "Relu", "Conv"]


def test_high_bias_absorption_preserves_outputs_on_the_data():
    rng = np.random.default_rng(5)
    inits = {"c1_w": uneven(rng, (16, 4, 3, 3)), "c1_b": rng.uniform(1.0, 3.0, 16).astype(np.float32),
             "c2_w": uneven(rng, (8, 16, 1, 1), axis=1), "c2_b": rng.normal(0, 0.1, 8).astype(np.float32)}
    model = build([conv("c1", "x", "h"), helper.make_node("Relu", ["h"], ["a"]), conv("c2", "a", "y", pad=0)],
                  inits, ["N", 4, 8, 8])
    data = {"x": (rng.standard_normal((16, 4, 8, 8)) * 0.1).astype(np.float32)}
    plain, _ = apply(model)
    absorbed, notes = apply(model, {"scale_append_bias": True}, data)
    assert "high-bias channels absorbed in 1 pairs" in notes[-1] and "; 0 high-bias" not in notes[-1]
    first = lambda m: constant_array(next(n for n in m.graph if n.op_type == "Conv").inputs[2])  # noqa: E731
    assert np.all(first(absorbed) <= first(plain)) and np.any(first(absorbed) < first(plain))
    assert_same_outputs(model, absorbed, data)


def test_absorption_needs_data_and_an_unpadded_second_layer():
    model = conv_relu_conv()
    _, notes = apply(model, {"scale_append_bias": True})
    assert "absorption skipped" in notes[-1]
    _, notes = apply(model, {"scale_append_bias": True}, feeds(model))
    assert "no pair qualifies for high-bias absorption" in notes[-1]


def test_skip_layers_and_options():
    _, notes = apply(conv_relu_conv(), {"skip_layers": ["c2"]})
    assert "no Conv/Gemm pairs" in notes[-1]
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        apply(conv_relu_conv(), {"step": 3})
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        apply(conv_relu_conv(), {"steps": 0})
    with pytest.raises(ConfigError, match="must be bool"):
        apply(conv_relu_conv(), {"relu6_to_relu": "yes"})


def test_shared_output_is_not_paired():
    model = conv_relu_conv()
    model.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 16, 10, 10]))
    _, notes = apply(model)
    assert "no Conv/Gemm pairs" in notes[-1]


# -- real architectures with random weights --------------------------------------------


def randomized_light_model(name: str, tmp_path: Path, seed: int = 0) -> Path:
    """A model of onnx's `light` test set with seeded weights of uneven channel ranges.

    The final Softmax is dropped so that outputs compare as logits.
    """
    model, _ = load_model(LIGHT / f"light_{name}.onnx")
    last = model.graph.node(-1)
    if last.op_type == "Softmax":
        model.graph.outputs[0] = last.inputs[0]
        model.graph.remove(last, safe=True)
    rng = np.random.default_rng(seed)
    for value in model.graph.initializers.values():
        array = constant_array(value)
        if array is None or array.dtype != np.float32 or array.ndim < 1:
            continue
        if array.ndim == 1:  # biases and BatchNorm parameters (var must stay positive)
            new = rng.uniform(0.5, 1.5, array.shape) * (0.1 if "bias" in value.name or "_b" in value.name else 1.0)
        else:
            new = uneven(rng, array.shape)
        value.const_value = ir.tensor(new.astype(np.float32), name=value.name)
    path = tmp_path / f"{name}.onnx"
    ir.save(model, path)
    return path


@pytest.mark.parametrize("name,pairs", [("squeezenet", 1), ("shufflenet", 16), ("inception_v1", 19),
                                        ("resnet50", 32)])
def test_light_models_keep_their_outputs(name, pairs, tmp_path):
    path = randomized_light_model(name, tmp_path)
    model = onnx.load(path)
    after, notes = apply(model)
    assert notes[-1].startswith(f"cle: {pairs} layer pair{'' if pairs == 1 else 's'} equalized"), notes
    feed = feeds(model, n=2)
    ref = run(model, feed)
    got = run(ir.to_proto(after), feed)
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4 * float(np.abs(ref).max()))
