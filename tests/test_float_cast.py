"""Float16 / bfloat16 conversion (`onnxq.emit.float_cast`).

Every converted model must pass the full ONNX checker, load and run in onnxruntime CPU,
keep its graph input/output types, store converted weights in the target type and track
the float32 model within an SQNR floor. Floors from measurements on these seeded models:

* onnxruntime 1.31 CPU (few float16/bfloat16 kernels, so mostly weights stored in the
  target type and float32 compute): float16 64.7-75.1 dB, bfloat16 45.7-58.3 dB;
  floors 60 and 40 dB.
* the ONNX reference evaluator on the fully converted graph (every eligible op really
  computes in the target type, `providers=()`): float16 61.1-67.8 dB, bfloat16
  42.5-50.3 dB; floors 55 and 36 dB.

Storing float16 weights through bfloat16 (a double rounding) costs ~18 dB, a wrong
target type ~20 dB: both fall below the floors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxq.config.spec import DType
from onnxq.emit.float_cast import DEFAULT_KEEP_FLOAT32, FloatCastReport, convert_float_nodes, probe
from onnxq.emit.float_cast.probe import KernelProbe
from onnxq.graph.load import load_model

DIGITS = Path(__file__).resolve().parents[1] / "models" / "digits_cnn.onnx"
FLOOR_DB = {DType.FLOAT16: 60.0, DType.BFLOAT16: 40.0}
REFERENCE_FLOOR_DB = {DType.FLOAT16: 55.0, DType.BFLOAT16: 36.0}
ONNX_TYPE = {DType.FLOAT16: TensorProto.FLOAT16, DType.BFLOAT16: TensorProto.BFLOAT16}
F = TensorProto.FLOAT


# -- model builders ------------------------------------------------------------------------


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], fan_in: int) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32), name)


def _bias(rng: np.random.Generator, name: str, size: int) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(size) * 0.1).astype(np.float32), name)


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv-Relu-Conv-Relu-Flatten-Gemm on [N,3,8,8]."""
    rng = np.random.default_rng(seed)
    inits = [
        _weight(rng, "w1", (8, 3, 3, 3), 27), _bias(rng, "b1", 8),
        _weight(rng, "w2", (8, 8, 3, 3), 72), _bias(rng, "b2", 8),
        _weight(rng, "fc_w", (10, 512), 512), _bias(rng, "fc_b", 10),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Flatten", ["r2"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 3, 8, 8])],
                  [helper.make_tensor_value_info("y", F, ["N", 10])], inits)


def transformer(seed: int = 1, d: int = 32, ff: int = 64) -> onnx.ModelProto:
    """Pre-LN single-head attention block + GELU (Erf) MLP on [N,8,d]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.ones(d, np.float32), "ln1_g"), numpy_helper.from_array(np.zeros(d, np.float32), "ln1_b"),
        numpy_helper.from_array(np.ones(d, np.float32), "ln2_g"), numpy_helper.from_array(np.zeros(d, np.float32), "ln2_b"),
        numpy_helper.from_array(np.float32(1.0 / np.sqrt(d)), "scale"),
        numpy_helper.from_array(np.float32(1.0 / np.sqrt(2.0)), "inv_sqrt2"),
        numpy_helper.from_array(np.float32(0.5), "half"), numpy_helper.from_array(np.float32(1.0), "one"),
    ]
    for name in ("wq", "wk", "wv", "wo"):
        inits += [_weight(rng, name, (d, d), d), _bias(rng, f"{name}_b", d)]
    inits += [_weight(rng, "w1", (d, ff), d), _bias(rng, "w1_b", ff), _weight(rng, "w2", (ff, d), ff), _bias(rng, "w2_b", d)]
    n = helper.make_node
    nodes = [n("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["h"], name="ln1", axis=-1)]
    for p in ("q", "k", "v"):
        nodes += [n("MatMul", ["h", f"w{p}"], [f"{p}0"], name=f"mm_{p}"), n("Add", [f"{p}0", f"w{p}_b"], [p], name=f"add_{p}")]
    nodes += [
        n("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s0"], name="mm_qk"),
        n("Mul", ["s0", "scale"], ["s"], name="scale_mul"),
        n("Softmax", ["s"], ["a"], name="softmax", axis=-1),
        n("MatMul", ["a", "v"], ["ctx"], name="mm_av"),
        n("MatMul", ["ctx", "wo"], ["o0"], name="mm_o"), n("Add", ["o0", "wo_b"], ["o"], name="add_o"),
        n("Add", ["x", "o"], ["res1"], name="residual1"),
        n("LayerNormalization", ["res1", "ln2_g", "ln2_b"], ["h2"], name="ln2", axis=-1),
        n("MatMul", ["h2", "w1"], ["f0"], name="mm_ff1"), n("Add", ["f0", "w1_b"], ["f1"], name="add_ff1"),
        n("Mul", ["f1", "inv_sqrt2"], ["g0"], name="gelu_div"), n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add"), n("Mul", ["f1", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", "half"], ["g4"], name="gelu_half"),
        n("MatMul", ["g4", "w2"], ["f2"], name="mm_ff2"), n("Add", ["f2", "w2_b"], ["f3"], name="add_ff2"),
        n("Add", ["res1", "f3"], ["y"], name="residual2"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 8, d])],
                  [helper.make_tensor_value_info("y", F, ["N", 8, d])], inits)


def resize_clip(seed: int = 2) -> onnx.ModelProto:
    """Resize (float32 scales) -> Clip (initializer min/max) -> Concat -> Reshape -> MatMul,
    with ConstantOfShape and a Cast(int64 -> float) on the side."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        numpy_helper.from_array(np.float32(0.0), "clip_lo"), numpy_helper.from_array(np.float32(1.5), "clip_hi"),
        numpy_helper.from_array(rng.standard_normal((1, 4, 8, 8)).astype(np.float32), "bias_map"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape"),
        _weight(rng, "head_w", (512, 6), 512),
    ]
    n = helper.make_node
    nodes = [
        n("Resize", ["x", "roi", "scales"], ["up"], name="resize", mode="linear"),
        n("Clip", ["up", "clip_lo", "clip_hi"], ["clipped"], name="clip"),
        n("Shape", ["up"], ["up_shape"], name="shape"),
        n("ConstantOfShape", ["up_shape"], ["ones"], name="ones", value=numpy_helper.from_array(np.array([0.25], np.float32))),
        n("Add", ["up", "ones"], ["shifted"], name="shift"),
        n("Add", ["shifted", "bias_map"], ["biased"], name="add_bias"),
        n("Concat", ["clipped", "biased"], ["cat"], name="concat", axis=1),
        n("Reshape", ["cat", "flat_shape"], ["flat"], name="reshape"),
        n("MatMul", ["flat", "head_w"], ["logits"], name="head"),
        n("Size", ["x"], ["count"], name="size"),
        n("Cast", ["count"], ["count_f"], name="count_cast", to=F),
        n("Div", ["logits", "count_f"], ["y"], name="normalise"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 4, 4, 4])],
                  [helper.make_tensor_value_info("y", F, ["N", 6])], inits)


def digits() -> onnx.ModelProto:
    return onnx.load(str(DIGITS))


BUILDERS = {"cnn": cnn, "transformer": transformer, "resize_clip": resize_clip, "digits": digits}
INPUT_SHAPES = {"cnn": (4, 3, 8, 8), "transformer": (4, 8, 32), "resize_clip": (4, 4, 4, 4), "digits": (16, 1, 8, 8)}
# A subset per model: nodes assigned the float target when not converting the whole model.
SUBSETS = {
    "cnn": ["conv2", "relu2", "flatten", "fc"],
    "transformer": ["mm_ff1", "add_ff1", "gelu_div", "gelu_erf", "gelu_add", "gelu_mul", "gelu_half", "mm_ff2"],
    "resize_clip": ["resize", "clip", "concat", "reshape", "head"],
    "digits": ["conv3", "relu3", "global_avg_pool", "flatten", "fc"],
}


# -- helpers -------------------------------------------------------------------------------


def _feeds(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal(INPUT_SHAPES[name]).astype(np.float32)
    return {"input" if name == "digits" else "x": np.abs(x) if name == "digits" else x}


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _sqnr(ref: np.ndarray, test: np.ndarray) -> float:
    ref, test = ref.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-300)))


def _convert(name: str, dtype: DType, subset: bool = False, **kwargs) -> tuple[ir.Model, FloatCastReport]:
    model, _ = load_model(BUILDERS[name]())
    names = SUBSETS[name] if subset else [node.name for node in model.graph]
    return model, convert_float_nodes(model, dict.fromkeys(names, dtype), **kwargs)


def _checked(model: ir.Model) -> onnx.ModelProto:
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _io_types(proto: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in [*proto.graph.input, *proto.graph.output]]


def _weight_bytes(proto: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer)


def _cast_pairs(proto: onnx.ModelProto) -> list[tuple[str, str]]:
    """Cast -> Cast chains between float types (what the converter must never leave)."""
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    producers = {out: node for node in proto.graph.node for out in node.output}
    cast_to = {node.name: helper.get_attribute_value(node.attribute[0]) for node in proto.graph.node if node.op_type == "Cast"}
    pairs = []
    for node in proto.graph.node:
        first = producers.get(node.input[0]) if node.op_type == "Cast" else None
        if first is not None and first.op_type == "Cast" and {cast_to[first.name], cast_to[node.name]} <= floats:
            pairs.append((first.name, node.name))
    return pairs


def _types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor: inputs, initializers, value_info, outputs."""
    out = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]}
    out.update({t.name: t.data_type for t in proto.graph.initializer})
    return out


def _node(proto: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(node for node in proto.graph.node if node.name == name)


def _check_result(name: str, dtype: DType, model: ir.Model, report: FloatCastReport, before: onnx.ModelProto,
                  keep: tuple[str, ...] = DEFAULT_KEEP_FLOAT32) -> float:
    """The checks every conversion must pass; returns the SQNR against float32."""
    proto = _checked(model)
    assert _io_types(proto) == _io_types(before)
    assert _cast_pairs(proto) == []
    feeds = _feeds(name)
    sqnr = _sqnr(_run(before, feeds), _run(proto, feeds))
    assert sqnr >= FLOOR_DB[dtype], (name, dtype, sqnr)
    types = _types(proto)
    for weight, stored in report.initializers.items():
        assert stored == dtype.value and types[weight] == ONNX_TYPE[dtype], weight
    for node in proto.graph.node:
        if node.op_type in keep:
            assert all(types.get(i, F) == F for i in node.input if i), node.name
            assert node.name not in report.converted
    for node_name in report.converted:
        node = _node(proto, node_name)
        floats = [types[o] for o in node.output if types.get(o) in (F, ONNX_TYPE[dtype])]
        floats = floats or [types[i] for i in node.input if types.get(i) in (F, ONNX_TYPE[dtype])]  # Shape
        assert floats and all(t == ONNX_TYPE[dtype] for t in floats), node_name
    return sqnr


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16], ids=str)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_whole_model(name: str, dtype: DType) -> None:
    before = ir.to_proto(load_model(BUILDERS[name]())[0])
    model, report = _convert(name, dtype)
    _check_result(name, dtype, model, report, before)
    # Every weight not read by a numerically sensitive op is stored in the target type.
    assert _weight_bytes(ir.to_proto(model)) <= 0.55 * _weight_bytes(before)
    assert len(report.converted) + len(report.kept_float32) + len(report.no_float) == len(before.graph.node)
    for node_name, reason in report.kept_float32.items():
        op = _node(before, node_name).op_type
        assert (reason == "numerically sensitive") == (op in DEFAULT_KEEP_FLOAT32), (node_name, reason)
    assert report.summary_line().startswith("float cast:")


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16], ids=str)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_subset(name: str, dtype: DType) -> None:
    before = ir.to_proto(load_model(BUILDERS[name]())[0])
    model, report = _convert(name, dtype, subset=True)
    _check_result(name, dtype, model, report, before)
    assert set(report.converted) | set(report.kept_float32) | set(report.no_float) == set(SUBSETS[name])
    after = _types(ir.to_proto(model))
    outside = {n.name for n in before.graph.node} - set(SUBSETS[name])
    for node in before.graph.node:
        if node.name in outside:  # untouched nodes keep the types of what they compute
            assert [after[o] for o in node.output] == [_types(before)[o] for o in node.output], node.name


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16], ids=str)
def test_digits_cnn_accuracy_and_storage(dtype: DType) -> None:
    data = np.load(DIGITS.parent / "digits_eval.npz")
    before = ir.to_proto(load_model(digits())[0])
    model, report = _convert("digits", dtype)
    proto = _checked(model)
    ref, out = _run(before, {"input": data["input"]}), _run(proto, {"input": data["input"]})
    assert _sqnr(ref, out) >= FLOOR_DB[dtype]
    assert (out.argmax(1) == data["labels"]).mean() >= (ref.argmax(1) == data["labels"]).mean() - 0.004
    # No Conv/Gemm kernel for either type on CPU: weights stored in the target, compute in float32.
    for conv in ("conv1", "conv2", "conv3", "fc"):
        assert report.storage_only[conv] == dtype.value
        assert f"weights stored as {dtype.value}, compute in float32" in report.kept_float32[conv]
    assert report.bytes_saved == pytest.approx(_weight_bytes(before) / 2, rel=0.01)  # fc.bias (10) stays


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16], ids=str)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_fully_converted_graph_computes_in_low_precision(name: str, dtype: DType) -> None:
    """providers=() converts every eligible op; the reference evaluator runs it in fp16/bf16."""
    before = ir.to_proto(load_model(BUILDERS[name]())[0])
    model, report = _convert(name, dtype, providers=())
    proto = _checked(model)
    assert _io_types(proto) == _io_types(before) and _cast_pairs(proto) == []
    for node_name, reason in report.kept_float32.items():  # bfloat16 Conv/pools: not in the ONNX schema
        op = _node(before, node_name).op_type
        schema = dtype is DType.BFLOAT16 and "does not accept" in reason
        assert op in DEFAULT_KEEP_FLOAT32 or schema or reason.endswith("only add Casts)"), (node_name, reason)
    feeds = _feeds(name)
    out = ReferenceEvaluator(proto).run(None, feeds)[0].astype(np.float32)
    assert _sqnr(_run(before, feeds), out) >= REFERENCE_FLOOR_DB[dtype]


def test_runtime_upcast_gives_a_real_float16_graph() -> None:
    """accept_runtime_upcast keeps every eligible node in float16 (for GPU deployment)."""
    before = ir.to_proto(load_model(transformer())[0])
    model, report = _convert("transformer", DType.FLOAT16, accept_runtime_upcast=True)
    sqnr = _check_result("transformer", DType.FLOAT16, model, report, before)
    assert sqnr < 90  # activations really are float16 now
    sensitive = {n.name for n in before.graph.node if n.op_type in DEFAULT_KEEP_FLOAT32}
    assert set(report.kept_float32) == sensitive
    proto = ir.to_proto(model)
    # Casts only at the boundaries: graph input, around ln1/ln2/softmax, graph output.
    assert 4 <= sum(n.op_type == "Cast" for n in proto.graph.node) == report.casts_inserted <= 8
    assert _types(proto)["y"] == F and _node(proto, "residual2").output[0] != "y"


def test_keep_list_is_overridable_layernorm_runs_natively() -> None:
    """LayerNormalization has float16 and bfloat16 CPU kernels; it converts once not kept."""
    for dtype in (DType.FLOAT16, DType.BFLOAT16):
        before = ir.to_proto(load_model(transformer())[0])
        model, report = _convert("transformer", dtype, keep_float32_ops=())
        _check_result("transformer", dtype, model, report, before, keep=())
        assert {"ln1", "ln2"} <= set(report.converted)
        proto = ir.to_proto(model)
        types = _types(proto)
        assert types["ln1_g"] == ONNX_TYPE[dtype] and types[_node(proto, "ln1").output[0]] == ONNX_TYPE[dtype]


def test_clip_bounds_follow_input_and_resize_scales_stay_float32() -> None:
    before = ir.to_proto(load_model(resize_clip())[0])
    model, report = _convert("resize_clip", DType.FLOAT16, accept_runtime_upcast=True)
    _check_result("resize_clip", DType.FLOAT16, model, report, before)
    proto = ir.to_proto(model)
    types = _types(proto)
    clip, resize = _node(proto, "clip"), _node(proto, "resize")
    assert {"clip", "resize", "ones", "count_cast"} <= set(report.converted)
    assert [types[i] for i in clip.input] == [TensorProto.FLOAT16] * 3
    assert types[resize.input[0]] == TensorProto.FLOAT16 and types["scales"] == F and types["roi"] == F
    assert types[_node(proto, "ones").output[0]] == TensorProto.FLOAT16
    assert helper.get_attribute_value(_node(proto, "count_cast").attribute[0]) == TensorProto.FLOAT16
    assert types["flat_shape"] == TensorProto.INT64 and types["up_shape"] == TensorProto.INT64


def test_lone_clip_between_float32_nodes_stays_float32() -> None:
    """Clip has a CPU float16 kernel, but alone between float32 nodes it would only add
    two Casts: like data movement, it stays float32 unless its group does real work."""
    model, report = _convert("resize_clip", DType.FLOAT16)
    assert "clip" not in report.converted
    assert "Casts" in report.kept_float32["clip"]
    _checked(model)


def test_data_movement_between_float32_nodes_stays_float32() -> None:
    model, report = _convert("cnn", DType.FLOAT16)
    assert "Casts" in report.kept_float32["flatten"]
    assert "flatten" not in report.converted


# -- boundaries, sharing, casts ------------------------------------------------------------


def _shared_weight_model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "w"], ["a"], name="mm_a"),
        n("MatMul", ["x", "w"], ["b"], name="mm_b"),
        n("Add", ["a", "b"], ["y"], name="sum"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", 16])],
                  [helper.make_tensor_value_info("y", F, ["N", 16])], [_weight(rng, "w", (16, 16), 16)])


def test_weight_shared_with_a_float32_node_is_cast_at_run_time() -> None:
    model, _ = load_model(_shared_weight_model())
    report = convert_float_nodes(model, {"mm_a": DType.FLOAT16}, accept_runtime_upcast=True)
    proto = _checked(model)
    assert report.converted == ["mm_a"] and report.initializers == {}
    types = _types(proto)
    assert types["w"] == F  # stays float32 once (no duplicate), cast for mm_a
    assert types[_node(proto, "mm_a").input[1]] == TensorProto.FLOAT16
    assert _node(proto, "mm_b").input[1] == "w"


def test_weight_shared_by_converted_nodes_is_stored_once() -> None:
    model, _ = load_model(_shared_weight_model())
    report = convert_float_nodes(model, dict.fromkeys(["mm_a", "mm_b"], DType.BFLOAT16))
    proto = _checked(model)
    assert report.initializers == {"w": "bfloat16"} and len(proto.graph.initializer) == 1
    # No bfloat16 MatMul on CPU: one Cast back to float32 serves both MatMuls.
    assert sum(n.op_type == "Cast" for n in proto.graph.node) == 1


def test_existing_cast_round_trip_is_folded() -> None:
    """x(f16) -> Cast(f32) -> MatMul converted to f16: the MatMul reads x directly."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Cast", ["x"], ["x32"], name="to_f32", to=F),
        helper.make_node("MatMul", ["x32", "w"], ["y"], name="mm"),
    ]
    proto = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 16])],
                   [helper.make_tensor_value_info("y", F, ["N", 16])], [_weight(rng, "w", (16, 16), 16)])
    model, _ = load_model(proto)
    report = convert_float_nodes(model, {"mm": DType.FLOAT16}, accept_runtime_upcast=True)
    out = _checked(model)
    assert report.converted == ["mm"] and _cast_pairs(out) == []
    assert _node(out, "mm").input[0] == "x"
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float16)
    assert _sqnr(_run(proto, {"x": x}), _run(out, {"x": x})) >= FLOOR_DB[DType.FLOAT16]


def test_weights_outside_float16_range_stay_float32() -> None:
    proto = cnn()
    big = numpy_helper.to_array(proto.graph.initializer[4]) * 1e6  # fc_w
    proto.graph.initializer[4].CopyFrom(numpy_helper.from_array(big.astype(np.float32), "fc_w"))
    model, _ = load_model(proto)
    report = convert_float_nodes(model, {"fc": DType.FLOAT16}, accept_runtime_upcast=True)
    assert "exceeds the float16 range" in report.kept_float32["fc"] and "fc_w" not in report.initializers
    model, _ = load_model(proto)
    assert convert_float_nodes(model, {"fc": DType.BFLOAT16}).initializers["fc_w"] == "bfloat16"


def test_missing_kernels_found_by_loading_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the probe, onnxruntime's load errors move op types back one by one."""
    monkeypatch.setattr(KernelProbe, "reason", lambda self, node, target, slots: None)
    before = ir.to_proto(load_model(transformer())[0])
    model, report = _convert("transformer", DType.BFLOAT16)
    _check_result("transformer", DType.BFLOAT16, model, report, before)
    missing = {_node(before, n).op_type for n, r in report.kept_float32.items() if "no bfloat16 kernel" in r}
    assert missing == {"MatMul", "Add", "Mul", "Erf"}
    assert {"mm_q", "mm_ff2"} <= set(report.storage_only)


def test_large_models_are_checked_from_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "EXTERNAL_DATA_LIMIT", 0)
    saved = []
    real_save = ir.save
    monkeypatch.setattr(ir, "save", lambda model, path, **kw: (saved.append(str(path)), real_save(model, path, **kw)))
    before = ir.to_proto(load_model(digits())[0])
    model, report = _convert("digits", DType.FLOAT16)
    _check_result("digits", DType.FLOAT16, model, report, before)
    assert saved and all(path.endswith("check.onnx") for path in saved)  # the check went through a file


def test_without_providers_every_eligible_node_is_converted() -> None:
    """providers=() skips onnxruntime: a pure ONNX conversion (valid, not necessarily runnable)."""
    model, report = _convert("transformer", DType.BFLOAT16, providers=())
    proto = _checked(model)
    sensitive = {n.name for n in proto.graph.node if n.op_type in DEFAULT_KEEP_FLOAT32}
    assert set(report.kept_float32) == sensitive
    assert _types(proto)[_node(proto, "mm_q").output[0]] == TensorProto.BFLOAT16


def test_deterministic() -> None:
    for dtype in (DType.FLOAT16, DType.BFLOAT16):
        first = ir.to_proto(_convert("transformer", dtype, accept_runtime_upcast=True)[0]).SerializeToString()
        second = ir.to_proto(_convert("transformer", dtype, accept_runtime_upcast=True)[0]).SerializeToString()
        assert first == second


def test_rejects_non_float_targets_and_ignores_unknown_nodes() -> None:
    model, _ = load_model(cnn())
    with pytest.raises(ValueError, match="not a float target"):
        convert_float_nodes(model, {"conv1": DType.INT8})
    report = convert_float_nodes(model, {"nope": DType.FLOAT16})
    assert report.converted == [] and report.notes and report.casts_inserted == 0


def test_the_summary_accounts_for_every_node_of_a_float_cast() -> None:
    """A model with integer shape arithmetic (Shape -> Gather -> Concat -> Reshape): its
    integer nodes were in neither list of the BF16 summary, so a transformer's counts did
    not add up to its nodes (format trial). The float-cast line counts them (a list of
    them all, MiniLM's 130, drowned the summary: review)."""
    import onnxq
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Shape", ["h"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="batch", axis=0),
             helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"], name="unsq"),
             helper.make_node("Concat", ["n1", "minus1"], ["shape2"], name="cat", axis=0),
             helper.make_node("Reshape", ["h", "shape2"], ["y"], name="reshape")]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = onnxq.quantize(model, None, "BF16", None, progress=False)
    listed = set(result.plan.quantized_nodes) | set(result.summary.float_nodes)
    line = next(t for t in result.summary.note_texts if t.startswith("float cast:"))
    counted = int(line.rsplit("; ", 1)[1].split()[0])
    assert "without a float32 tensor (integer shape and index arithmetic) left as they are" in line, line
    assert len(listed) + counted == len(nodes), (listed, line)
