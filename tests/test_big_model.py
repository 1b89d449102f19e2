"""Big models (issue 14): weights that stay in external data files reach every stage
through files, from any working directory, and the output may carry external data too.
The byte limits are lowered so a small model takes the paths a >2 GB one takes
(benchmarks/big_model.py runs a real 2.3 GB one)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, run, sqnr_db

import onnxq.calibrate.session as session_module
import onnxq.graph.external_data as external_data_module
import onnxq.graph.load as load_module
import onnxq.graph.save as save_module
from onnxq.cli import main

K = 128


def _stack(layers: int = 4) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    b = GraphBuilder(17)
    h = b.input("x", ["N", 4, K])
    nodes = []
    for i in range(layers):
        w = (rng.standard_normal((K, K)) / np.sqrt(K)).astype(np.float32)
        nodes.append(b.node("MatMul", [h, b.const(f"w{i}", w)]))
        h = nodes[-1]
        if i < layers - 1:
            nodes.append(b.node("Relu", [h]))
            h = nodes[-1]
    return b.build(nodes, name="stack")


@pytest.fixture
def big_paths(monkeypatch):
    """Every limit a >2 GB model passes, set to a few kilobytes."""
    monkeypatch.setattr(external_data_module, "INLINE_LIMIT", 4096)
    monkeypatch.setattr(session_module, "INJECT_MIN_BYTES", 1024)  # weights reach sessions as arrays
    monkeypatch.setattr(save_module, "EXTERNAL_DATA_LIMIT", 4096)


@pytest.mark.parametrize("flags", [
    ["--per-channel"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "gptq"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "hqq"],
    ["--per-channel", "--adaround"],
], ids=["static", "gptq", "hqq", "adaround"])
def test_external_weights_from_another_directory(tmp_path, monkeypatch, big_paths, flags):
    model_dir, work, out_dir = tmp_path / "model", tmp_path / "work", tmp_path / "out"
    for d in (model_dir, work, out_dir):
        d.mkdir()
    model = _stack()
    onnx.save(model, str(model_dir / "model.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    before = (model_dir / "weights.bin").read_bytes()
    x = np.random.default_rng(1).standard_normal((24, 4, K)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x[:16])
    monkeypatch.chdir(work)
    assert main(["quantize", "../model/model.onnx", "../out/q.onnx", "--calib-data", "../calib.npz",
                 "--quiet", *flags]) == 0
    # The output's weights went to a data file beside it; it loads from yet another directory.
    assert (out_dir / "q.onnx.data").exists()
    monkeypatch.chdir(tmp_path)
    onnx.checker.check_model(str(out_dir / "q.onnx"))
    ref = run(_stack(), {"x": x[16:]})  # onnx.save moved `model`'s weights out
    assert sqnr_db(ref, run(str(out_dir / "q.onnx"), {"x": x[16:]})) > (25 if flags[0] == "--per-channel" else 14)
    assert (model_dir / "weights.bin").read_bytes() == before  # the input is untouched


@pytest.mark.parametrize("flags", [
    ["--per-channel"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "gptq"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "awq"],
], ids=["static", "gptq", "awq"])
def test_weights_kept_out_of_the_proto_give_the_same_bytes(tmp_path, monkeypatch, flags):
    """Past SPILL_LIMIT a model file's raw weights are memory maps of the file itself
    (`graph.wire`), and an in-memory model's are moved into temporary mapped files; either
    way the output is byte-identical and the input intact."""
    import onnxq
    from onnxq.cli import build_parser
    from onnxq.cli.flags import spec_overrides
    from onnxq.config import compose_config

    path = tmp_path / "m.onnx"
    onnx.save(_stack(), str(path))
    source = path.read_bytes()
    data = {"x": np.random.default_rng(2).standard_normal((16, 4, K)).astype(np.float32)}
    args = build_parser().parse_args(["quantize", "in", "out", *flags])
    config = compose_config(args.preset, args.config, spec_overrides(args))

    def quantized(model: object) -> bytes:
        return onnxq.quantize(model, None, config, data, progress=False).model.SerializeToString()

    reference = quantized(str(path))
    monkeypatch.setattr(external_data_module, "SPILL_LIMIT", 0)
    monkeypatch.setattr(external_data_module, "_SPILL_MIN_BYTES", 1024)
    mapped = load_module.load_model(str(path))[0]
    assert all(isinstance(v.const_value.raw, np.ndarray) and not v.const_value.raw.flags.writeable
               for v in mapped.graph.initializers.values() if v.name.startswith("w"))
    assert quantized(str(path)) == reference  # weights mapped from the model file
    assert quantized(onnx.load(str(path))) == reference  # weights spilled to temporary files
    assert path.read_bytes() == source


def test_wire_reader_matches_onnx_load(tmp_path):
    from onnxq.graph.wire import read_split

    model = _stack()
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.arange(6, dtype=np.int64), "typed"))
    model.graph.initializer[-1].ClearField("raw_data")
    model.graph.initializer[-1].int64_data.extend(range(6))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    proto, weights = read_split(path)
    full = onnx.load(str(path))
    assert sorted(weights) == sorted(t.name for t in full.graph.initializer if t.HasField("raw_data"))
    for tensor in full.graph.initializer:
        expected = onnx.numpy_helper.to_array(tensor)
        got = weights.get(tensor.name)
        if got is None:
            got = onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == tensor.name))
        np.testing.assert_array_equal(got, expected)
    assert [n.name for n in proto.graph.node] == [n.name for n in full.graph.node]
    assert proto.opset_import == full.opset_import


def test_structure_reads_inputs_opsets_and_data_files_without_weights(tmp_path):
    """`read_structure`: the model as `onnx.load` gives it, less its raw weights' bytes;
    external data stays named; a file that is no model fails as `onnx.load` does."""
    from onnxq.graph.folder import on_disk_bytes
    from onnxq.graph.wire import read_structure

    path = tmp_path / "m.onnx"
    onnx.save(_stack(), str(path))
    proto, full = read_structure(path), onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == [i.name for i in full.graph.input]
    assert proto.opset_import == full.opset_import and len(proto.graph.node) == len(full.graph.node)
    assert not any(t.raw_data for t in proto.graph.initializer) and any(t.raw_data for t in full.graph.initializer)
    external = tmp_path / "ext" / "m.onnx"
    external.parent.mkdir()
    onnx.save(_stack(), str(external), save_as_external_data=True, location="w.bin", size_threshold=0)
    assert on_disk_bytes(external) == external.stat().st_size + (external.parent / "w.bin").stat().st_size
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(Exception) as wire_error:
        read_structure(junk)
    with pytest.raises(type(wire_error.value)):
        onnx.load(str(junk))


def _mixed_model(tmp_path):
    """Weights of every kind the writer and the sessions meet: big float32 (from an
    external file), float16, bfloat16 and int4 ones (no numpy type onnxruntime takes),
    small ones and a string tensor, with model and graph metadata. Returns the onnx-ir
    model and the float32 weight's name."""
    import onnx_ir as ir

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((K, K)) / np.sqrt(K)).astype(np.float32)
    b = GraphBuilder(21)
    x = b.input("x", ["N", K])
    w_float = b.const("w_float", w)
    h = b.node("MatMul", [x, w_float])
    half = b.node("MatMul", [b.node("Cast", [h], to=onnx.TensorProto.FLOAT16), b.const("w_half", w.astype(np.float16))])
    h16 = b.node("Cast", [half], to=onnx.TensorProto.FLOAT)
    codes = rng.integers(-8, 8, size=(K - 1, K)).astype(np.int8)
    b.inits.append(onnx.helper.make_tensor("w_int4", onnx.TensorProto.INT4, codes.shape, codes.reshape(-1).tolist()))
    dq = b.node("DequantizeLinear", ["w_int4", b.const("s4", np.float32(0.01))])
    sliced = b.node("Slice", [h16, b.const("st", np.array([0], np.int64)), b.const("en", np.array([K - 1], np.int64)),
                              b.const("ax", np.array([1], np.int64))])
    out = b.node("Add", [b.node("MatMul", [sliced, dq]), b.const("bias", np.full(K, 0.5, np.float32))])
    proto = b.build([out], opset=21, name="mixed")
    proto.graph.initializer.append(onnx.helper.make_tensor("names", onnx.TensorProto.STRING, [2], [b"a", b"b"]))
    proto.doc_string, proto.graph.doc_string = "model doc", "graph doc"
    onnx.helper.set_model_props(proto, {"source": "test"})
    path = tmp_path / "mixed" / "m.onnx"
    path.parent.mkdir()
    onnx.save(proto, str(path), save_as_external_data=True, location="m.bin", size_threshold=4096)
    model = ir.load(str(path))
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    model.graph.initializers["w_bf16"] = ir.Value(
        name="w_bf16", const_value=ir.Tensor(bf16, dtype=ir.DataType.BFLOAT16))
    return model, w_float


def test_writer_gives_the_bytes_protobuf_serializes(tmp_path):
    """`write_model` streams each weight from its buffer, yet writes exactly the bytes
    onnx-ir's full serialization gives, external weights read in."""
    import onnx_ir as ir

    from onnxq.graph.save import write_model

    model, w_float = _mixed_model(tmp_path)
    out = tmp_path / "out.onnx"
    write_model(model, out)
    assert isinstance(model.graph.initializers[w_float].const_value, ir.ExternalTensor)  # the model is unchanged
    written = onnx.load(str(out))
    for tensor in written.graph.initializer:  # the int4 weight's int32_data is written as raw_data
        np.testing.assert_array_equal(ir.serde.TensorProtoTensor(tensor).numpy(),
                                      model.graph.initializers[tensor.name].const_value.numpy())
    ir.external_data.load_to_model(model)
    int4 = model.graph.initializers["w_int4"]
    int4.const_value = ir.Tensor(int4.const_value.numpy(), dtype=ir.DataType.INT4, name="w_int4")
    assert out.read_bytes() == ir.to_proto(model).SerializeToString()


def test_sessions_take_big_weights_as_arrays(tmp_path, monkeypatch):
    """`open_session` serializes the graph without its big weights and hands those to
    onnxruntime as arrays; it computes what a session over the saved file computes, from
    any working directory, while weights without a numpy type travel inline."""
    import onnx_ir as ir
    import onnxruntime as ort

    from onnxq.calibrate.session import open_session
    from onnxq.graph.save import write_model

    model, _ = _mixed_model(tmp_path)
    del model.graph.initializers["w_bf16"]  # no consumer
    saved = tmp_path / "saved.onnx"
    write_model(model, saved)
    x = np.random.default_rng(4).standard_normal((3, K)).astype(np.float32)
    expected = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(session_module, "INJECT_MIN_BYTES", 1024)
    session = open_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
    # the float32 and float16 weights in their external file are read by onnxruntime from
    # there (`read_by_session`), not handed over as arrays; int4 inline
    assert session._onnxq_weights == []
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], expected)
    half = next(v for name, v in model.graph.initializers.items() if name.startswith("w_half"))
    half.const_value = ir.Tensor(half.const_value.numpy().copy(), name=half.name)  # rewritten by a pass: in memory
    session = open_session(model, ort.SessionOptions(), ["CPUExecutionProvider"])
    assert [tuple(a.shape()) for a in session._onnxq_weights] == [(K, K)]
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], expected)


def test_an_inline_model_upgraded_to_a_newer_opset_keeps_its_weights_mapped(tmp_path, monkeypatch):
    """An opset upgrade had read a mapped file's every weight into memory for onnx's
    converter (a 1.5 GB inline model at opset 17 peaked at 9.4 GB under W4_GROUP128,
    big-model trial): the converter gets the small constants (a Reshape's shape, here) and
    the weights stay memory maps; the output is byte-identical to a full read's."""
    import onnxq

    b = GraphBuilder(5)
    x = b.input("x", ["N", 4, K])
    h = b.node("MatMul", [x, b.const("w0", b.he((K, K), K))])
    h = b.node("Reshape", [h, b.const("shape", np.array([0, -1], np.int64))])
    h = b.node("ReduceMean", [h], axes=[-1], keepdims=1)
    model = b.build([b.node("MatMul", [b.node("Reshape", [h, b.const("back", np.array([0, 1, 1], np.int64))]),
                                       b.const("w1", b.he((1, K), 1))])], opset=17, name="upgrade")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    data = {"x": np.random.default_rng(3).standard_normal((8, 4, K)).astype(np.float32)}
    reference = onnxq.quantize(str(path), None, "W4_GROUP128", data, progress=False).model.SerializeToString()
    monkeypatch.setattr(external_data_module, "SPILL_LIMIT", 0)
    monkeypatch.setattr(external_data_module, "_SPILL_MIN_BYTES", 1024)
    reads = []
    read = load_module._read_proto
    monkeypatch.setattr(load_module, "_read_proto", lambda source, split=False: reads.append(split) or
                        read(source, split))
    loaded, report = load_module.load_model(str(path), min_opset=21)
    assert reads == [True]  # the file was split once, not read whole for the converter
    assert report.original_opset == 17 and report.opset == 21
    assert any(n.op_type == "ReduceMean" and len(n.inputs) == 2 for n in loaded.graph)  # axes became an input
    w0 = next(v for name, v in loaded.graph.initializers.items() if name.startswith("w0")).const_value.raw
    assert isinstance(w0, np.ndarray) and not w0.flags.writeable  # a map of the file, not a copy
    assert onnxq.quantize(str(path), None, "W4_GROUP128", data, progress=False).model.SerializeToString() \
        == reference


def test_a_converter_that_rewrites_a_mapped_weight_gets_the_full_read(tmp_path, monkeypatch):
    """Where onnx's converter rewrote a mapped weight (no upward adapter does today), the
    file is read whole and the rewrite kept, never the stale map (review)."""
    import onnx.numpy_helper

    b = GraphBuilder(5)
    x = b.input("x", ["N", 4, K])
    model = b.build([b.node("MatMul", [x, b.const("w0", b.he((K, K), K))])], opset=17, name="rewrite")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    monkeypatch.setattr(external_data_module, "SPILL_LIMIT", 0)
    monkeypatch.setattr(external_data_module, "_SPILL_MIN_BYTES", 1024)
    upgrade = load_module.upgrade_opset

    def rewriting(proto, opset, target):
        proto = upgrade(proto, opset, target)
        weight = next(t for t in proto.graph.initializer if t.name.startswith("w0"))
        weight.CopyFrom(onnx.numpy_helper.from_array(np.full((K, K), 0.5, np.float32), weight.name))
        return proto

    monkeypatch.setattr(load_module, "upgrade_opset", rewriting)
    loaded, _ = load_module.load_model(str(path), min_opset=21)
    w0 = next(v for name, v in loaded.graph.initializers.items() if name.startswith("w0")).const_value.numpy()
    assert np.all(w0 == 0.5)
