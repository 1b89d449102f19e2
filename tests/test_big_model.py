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
    monkeypatch.setattr(load_module, "INLINE_LIMIT", 4096)
    monkeypatch.setattr(session_module, "INLINE_LIMIT", 4096)
    monkeypatch.setattr(save_module, "EXTERNAL_DATA_LIMIT", 4096)


@pytest.mark.parametrize("flags", [
    ["--per-channel"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "gptq"],
    ["--preset", "W4_GROUP128", "--per-group", "32", "--algorithm", "hqq"],
], ids=["static", "gptq", "hqq"])
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
    from onnxq.cli import _spec_overrides, build_parser
    from onnxq.config import compose_config

    path = tmp_path / "m.onnx"
    onnx.save(_stack(), str(path))
    source = path.read_bytes()
    data = {"x": np.random.default_rng(2).standard_normal((16, 4, K)).astype(np.float32)}
    args = build_parser().parse_args(["quantize", "in", "out", *flags])
    config = compose_config(args.preset, args.config, _spec_overrides(args))

    def quantized(model: object) -> bytes:
        return onnxq.quantize(model, None, config, data, progress=False).model.SerializeToString()

    reference = quantized(str(path))
    monkeypatch.setattr(load_module, "SPILL_LIMIT", 0)
    monkeypatch.setattr(load_module, "_SPILL_MIN_BYTES", 1024)
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
