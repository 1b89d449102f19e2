"""int4 embedding tables become GatherBlockQuantized: exact lookups, small storage."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.config import config_from_dict


def embedding_model(vocab: int = 500, dim: int = 256) -> tuple[onnx.ModelProto, np.ndarray]:
    table = np.random.default_rng(0).normal(0, 0.5, (vocab, dim)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"], name="lookup", axis=0)],
        "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["B", "S", dim])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, table


@pytest.mark.parametrize("dtype,symmetric", [("int4", True), ("uint4", False)])
def test_int4_table_lookup(dtype, symmetric):
    model, table = embedding_model()
    config = config_from_dict({
        "global_quant_config": {
            "input_tensors": None, "output_tensors": None, "bias": None,
            "weight": {"dtype": dtype, "symmetric": symmetric, "qscheme": "per_group", "group_size": 64},
        },
    })
    result = onnxq.quantize(model, None, config)
    q = result.model
    onnx.checker.check_model(q, full_check=True)
    assert [n.op_type for n in q.graph.node] == ["GatherBlockQuantized"]
    ids = np.random.default_rng(1).integers(0, 500, (2, 7))
    got = ort.InferenceSession(q.SerializeToString()).run(None, {"ids": ids})[0]
    ref = table[ids]
    sqnr = 10 * np.log10((ref**2).sum() / ((ref - got) ** 2).sum())
    assert sqnr > 17.0, sqnr  # 4-bit blocks of 64 on Gaussian data: ~19-20 dB
    assert q.ByteSize() < 0.2 * table.nbytes  # int4 packs two values per byte


def test_non_power_of_two_block_falls_back_to_dequantize_linear():
    model, _ = embedding_model(dim=96)
    config = config_from_dict({
        "global_quant_config": {
            "input_tensors": None, "output_tensors": None, "bias": None,
            "weight": {"dtype": "int4", "qscheme": "per_group", "group_size": 48},
        },
    })
    q = onnxq.quantize(model, None, config).model
    ops = [n.op_type for n in q.graph.node]
    assert "GatherBlockQuantized" not in ops and "DequantizeLinear" in ops
    ids = np.array([[1, 2, 3]])
    out = ort.InferenceSession(q.SerializeToString()).run(None, {"ids": ids})[0]
    assert out.shape == (1, 3, 96)
