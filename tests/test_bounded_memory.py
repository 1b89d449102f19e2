"""LLM-sized models in bounded memory (benchmarks/llama_1b.py runs a 1.1B one): weights kept
in their external data file are read one at a time and leave memory once quantized, the
embedding table is quantized a slice of rows at a time, a big model's load check opens it
without the kernels' packed copies, and GPTQ's and AWQ's replay reads weights left in the
data file; none of it changes a byte of the output. The
limits are lowered so the tiny genai Llama takes the paths the 4.4 GB one takes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from genai_model import build_genai_folder

import onnxq
import onnxq.emit.gather_block_quantized as gather_module
import onnxq.emit.loadcheck as loadcheck_module
import onnxq.emit.matmul_nbits as matmul_module
import onnxq.graph.external_data as external_data_module
import onnxq.parallel as parallel_module
import onnxq.pipeline.emission as emission_module

QUANTIZED = ("proj", "lm_head", "embed_tokens")  # the weights W4_GROUP128 replaces


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_genai_folder(tmp_path_factory.mktemp("genai"), hidden=128, tie_embeddings=False)


def _quantize(folder, out, **kwargs):
    return onnxq.quantize(folder, out, "W4_GROUP128", progress=False, **kwargs)


def test_external_weights_leave_memory_as_they_are_quantized(folder, tmp_path, monkeypatch):
    """Each float weight left in the data file is released (unmapped) once its int4 form
    replaces it, while the next ones are quantized: at most a few are held at a time."""
    _quantize(folder, tmp_path / "plain")
    monkeypatch.setattr(external_data_module, "INLINE_LIMIT", 0)  # left in the data file, as past 1 GiB
    monkeypatch.setattr(parallel_module, "cpu_count", lambda: 2)
    events, released = [], []  # +1: a weight's quantization starts; -1: a float weight is released

    def counted(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            events.append(1)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    counted(matmul_module, "quantize_blockwise")
    counted(gather_module, "_quantize_table")
    real_release = ir.ExternalTensor.release

    def release(self):
        events.append(-1)
        released.append(self.name)
        real_release(self)

    monkeypatch.setattr(ir.ExternalTensor, "release", release)
    _quantize(folder, tmp_path / "mapped")
    assert len(released) == 2 * 5 + 2  # 2 layers of qkv, o, gate, up, down; embedding table, LM head
    assert all(any(part in name for part in QUANTIZED) for name in released)
    held = [sum(events[:i + 1]) for i in range(len(events))]
    assert held[-1] == 0 and max(held) <= 4  # two cores: those being quantized, those done ahead
    assert (tmp_path / "mapped" / "model.onnx").read_bytes() == (tmp_path / "plain" / "model.onnx").read_bytes()


def test_table_quantized_in_slices_of_rows_gives_the_same_bytes(folder, tmp_path, monkeypatch):
    _quantize(folder, tmp_path / "whole")
    monkeypatch.setattr(gather_module, "TABLE_CHUNK_VALUES", 3 * 128 + 5)  # 3 rows, the last slice shorter
    _quantize(folder, tmp_path / "slices")
    assert (tmp_path / "slices" / "model.onnx").read_bytes() == (tmp_path / "whole" / "model.onnx").read_bytes()


def test_big_model_load_check_opens_without_prepacking(folder, tmp_path, monkeypatch):
    real, asked = loadcheck_module.open_deployed, []

    def recording(model, providers, prepack=True):
        asked.append(prepack)
        return real(model, providers, prepack)

    monkeypatch.setattr(emission_module, "open_deployed", recording)
    _quantize(folder, tmp_path / "small")
    monkeypatch.setattr(loadcheck_module, "PREPACK_ALWAYS_BYTES", 1024)  # the folder counts as big
    big = _quantize(folder, tmp_path / "big")
    assert asked == [True, False]
    assert (tmp_path / "big" / "model.onnx").read_bytes() == (tmp_path / "small" / "model.onnx").read_bytes()
    assert not any("could not load" in text for text in big.summary.note_texts)
    # An output check runs the session: it prepacks as a deployment does.
    assert loadcheck_module.prepacks(1 << 40, runs_samples=True)


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_layerwise_replay_reads_weights_left_in_the_data_file(folder, tmp_path, monkeypatch, algorithm):
    """GPTQ's and AWQ's replay segments take the model's own weights (the embedding table,
    the norms) from the data file they stay in past 1 GiB, from any working directory:
    serialized as they were, they named a file onnxruntime looked for beside the working
    directory. The output is the one of weights read into memory."""
    windows = tmp_path / "windows.npz"
    np.savez(windows, input_ids=np.random.default_rng(3).integers(0, 256, (4, 16)))
    config = onnxq.compose_config("W4_GROUP128", None, {"algo_config": [{"name": algorithm}]})
    onnxq.quantize(folder, tmp_path / "inline", config, windows, progress=False)
    monkeypatch.setattr(external_data_module, "INLINE_LIMIT", 0)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    onnxq.quantize(folder, tmp_path / "mapped", config, windows, progress=False)
    assert (tmp_path / "mapped" / "model.onnx").read_bytes() == (tmp_path / "inline" / "model.onnx").read_bytes()
