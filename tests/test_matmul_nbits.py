"""Weight-only block quantization into com.microsoft::MatMulNBits (onnxq.emit.matmul_nbits).

The reference dequantization here is written independently of the emitter: it unpacks
the model's B / scales / zero_points initializers following onnxruntime's documented
layout, so a packing or layout mistake in the emitter makes the numerics tests fail.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder, session, sqnr_db
from helpers import run as run_feeds
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import QuantizationSpec
from onnxq.emit.matmul_nbits import can_use_matmul_nbits, emit_matmul_nbits
from onnxq.graph.load import load_model
from onnxq.notes import Topic
from onnxq.numerics.blocks import pack_bits, unpack_bits

MS = "com.microsoft"
# SQNR of the output vs float on Gaussian weights, measured over 6 seeds x 3 shapes x
# int4/uint4: symmetric 19.7/19.1/18.2 dB and asymmetric 21.4/20.3/18.9 dB at the worst for
# groups 32/64/128; the floors sit ~0.6 dB below.
SQNR_FLOOR = {  # (symmetric, group_size) -> dB
    (True, 32): 19.0, (True, 64): 18.5, (True, 128): 17.5,
    (False, 32): 20.5, (False, 64): 19.5, (False, 128): 18.3,
}


def nbits_spec(dtype: str = "int4", group_size: int = 32, symmetric: bool = True) -> ResolvedSpec:
    spec = merge_specs(
        [QuantizationSpec(dtype=dtype, qscheme="per_group", group_size=group_size, symmetric=symmetric)],
        "weight",
    )
    assert spec is not None
    return spec


def matmul_model(k: int, n: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, k])
    w = b.rng.standard_normal((k, n)).astype(np.float32)
    return b.build([b.node("MatMul", [x, b.const("w", w)])], name="nbits"), w


def emit(proto: onnx.ModelProto, spec: ResolvedSpec, **kwargs) -> tuple[onnx.ModelProto, dict]:
    model, _ = load_model(proto)
    skipped = emit_matmul_nbits(model, {n.name: spec for n in model.graph if n.op_type == "MatMul"}, **kwargs)
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    return out, skipped


def nbits_node(proto: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert node.domain == MS
    return node


def reference_weight(proto: onnx.ModelProto) -> np.ndarray:
    """W [K, N] dequantized from the MatMulNBits initializers, per onnxruntime's contrib-op doc."""
    node = nbits_node(proto)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    packed, scales = inits[node.input[1]], inits[node.input[2]].astype(np.float64)
    k_blocks = -(-k // block)
    assert packed.dtype == np.uint8 and packed.shape == (n, k_blocks, block * bits // 8)
    assert scales.shape == (n, k_blocks)

    def unpack(data: np.ndarray, count: int) -> np.ndarray:
        if bits == 8:
            return data[..., :count].astype(np.float64)
        low, high = data & 0x0F, data >> 4  # element 2i in the low nibble of byte i
        return np.stack([low, high], axis=-1).reshape(*data.shape[:-1], -1)[..., :count].astype(np.float64)

    q = unpack(packed, block)  # [N, k_blocks, block]
    if len(node.input) > 3 and node.input[3]:
        zp = unpack(inits[node.input[3]], k_blocks)
    else:
        zp = np.full((n, k_blocks), 2.0 ** (bits - 1))  # documented default
    w = (q - zp[..., None]) * scales[..., None]
    return w.reshape(n, -1)[:, :k].T


def run(proto: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    return session(proto).run(None, {"x": a})[0]


def inputs(k: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 3, k)).astype(np.float32)


# -- numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int4", "uint4"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_output_equals_a_times_dequantized_weight(dtype, symmetric, group_size):
    proto, w = matmul_model(256, 48, seed=group_size)
    quant, skipped = emit(proto, nbits_spec(dtype, group_size, symmetric))
    assert not skipped
    a = inputs(256)
    out = run(quant, a)
    expected = a.astype(np.float64) @ reference_weight(quant)
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()  # measured <= 2e-6
    floor = SQNR_FLOOR[(symmetric, group_size)]
    assert sqnr_db(a @ w, out) >= floor
    assert sqnr_db(w, reference_weight(quant)) >= floor


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sqnr_floor_on_gaussian_weights(seed):
    proto, w = matmul_model(512, 128, seed=seed)
    a = inputs(512, seed)
    for (symmetric, group_size), floor in SQNR_FLOOR.items():
        quant, _ = emit(proto, nbits_spec("int4", group_size, symmetric))
        assert sqnr_db(a @ w, run(quant, a)) >= floor, (symmetric, group_size)


def test_smaller_blocks_are_more_accurate():
    proto, w = matmul_model(512, 64, seed=3)
    errors = [sqnr_db(w, reference_weight(emit(proto, nbits_spec(group_size=g))[0])) for g in (16, 32, 64, 128, 256)]
    assert errors == sorted(errors, reverse=True), errors


def test_symmetric_omits_zero_points_and_asymmetric_packs_them():
    proto, _ = matmul_model(160, 24)
    symmetric, _ = emit(proto, nbits_spec("int4", 32, True))
    assert len(nbits_node(symmetric).input) == 3
    asymmetric, _ = emit(proto, nbits_spec("uint4", 32, False))
    node = nbits_node(asymmetric)
    zp = {i.name: numpy_helper.to_array(i) for i in asymmetric.graph.initializer}[node.input[3]]
    assert zp.dtype == np.uint8 and zp.shape == (24, 3)  # 5 blocks, two 4-bit zero points a byte


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_weight_storage_is_small(group_size):
    proto, w = matmul_model(1024, 256, seed=4)
    for symmetric in (True, False):
        quant, _ = emit(proto, nbits_spec("int4", group_size, symmetric))
        stored = sum(numpy_helper.to_array(i).nbytes for i in quant.graph.initializer)
        assert stored <= 0.30 * w.nbytes, stored / w.nbytes  # measured 0.13-0.16
        assert not any(i.data_type == TensorProto.FLOAT and i.dims == [1024, 256] for i in quant.graph.initializer)


@pytest.mark.parametrize("k", [100, 8, 33])
def test_k_not_multiple_of_block_size(k):
    proto, w = matmul_model(k, 20, seed=k)
    quant, skipped = emit(proto, nbits_spec("int4", 32, False))
    assert not skipped
    node = nbits_node(quant)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["K"], attrs["N"], attrs["block_size"], attrs["bits"]) == (k, 20, 32, 4)
    a = inputs(k)
    out = run(quant, a)
    expected = a.astype(np.float64) @ reference_weight(quant)
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()
    assert sqnr_db(a @ w, out) >= 19.0


@pytest.mark.parametrize("dtype, symmetric", [("int8", True), ("uint8", False)])
def test_eight_bits(dtype, symmetric):
    proto, w = matmul_model(96, 16, seed=5)
    quant, _ = emit(proto, nbits_spec(dtype, 32, symmetric))
    assert {a.name: helper.get_attribute_value(a) for a in nbits_node(quant).attribute}["bits"] == 8
    a = inputs(96)
    out = run(quant, a)
    expected = a.astype(np.float64) @ reference_weight(quant)
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()
    assert sqnr_db(a @ w, out) >= 40.0  # measured 44-47 dB


def test_float16_model_gets_float16_scales():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((128, 32)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 32])],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    quant, _ = emit(proto, nbits_spec("int4", 32, False))
    scales = {i.name: i for i in quant.graph.initializer}[nbits_node(quant).input[2]]
    assert scales.data_type == TensorProto.FLOAT16
    a = rng.standard_normal((5, 128)).astype(np.float16)
    out = session(quant).run(None, {"x": a})[0]
    assert sqnr_db(a.astype(np.float32) @ w.astype(np.float32), out) >= 19.0


# -- graph -----------------------------------------------------------------------------------


def test_output_name_and_accuracy_level_kept():
    proto, _ = matmul_model(64, 16)
    quant, _ = emit(proto, nbits_spec(), accuracy_level=4)
    assert [o.name for o in quant.graph.output] == [o.name for o in proto.graph.output]
    assert nbits_node(quant).output[0] == proto.graph.output[0].name
    attrs = {a.name: helper.get_attribute_value(a) for a in nbits_node(quant).attribute}
    assert attrs["accuracy_level"] == 4
    assert any(o.domain == MS for o in quant.opset_import)
    with pytest.raises(ValueError):
        emit(proto, nbits_spec(), accuracy_level=7)


def test_pack_low_nibble_first():
    assert pack_bits(np.array([1, 2, 15, 0]), 4).tolist() == [0x21, 0x0F]
    values = np.random.default_rng(0).integers(0, 16, (3, 5, 33))
    assert np.array_equal(unpack_bits(pack_bits(values, 4), 4, 33), values)


def test_skips_with_reasons():
    b = GraphBuilder(7)
    x = b.input("x", ["N", 64])
    dynamic = b.node("MatMul", [x, b.input("y", [64, 8])])
    rank3 = b.node("MatMul", [b.input("x3", [2, 4, 64]), b.const("w3", b.he((2, 64, 8), 64))])
    gemm = b.gemm(x, 64, 8)
    plain = b.matmul(x, 64, 8)
    proto = b.build([dynamic, rank3, gemm, plain])
    model, _ = load_model(proto)
    names = [n.name for n in model.graph]
    nodes = dict.fromkeys(names, nbits_spec())
    nodes[names[3]] = nbits_spec(group_size=24)
    nodes["missing"] = nbits_spec()
    skipped = emit_matmul_nbits(model, nodes)
    assert set(skipped) == {*names, "missing"}
    assert "not a constant" in skipped[names[0]]
    assert "rank 3" in skipped[names[1]]
    assert "not a MatMul" in skipped[names[2]]
    assert "group_size 24" in skipped[names[3]]
    assert [n.op_type for n in model.graph] == ["MatMul", "MatMul", "Gemm", "MatMul"]
    assert MS not in model.opset_imports


def test_can_use_matmul_nbits_dtypes():
    model, _ = load_model(matmul_model(64, 8)[0])
    node = next(iter(model.graph))
    assert can_use_matmul_nbits(node, nbits_spec()) is None
    assert "int16" in can_use_matmul_nbits(node, nbits_spec("int16"))
    assert can_use_matmul_nbits(node, nbits_spec(group_size=None)) is not None


def test_w8_group128_writes_8_bit_matmulnbits():
    """Weight-only int8 blocks: MatMulNBits with bits=8 in a default session, close to float."""
    from test_load_runtime import EVAL, decoder_block

    model = decoder_block("LayerNormalization")
    result = onnxq.quantize(model, None, "W8_GROUP128", progress=False)
    nodes = [n for n in result.model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 2 and all(helper.get_node_attr_value(n, "bits") == 8 for n in nodes)
    onnx.checker.check_model(result.model, full_check=True)
    assert sqnr_db(run_feeds(model, EVAL), run_feeds(result.model, EVAL)) > 35
    # Under half of float even here, where K = 64 pads each column to one block of 128.
    assert result.summary.size_after < 0.55 * result.summary.size_before


def test_a_matmul_that_cannot_have_matmulnbits_is_a_warning_not_silence():
    """`matmul_nbits` asked for where MatMulNBits cannot be had (a block size that is not a
    power of two >= 16; quantized inputs; no MatMul at all) still gives a valid model, and
    the summary says what was not lowered, why, and that the accuracy level went unused."""
    proto, _ = matmul_model(96, 32)
    a = inputs(96)
    odd = onnxq.quantize(proto, None, {"preset": "W4_GROUP128", "layer_type_quant_config": {
        "MatMul": {"weight": {"group_size": 48}}}}, None, progress=False)
    onnx.checker.check_model(odd.model)
    assert not any(n.op_type == "MatMulNBits" for n in odd.model.graph.node)
    assert sqnr_db(run(proto, a), run(odd.model, a)) > 15
    said = [n for n in odd.summary.note_texts if "matmul_nbits:" in n]
    assert len(said) == 1 and "1 MatMul not lowered to MatMulNBits" in said[0], said
    assert "group_size 48 is not a power of two >= 16" in said[0] and "accuracy_level 4 is unused" in said[0]
    static = onnxq.quantize(proto, None, {"preset": "U8S8", "matmul_nbits": True}, {"x": a}, progress=False)
    said = [n for n in static.summary.notes if "matmul_nbits:" in n.text]
    assert len(said) == 1 and said[0].topic is Topic.EMISSION and "integer MatMul" in said[0].text, said
    int16 = onnxq.quantize(proto, None, {"preset": "A16W8", "matmul_nbits": True}, {"x": a}, progress=False)
    assert any(n.startswith("warning: matmul_nbits") and "its input is quantized too" in n
               for n in int16.summary.note_texts)
    fine = onnxq.quantize(proto, None, "W4_GROUP128", None, progress=False)
    assert not any("matmul_nbits:" in n for n in fine.summary.note_texts)

