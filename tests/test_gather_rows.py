"""An embedding Gather whose output stays float (dynamic and weight-only recipes) reads the
integer table and dequantizes only the rows it took (`emit/gather_rows.py`): a
DequantizeLinear before it dequantized the whole table on every run (all-MiniLM-L6
W8_DYNAMIC 6.4 ms at batch 1 against 3.6 after, onnxruntime's quantize_dynamic 3.4)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import GraphBuilder
from onnx import TensorProto, numpy_helper

import onnxq
from onnxq.config.compose import compose_config


def _embedding_model() -> onnx.ModelProto:
    """ids [N, 6] -> Gather(table 50 x 16) -> MatMul 16 x 8 (and the table's rows summed: a
    second Gather of the same table)."""
    b = GraphBuilder(7)
    ids = b.input("ids", ["N", 6], TensorProto.INT64)
    table = b.const("table", (np.random.default_rng(3).standard_normal((50, 16)) * 0.5).astype(np.float32))
    rows = b.node("Gather", [table, ids], axis=0)
    again = b.node("Gather", [table, ids], axis=0)
    h = b.node("Add", [rows, again])
    return b.build([b.matmul(h, 16, 8)], name="embedding")


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


@pytest.mark.parametrize("overrides", [{}, {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}},
                                       {"global_quant_config": {"weight": {"dtype": "uint8", "symmetric": False}}}])
def test_a_dynamic_recipes_gather_reads_integer_rows_with_the_same_values(tmp_path, overrides):
    model = _embedding_model()
    config = compose_config("W8_DYNAMIC", None, overrides)
    result = onnxq.quantize(model, tmp_path / "q.onnx", config, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    onnx.checker.check_model(quantized, full_check=True)
    made = _producers(quantized)
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    gathers = [n for n in quantized.graph.node if n.op_type == "Gather" and n.input[0] in inits
               and inits[n.input[0]].shape == (50, 16)]
    assert len(gathers) == 2 and all(inits[g.input[0]].dtype in (np.int8, np.uint8) for g in gathers)
    assert not any(made.get(n.input[0]) is not None and made[n.input[0]].op_type == "DequantizeLinear"
                   for n in quantized.graph.node if n.op_type == "Gather")
    assert any("Gathers of a quantized table" in n for n in result.summary.note_texts)
    # the rows as DequantizeLinear of the whole table gives them, bit for bit
    ids = np.random.default_rng(1).integers(0, 50, size=(3, 6)).astype(np.int64)
    table = inits[gathers[0].input[0]]
    scales = [v for k, v in inits.items() if k.startswith("table") and v.dtype == np.float32]
    zeros = [v for k, v in inits.items() if k.startswith("table") and v.dtype == table.dtype and v.shape != (50, 16)]
    scale = scales[0].reshape(-1, 1) if scales[0].size > 1 else scales[0]
    zero = (zeros[0].reshape(-1, 1) if zeros[0].size > 1 else zeros[0]).astype(np.int32) if zeros else 0
    dequantized = ((table.astype(np.int32) - zero).astype(np.float32) * scale)[ids]
    add = next(n for n in quantized.graph.node if n.op_type == "Add")
    probe = onnx.ModelProto()
    probe.CopyFrom(quantized)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in add.input)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    out, *rows = session.run(None, {"ids": ids})
    for got in rows:
        np.testing.assert_array_equal(got, dequantized)
    float_out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    assert np.abs(out - float_out).max() < 0.05 * np.abs(float_out).max()


def test_a_static_recipes_gather_is_left_to_onnxruntimes_fusion(tmp_path):
    """Static QDQ quantizes the Gather's output again: DQ -> Gather -> Q stays for
    onnxruntime's fusion (an 8-bit Gather), unchanged."""
    model = _embedding_model()
    ids = {"ids": np.random.default_rng(2).integers(0, 50, size=(16, 6)).astype(np.int64)}
    result = onnxq.quantize(model, tmp_path / "q.onnx", "U8S8", ids, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    made = _producers(quantized)
    assert all(made[n.input[0]].op_type == "DequantizeLinear" for n in quantized.graph.node
               if n.op_type == "Gather" and n.input[0] in made)
    assert not any("Gathers of a quantized table" in n for n in result.summary.note_texts)


@pytest.mark.parametrize("dtype", ["int4", "uint4"])
def test_a_4_bit_table_stays_dequantized_whole(tmp_path, dtype):
    """onnxruntime's CPU Gather takes 8- and 16-bit tables; a 4-bit one keeps its
    DequantizeLinear in front (blocked 4-bit tables are GatherBlockQuantized's) and loads."""
    config = compose_config("W8_DYNAMIC", None, {"global_quant_config": {"weight": {"dtype": dtype,
                                                                                   "symmetric": dtype == "int4"}}})
    result = onnxq.quantize(_embedding_model(), tmp_path / "q.onnx", config, progress=False)
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    made = _producers(quantized)
    assert [made[n.input[0]].op_type for n in quantized.graph.node if n.op_type == "Gather"] == [
        "DequantizeLinear"] * 2
    assert not any("Gathers of a quantized table" in n for n in result.summary.note_texts)
    ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"ids": np.zeros((2, 6), np.int64)})
