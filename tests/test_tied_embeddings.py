"""A tied embedding and LM head (the genai builder's: the embedding gathers from the LM
head's weight transposed) quantized to int4 once: MatMulNBits and GatherBlockQuantized
read one stored weight, the LM head's quantization wins (GPTQ's codes are the
embedding's), the model loads, generates, and computes what two copies of the same codes
would."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from genai_model import build_genai_folder, genai_generate
from helpers import session, sqnr_db
from onnx import helper, numpy_helper

import onnxq
import onnxq.graph.fold
from onnxq.notes import Topic, of
from onnxq.numerics.blocks import BlockQuantized, dequantize_blockwise
from onnxq.plan.params import WeightCache
from onnxq.plan.tied import shared_block

LAYERS, HEADS, KV_HEADS, VOCAB = 2, 4, 2, 256
PROMPT = [5, 17, 200, 3, 99, 42, 7, 64]


def quantize(folder, out, group=None, algorithm=None, windows=None, **weight):
    """W4_GROUP128 with the MatMul and Gather weights in blocks of `group` (None: 128) and
    `weight`'s other fields."""
    weight = {**weight, **({"group_size": group} if group else {})}
    extra = {"layer_type_quant_config": {op: {"weight": weight} for op in ("MatMul", "Gather")}} if weight else {}
    config = onnxq.compose_config("W4_GROUP128", None, {**extra, "algo_config": [{"name": algorithm}] if algorithm else []})
    return onnxq.quantize(str(folder), str(out), config, str(windows) if windows else None, progress=False)


def prefill_logits(model, hidden, heads=HEADS, kv_heads=KV_HEADS) -> np.ndarray:
    """Logits of PROMPT on an empty cache (`model`: a path or a ModelProto)."""
    feeds = {"input_ids": np.array([PROMPT], np.int64), "attention_mask": np.ones((1, len(PROMPT)), np.int64),
             **{f"past_key_values.{i}.{kind}": np.zeros((1, kv_heads, 0, hidden // heads), np.float32)
                for i in range(LAYERS) for kind in ("key", "value")}}
    return session(model, threads=1).run(["logits"], feeds)[0]


def kernels(model: onnx.ModelProto) -> tuple[onnx.NodeProto, onnx.NodeProto, dict[str, onnx.TensorProto]]:
    """The LM head's MatMulNBits, the embedding's GatherBlockQuantized and the initializers."""
    (nbits,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head/")]
    (gbq,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    return nbits, gbq, {t.name: t for t in model.graph.initializer}


def reshape_source(model: onnx.ModelProto, value: str) -> str | None:
    """The input a Reshape turns into `value`, or None when no Reshape makes it."""
    return next((n.input[0] for n in model.graph.node if n.op_type == "Reshape" and n.output[0] == value), None)


def with_embedding(model: onnx.ModelProto, table: np.ndarray | None) -> onnx.ModelProto:
    """The model with its embedding replaced: GatherBlockQuantized on its own copies of the
    LM head's bytes and scales (None: two stored copies of the same codes), or a float
    Gather of `table`."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    _, gbq, inits = kernels(copy)
    reshape = next(n for n in copy.graph.node if n.op_type == "Reshape" and n.output[0] == gbq.input[0])
    packed = numpy_helper.to_array(inits[reshape.input[0]])
    copy.graph.node.remove(reshape)
    if table is None:
        copy.graph.initializer.extend([numpy_helper.from_array(packed.reshape(packed.shape[0], -1), "own_data"),
                                       numpy_helper.from_array(numpy_helper.to_array(inits[gbq.input[2]]), "own_scales")])
        gbq.input[0], gbq.input[2] = "own_data", "own_scales"
        return copy
    copy.graph.initializer.append(numpy_helper.from_array(table, "float_table"))
    index = list(copy.graph.node).index(gbq)
    copy.graph.node.remove(gbq)
    copy.graph.node.insert(index, helper.make_node("Gather", ["float_table", gbq.input[1]], list(gbq.output)))
    return copy


def lm_head_weight(model: onnx.ModelProto, hidden: int) -> np.ndarray:
    """The LM head's int4 weight [hidden, vocab], dequantized as MatMulNBits computes it."""
    nbits, _, inits = kernels(model)
    attrs = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
    packed, scales, *zero_points = (numpy_helper.to_array(inits[name]) for name in nbits.input[1:])
    return dequantize_blockwise(BlockQuantized(packed, scales, (zero_points or [None])[0], hidden, VOCAB, 4,
                                               attrs["block_size"]))


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "windows.npz"
    np.savez(path, input_ids=np.random.default_rng(3).integers(0, VOCAB, (6, 16)))
    return path


@pytest.mark.parametrize("algorithm", [None, "gptq", "awq"])
def test_tied_table_is_stored_once(tmp_path, windows, monkeypatch, algorithm):
    hidden = 64
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=hidden, heads=HEADS, kv_heads=KV_HEADS)
    pinned = {}
    pin = WeightCache.pin_node
    monkeypatch.setattr(WeightCache, "pin_node", lambda self, node, value, q: (pinned.setdefault(node, q),
                                                                               pin(self, node, value, q))[1])
    result = quantize(folder, tmp_path / "out", 32, algorithm, windows if algorithm else None)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, inits = kernels(model)
    # One stored table: the embedding reads the LM head's B through a Reshape, and its scales.
    assert reshape_source(model, gbq.input[0]) == nbits.input[1] and list(gbq.input[2:]) == list(nbits.input[2:])
    assert numpy_helper.to_array(inits[nbits.input[1]]).shape == (VOCAB, hidden // 32, 16)
    assert {t.name for t in inits.values() if list(t.dims[:1]) == [VOCAB]} == set(nbits.input[1:])
    attrs = {a.name: helper.get_attribute_value(a) for a in gbq.attribute}
    assert attrs == {"gather_axis": 0, "quantize_axis": 1, "block_size": 32, "bits": 4}
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "one int4 copy" in note.text and "blocks of 32" in note.text
    if algorithm == "gptq":  # GPTQ's codes for the LM head are the stored table
        np.testing.assert_array_equal(pinned["/lm_head/MatMul"].packed, numpy_helper.to_array(inits[nbits.input[1]]))
    if algorithm == "awq":  # the tied LM head is not scaled: the embedding reads its codes unscaled
        assert "/lm_head/MatMul" not in pinned
    # Two stored copies of the same codes compute the same; so does a float table of the
    # LM head's dequantized weight.
    logits = prefill_logits(model, hidden)
    np.testing.assert_array_equal(logits, prefill_logits(with_embedding(model, None), hidden))
    np.testing.assert_allclose(logits, prefill_logits(with_embedding(model, lm_head_weight(model, hidden).T), hidden),
                               rtol=0, atol=1e-5)
    assert sqnr_db(prefill_logits(folder / "model.onnx", hidden), logits) > 4.0
    generated = genai_generate(tmp_path / "out", PROMPT, 8)
    assert len(generated) == 8 and all(0 <= t < VOCAB for t in generated)


def test_asymmetric_uint4_shares_the_zero_points(tmp_path):
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS)
    quantize(folder, tmp_path / "out", 32, dtype="uint4", symmetric=False)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, _ = kernels(model)
    assert len(nbits.input) == 4 and reshape_source(model, gbq.input[0]) == nbits.input[1]
    assert list(gbq.input[2:]) == list(nbits.input[2:])  # scales and packed zero points
    np.testing.assert_allclose(prefill_logits(model, 64),
                               prefill_logits(with_embedding(model, lm_head_weight(model, 64).T), 64), rtol=0, atol=1e-5)


def test_the_tied_table_takes_finer_blocks(tmp_path):
    """Blocks of 64: the pair takes blocks of 32 (`HEAD_BLOCK`), the other MatMuls keep 64
    (hidden 96, 2 heads of 48: onnxruntime's GroupQueryAttention takes head sizes in
    multiples of 16)."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=96, heads=2, kv_heads=1)
    result = quantize(folder, tmp_path / "out", 64)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, _ = kernels(model)
    assert reshape_source(model, gbq.input[0]) == nbits.input[1]
    blocks = {n.name: helper.get_attribute_value(next(a for a in n.attribute if a.name == "block_size"))
              for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
    assert blocks.pop(nbits.name) == blocks.pop(gbq.name) == 32 and set(blocks.values()) == {64}
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "blocks of 32 (the tied table's blocks are at most 32)" in note.text
    table = lm_head_weight(model, 96).T
    np.testing.assert_allclose(prefill_logits(model, 96, 2, 1), prefill_logits(with_embedding(model, table), 96, 2, 1),
                               rtol=0, atol=1e-5)
    assert len(genai_generate(tmp_path / "out", PROMPT, 4)) == 4


def test_no_block_size_divides_the_hidden_size(tmp_path):
    """hidden 72 (8 x 9): no power of two from 16 divides it, so each keeps its own copy
    (the model loads; onnxruntime's GroupQueryAttention would not run its heads of 24)."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=72, heads=3, kv_heads=1)
    result = quantize(folder, tmp_path / "out")
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, _ = kernels(model)
    assert reshape_source(model, gbq.input[0]) is None and gbq.input[0] != nbits.input[1]
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "each stores its own copy: no power of two from 16 to 128 divides the hidden size 72" in note.text
    session(tmp_path / "out" / "model.onnx")


def test_unfolded_transpose_is_tied_as_the_folded_copy(tmp_path, monkeypatch):
    """A table past the fold limit stays Transpose(weight): the pair is found through it,
    and the output is the one the folded copy gives, with neither the Transpose nor the
    float weight left."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS)
    quantize(folder, tmp_path / "folded", 32)
    monkeypatch.setattr(onnxq.graph.fold, "MAX_FOLD_ELEMENTS", 1000)
    quantize(folder, tmp_path / "unfolded", 32)
    folded, unfolded = (onnx.load(str(tmp_path / d / "model.onnx")) for d in ("folded", "unfolded"))
    nbits, gbq, _ = kernels(unfolded)
    assert reshape_source(unfolded, gbq.input[0]) == nbits.input[1]
    assert "Transpose" not in {n.op_type for n in unfolded.graph.node}
    assert "lm_head.MatMul.weight" not in {t.name for t in unfolded.graph.initializer}
    np.testing.assert_array_equal(prefill_logits(folded, 64), prefill_logits(unfolded, 64))


def test_untied_model_keeps_its_two_tables(tmp_path):
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS,
                                tie_embeddings=False)
    result = quantize(folder, tmp_path / "out", 32)
    nbits, gbq, _ = kernels(onnx.load(str(tmp_path / "out" / "model.onnx")))
    assert gbq.input[0] != nbits.input[1] and not [n for n in result.summary.notes if "tied" in n.text]


def test_hqq_float_zero_points_keep_two_copies(tmp_path):
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS)
    result = quantize(folder, tmp_path / "out", 32, "hqq")
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "each stores its own copy: its float zero points (HQQ)" in note.text
    assert len(genai_generate(tmp_path / "out", PROMPT, 4)) == 4


def test_the_tied_table_blocks_are_at_most_32(tmp_path):
    """hidden 128 with blocks of 128: the pair takes 32, every other MatMul keeps 128."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=128, heads=HEADS, kv_heads=KV_HEADS)
    quantize(folder, tmp_path / "out", 128)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, _ = kernels(model)
    blocks = {n.name: helper.get_attribute_value(next(a for a in n.attribute if a.name == "block_size"))
              for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
    assert blocks.pop(nbits.name) == blocks.pop(gbq.name) == 32 and set(blocks.values()) == {128}


def test_hidden_size_not_a_multiple_of_the_tied_block(tmp_path):
    """hidden 48 (one head of 48): the pair takes blocks of 16, and the note says why."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=48, heads=1, kv_heads=1)
    result = quantize(folder, tmp_path / "out", 64)
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "blocks of 16 (the hidden size 48 is not a multiple of 32)" in note.text


@pytest.mark.parametrize("hidden,group,block", [(576, 128, 64), (96, 64, 32), (4096, 128, 128), (72, 128, None),
                                                (48, 32, 16)])
def test_shared_block(hidden, group, block):
    assert shared_block(hidden, group) == block


def test_quantizing_the_output_again_keeps_one_table(tmp_path):
    """An onnxq W4 folder given again keeps its kernels as they are, its tied table stored
    once (load does not fold the table's Reshape into a second copy), the same logits, and a
    warning that names the cause rather than a recipe."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS,
                                vocab=4096)
    quantize(folder, tmp_path / "once")
    again = onnxq.quantize(str(tmp_path / "once"), str(tmp_path / "twice"), "W4_GROUP128", progress=False)
    once, twice = (onnx.load(str(tmp_path / name / "model.onnx")) for name in ("once", "twice"))
    assert twice.ByteSize() <= once.ByteSize() * 1.01, (once.ByteSize(), twice.ByteSize())
    nbits, gbq, _ = kernels(twice)
    assert reshape_source(twice, gbq.input[0]) == nbits.input[1]
    np.testing.assert_allclose(prefill_logits(twice, 64), prefill_logits(once, 64), rtol=0, atol=1e-6)
    assert any("the model is already quantized" in n for n in again.summary.note_texts)


def test_only_tables_a_quantized_kernel_reads_stay_unfolded():
    """A large shared integer constant stays one table where a com.microsoft kernel reads
    it; read by plain ops only (an index table), its constant Reshape folds as any other."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxq.graph.fold import SHARED_QUANTIZED_ELEMENTS, fold_constants

    def model(domain: str, dequantized: bool = False) -> ir.Model:
        table = numpy_helper.from_array((np.arange(SHARED_QUANTIZED_ELEMENTS) % 127).astype(np.int8).reshape(256, -1),
                                        "t")
        shape = numpy_helper.from_array(np.array([-1], np.int64), "shape")
        reader = helper.make_node("Identity", ["t"], ["u"], domain=domain) if domain else \
            helper.make_node("Gather", ["t", "i"], ["u"])
        if dequantized:  # a QDQ table: another tool's tied head
            reader = helper.make_node("DequantizeLinear", ["t", "s"], ["u"])
        nodes = [helper.make_node("Reshape", ["t", "shape"], ["flat"]), helper.make_node("Gather", ["flat", "i"], ["v"]),
                 reader]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [1])],
                                  [helper.make_tensor_value_info("v", TensorProto.INT8, None),
                                   helper.make_tensor_value_info("u", TensorProto.FLOAT if dequantized else
                                                                 TensorProto.INT8, None)],
                                  [table, shape, numpy_helper.from_array(np.array(0.5, np.float32), "s")])
        return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))

    assert fold_constants(model("")) == 1
    assert fold_constants(model("com.microsoft")) == 0
    assert fold_constants(model("", dequantized=True)) == 0


def test_w8_stores_the_tied_table_once_in_8_bits(tmp_path):
    """W8_GROUP128 (the decoder default) kept an int8 embedding table beside the LM head's
    8-bit weight: two copies of the largest weight (SmolLM2: 182 MB, now 151 MB). The pair
    now shares the LM head's MatMulNBits bytes through an 8-bit GatherBlockQuantized, and the
    embedding computes what a float table of the LM head's dequantized weight would."""
    hidden = 128
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=hidden, heads=HEADS, kv_heads=KV_HEADS)
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), "W8_GROUP128", progress=False)
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    nbits, gbq, inits = kernels(model)
    assert reshape_source(model, gbq.input[0]) == nbits.input[1] and list(gbq.input[2:]) == list(nbits.input[2:])
    assert not [t.name for t in inits.values() if "embed" in t.name]  # no table of the embedding's own
    attrs = {a.name: helper.get_attribute_value(a) for a in gbq.attribute}
    assert attrs == {"gather_axis": 0, "quantize_axis": 1, "block_size": 128, "bits": 8}
    (note,) = [n for n in of(result.summary.notes, Topic.EMISSION) if "tied embedding" in n.text]
    assert "one 8-bit copy" in note.text
    head = dict(zip(("packed", "scales"), (numpy_helper.to_array(inits[n]) for n in nbits.input[1:3])))
    weight = dequantize_blockwise(BlockQuantized(head["packed"], head["scales"], None, hidden, VOCAB, 8, 128))
    logits = prefill_logits(model, hidden)
    np.testing.assert_allclose(logits, prefill_logits(with_embedding(model, weight.T), hidden), rtol=0, atol=1e-5)
    # int8 weights, activations int8 in the kernels (accuracy level 4): 24 dB on random weights
    assert sqnr_db(prefill_logits(folder / "model.onnx", hidden), logits) > 20
    generated = genai_generate(tmp_path / "out", PROMPT, 8)
    assert len(generated) == 8 and all(0 <= t < VOCAB for t in generated)


def _float16_tied_model(hidden: int = 64, vocab: int = 512) -> onnx.ModelProto:
    """An fp16 decoder's ends as the genai builder writes them at `-p fp16`: the embedding
    gathers from the float16 LM head's weight transposed, one MatMul between, the LM head;
    a KV cache passed through (a decoder under a weight-only recipe stays half inside)."""
    rng = np.random.default_rng(5)
    head = (rng.standard_normal((hidden, vocab)) * 0.1).astype(np.float16)
    middle = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float16)
    nodes = [helper.make_node("Transpose", ["lm_head.MatMul.weight"], ["table"], name="/model/embed_tokens/Transpose"),
             helper.make_node("Gather", ["table", "input_ids"], ["embedded"], name="/model/embed_tokens/Gather"),
             helper.make_node("MatMul", ["embedded", "middle"], ["hidden"], name="/model/middle/MatMul"),
             helper.make_node("MatMul", ["hidden", "lm_head.MatMul.weight"], ["logits"], name="/lm_head/MatMul"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="/model/cache")]
    cache = ["batch", 1, "past", hidden]
    graph = helper.make_graph(
        nodes, "fp16_tied", [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "sequence"]),
                             helper.make_tensor_value_info("past_key_values.0.key", onnx.TensorProto.FLOAT16, cache)],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT16, ["batch", "sequence", vocab]),
         helper.make_tensor_value_info("present.0.key", onnx.TensorProto.FLOAT16, cache)],
        [numpy_helper.from_array(head, "lm_head.MatMul.weight"), numpy_helper.from_array(middle, "middle")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("preset", ["W4_GROUP128", "W8_GROUP128"])
def test_a_float16_tied_table_is_stored_once_with_float16_scales(tmp_path, preset):
    """An fp16 genai folder (the builder's `-p fp16`): the embedding's float16 table was
    refused by GatherBlockQuantized's float32-only check, tried as DequantizeLinear (float32
    out), failed the load check and stayed float beside the int4 LM head: the output was
    larger than the input (13.3 -> 16.1 MB on a 2-layer model). onnxruntime's kernel takes
    float16 scales and gives float16 rows: one stored table, as in float32."""
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_float16_tied_model(), src)
    result = onnxq.quantize(str(src), str(out), preset, progress=False)
    model = onnx.load(str(out))
    nbits, gbq, inits = kernels(model)
    assert reshape_source(model, gbq.input[0]) == nbits.input[1] and list(gbq.input[2:]) == list(nbits.input[2:])
    assert numpy_helper.to_array(inits[gbq.input[2]]).dtype == np.float16
    assert not result.plan.float_nodes.get("/model/embed_tokens/Gather")
    assert out.stat().st_size < src.stat().st_size * (0.5 if preset == "W4_GROUP128" else 0.75)  # two tables: > 1
    ids = {"input_ids": np.random.default_rng(1).integers(0, 512, (2, 8)),
           "past_key_values.0.key": np.zeros((2, 1, 0, 64), np.float16)}
    reference = session(str(src), threads=1).run(None, ids)[0].astype(np.float32)
    got = session(str(out), threads=1).run(None, ids)[0]
    assert got.dtype == np.float16
    assert sqnr_db(reference, got.astype(np.float32)) > (12 if preset == "W4_GROUP128" else 30)


@pytest.mark.parametrize("tied", [True, False])
def test_a_static_recipe_says_it_stores_a_tied_table_twice(tmp_path, windows, tied):
    """Static int8 quantizes the embedding's table as a constant and the LM head's weight
    as a weight: two 8-bit copies of one table, which the summary had not said (families
    trial: Qwen2, Gemma2, Granite and SmolLM3 in U8S8)."""
    folder = build_genai_folder(tmp_path / "float", layers=LAYERS, hidden=64, heads=HEADS, kv_heads=KV_HEADS,
                                tie_embeddings=tied)
    result = onnxq.quantize(str(folder), str(tmp_path / "out"), "U8S8", str(windows), progress=False)
    said = [n for n in result.summary.note_texts if n.startswith("tied embedding")]
    assert said == ([("tied embedding /model/embed_tokens/Gather and LM head /lm_head/MatMul: each stores its own "
                      "quantized copy under a static recipe; the weight-only recipes store one (W8_GROUP128, "
                      "W4_GROUP128)")]
                    if tied else [])


def test_an_untied_float16_table_rounds_with_the_scales_the_kernel_reads(tmp_path):
    """A float16 table's scales are stored in float16 (GatherBlockQuantized's output type):
    the codes must be rounded with those scales, not with float32 ones cast afterwards
    (review), so each looked-up value is within half a step of the table's."""
    rng = np.random.default_rng(7)
    table = (rng.standard_normal((300, 64)) * 0.7).astype(np.float16)
    cache = ["batch", 1, "past", 64]  # a decoder's KV cache: a weight-only decoder stays float16 inside
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["rows"], name="/embed/Gather"),
         helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="/cache")], "table16",
        [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("past_key_values.0.key", onnx.TensorProto.FLOAT16, cache)],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT16, ["n", 64]),
         helper.make_tensor_value_info("present.0.key", onnx.TensorProto.FLOAT16, cache)],
        [numpy_helper.from_array(table, "table")])
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), src)
    onnxq.quantize(str(src), str(out), onnxq.compose_config("W4_GROUP128", None, {"layer_type_quant_config": {
        "Gather": {"weight": {"dtype": "int4", "symmetric": False, "qscheme": "per_group", "group_size": 32}}}}),
        progress=False)
    model = onnx.load(str(out))
    (gbq,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    scales = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == gbq.input[2]))
    assert scales.dtype == np.float16
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    data, zeros = inits[gbq.input[0]], inits[gbq.input[3]]
    codes = data.astype(np.float64).reshape(300, 64)  # 4-bit tensors, read back one code an element
    zero = np.repeat(zeros.astype(np.float64).reshape(300, 2), 32, axis=1)
    step = np.repeat(scales.astype(np.float64), 32, axis=1)
    signed = next(t for t in model.graph.initializer if t.name == gbq.input[0]).data_type == onnx.TensorProto.INT4
    low, high = (-8, 7) if signed else (0, 15)
    rounded = np.clip(np.rint(table.astype(np.float64) / step) + zero, low, high)  # with the stored float16 scales
    assert np.count_nonzero(codes != rounded) <= 2, np.count_nonzero(codes != rounded)  # ties aside: the nearest codes
    feed = {"input_ids": np.arange(300), "past_key_values.0.key": np.zeros((1, 1, 0, 64), np.float16)}
    rows = session(str(out), threads=1).run(None, feed)[0].astype(np.float64)
    np.testing.assert_allclose(rows, (codes - zero) * step, rtol=2e-3, atol=1e-6)  # what the kernel computes
