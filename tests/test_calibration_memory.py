"""`--max-calib-memory` (`calibration.max_memory_mb`) bounds the activations a calibration
batch returns: tensors whose min/max are reduced inside the session return two numbers
and cost nothing, so a min/max recipe calibrates in one pass whatever the bound; tensors
an observer reads whole (histograms) are split into passes (`calibrate/runner.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from helpers import sqnr_db
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.config.compose import compose_config

MODELS = Path(__file__).resolve().parent.parent / "models"
MODEL, CALIB = str(MODELS / "digits_cnn.onnx"), str(MODELS / "digits_calib.npz")


def _quantized(preset: str, bound: int | None) -> onnxq.QuantizationResult:
    overrides = {"calibration": {"max_memory_mb": bound}} if bound is not None else {}
    return onnxq.quantize(MODEL, None, compose_config(preset, None, overrides), CALIB, progress=False)


def test_a_min_max_recipe_calibrates_in_one_pass_under_any_bound(monkeypatch):
    """A 2.4 GB encoder under --max-calib-memory 64 had been split into over a hundred
    passes, counted at the full size of tensors the session reduces to two numbers
    (big-model trial): the bound now costs nothing, and the bytes are the unbounded run's."""
    import onnxq.calibrate.runner as runner

    free = _quantized("U8S8", None)
    monkeypatch.setattr(runner, "calibration_batch", lambda model, options, data=None: 4096)  # every tensor past 1 MB a batch
    bounded = _quantized("U8S8", 1)
    assert bounded.summary.calibration_passes == 1
    assert bounded.model.SerializeToString() == free.model.SerializeToString()


def test_tensors_read_whole_are_split_into_passes_and_still_calibrate(monkeypatch):
    """Histogram observers read their tensors whole: under a bound those are calibrated in
    several passes, and the model still tracks float."""
    import onnxq.calibrate.runner as runner

    monkeypatch.setattr(runner, "calibration_batch", lambda model, options, data=None: 4096)  # every tensor past 1 MB a batch
    entropy = {"calib_method": "entropy"}
    config = compose_config("U8S8", None, {"global_quant_config": {"input_tensors": entropy, "output_tensors": entropy},
                                           "calibration": {"max_memory_mb": 1}})
    split = onnxq.quantize(MODEL, None, config, CALIB, progress=False)
    assert split.summary.calibration_passes > 1
    x = {"input": np.load(MODELS / "digits_eval.npz")["input"][:64]}
    ref = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"]).run(None, x)[0]
    got = ort.InferenceSession(split.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert sqnr_db(ref, got) > 25


def test_a_pass_that_reads_the_data_with_statistics_files_alone_says_what_to_pass(tmp_path, capsys):
    """calibrate --smoothquant, then quantize --stats --smoothquant: SmoothQuant had been
    skipped for want of data and the files refused as made "for another model"
    (determinism trial); now one line says to pass the data beside them."""
    from onnxq.cli import main

    stats = tmp_path / "s.npz"
    assert main(["calibrate", MODEL, "--calib-data", CALIB, "--stats", str(stats), "--smoothquant", "0.5",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["quantize", MODEL, str(tmp_path / "q.onnx"), "--stats", str(stats), "--smoothquant", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "smoothquant picks its scales from the calibration data" in err and "--calib-data PATH beside" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "q.onnx").exists()
    assert main(["quantize", MODEL, str(tmp_path / "q.onnx"), "--stats", str(stats), "--smoothquant", "0.5",
                 "--calib-data", CALIB, "--quiet"]) == 0


def _dynamic_image_conv(channels: int = 64) -> onnx.ModelProto:
    """x [N, 3, H, W] -> Conv 3x3 to `channels` -> Relu: its activations' size is the data's."""
    w = np.random.default_rng(0).standard_normal((channels, 3, 3, 3)).astype(np.float32) / 5
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "dynamic_image",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", channels, "H", "W"])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_images_of_dynamic_size_are_batched_by_their_activations_on_the_first_sample():
    """A model whose inputs leave height and width to the data (a VAE decoder, an
    image-to-image net): the batch is sized on onnxruntime's profile of the first sample,
    where the model's shapes had left it at 8 whatever the images (a VAE decoder at 512x512
    peaked at 5 GB with entropy histograms, 0.9 GB at batch 1)."""
    from onnxq.calibrate.runner import DYNAMIC_BATCH_BYTES, calibration_batch
    from onnxq.config.spec import CalibrationConfig
    from onnxq.graph.load import load_model

    model, _ = load_model(_dynamic_image_conv())
    rng = np.random.default_rng(1)
    big = {"x": rng.standard_normal((3, 3, 300, 300)).astype(np.float32)}  # 64 x 300 x 300 floats: 23 MB a sample
    small = {"x": rng.standard_normal((3, 3, 32, 32)).astype(np.float32)}  # 0.26 MB a sample
    assert calibration_batch(model, CalibrationConfig(), big) == DYNAMIC_BATCH_BYTES // (64 * 300 * 300 * 4) == 2
    assert calibration_batch(model, CalibrationConfig(), small) == 8
    assert calibration_batch(model, CalibrationConfig(max_memory_mb=16), small) == 8
    assert calibration_batch(model, CalibrationConfig(max_memory_mb=16), big) == 1
    # one-shot data is read once, by calibration: no probe
    assert calibration_batch(model, CalibrationConfig(), iter([big])) == 8

    # the ranges do not depend on the batch: the bytes are batch 1's
    entropy = {"global_quant_config": {"input_tensors": {"calib_method": "entropy"}}}
    sized = onnxq.quantize(_dynamic_image_conv(), None, compose_config("U8S8", None, entropy), big, progress=False)
    one = onnxq.quantize(_dynamic_image_conv(), None, compose_config("U8S8", None, {**entropy, "calibration":
                                                                                      {"batch_size": 1}}),
                         big, progress=False)
    assert sized.model.SerializeToString() == one.model.SerializeToString()
