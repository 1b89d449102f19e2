"""Calibration in shards (issue 14): statistics of contiguous stretches of the batches,
saved by `onnxq calibrate --shard i/n --stats`, merge into exactly the state of one run,
so `quantize --stats` writes the same bytes as calibrating on all the data; local
processes and Ray run the shards; mismatched or incomplete files are clear errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, conv_relu_chain, random_feeds, stack_feeds

import onnxq
from onnxq.calibrate.observers.histogram import StreamingHistogram
from onnxq.calibrate.statistics import Accumulator, Statistic
from onnxq.cli import main
from onnxq.errors import CalibrationDataError, ConfigError
from onnxq.notes import Topic, of
from onnxq.quantize import calibrate_shard, calibrate_sharded


def test_tree_sums_are_independent_of_the_split():
    """Sums of float64 batches merged from any contiguous split have the bits of one
    sequential accumulation (a plain running sum would not)."""
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((5, 3)) * 10.0 ** rng.integers(-8, 8) for _ in range(23)]
    stat = Statistic("x", "gram", -1)

    def accumulate(first: int, end: int) -> Accumulator:
        acc = Accumulator(stat)
        for i in range(first, end):
            acc.add_batch(batches[i], i)
        return acc

    whole = accumulate(0, len(batches)).result()
    assert len(accumulate(0, len(batches)).blocks) <= 5
    for cuts in ([7], [1, 2, 3], [8, 16], [5, 11, 17, 22]):
        edges = [0, *cuts, len(batches)]
        parts = [accumulate(a, b) for a, b in zip(edges, edges[1:])]
        merged = parts[0]
        for part in parts[1:]:
            merged.merge(Accumulator.from_state(stat, part.state()))
        assert merged.result().tobytes() == whole.tobytes(), cuts
    running = sum(b.T @ b for b in batches) / (5 * len(batches))
    np.testing.assert_allclose(whole, running, rtol=1e-6)  # each batch's product in float32


def test_histogram_state_round_trip_and_merge_in_any_order():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal(1000) * s for s in (1, 5, 0.1)]
    one = StreamingHistogram(128)
    for p in parts:
        one.update(p)
    pieces = []
    for p in parts[::-1]:
        h = StreamingHistogram(128)
        h.update(p)
        copy = StreamingHistogram(128)
        copy.set_state(h.state())
        pieces.append(copy)
    merged = pieces[0]
    for h in pieces[1:]:
        merged.merge(h)
    assert np.array_equal(merged.counts, one.counts) and merged.edges().tobytes() == one.edges().tobytes()


def _matmul_model() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    b = GraphBuilder(1)
    x = b.input("x", ["N", 4, 64])
    h = b.node("Relu", [b.node("MatMul", [x, b.const("w1", (rng.standard_normal((64, 64)) * 0.1).astype(np.float32))])])
    return b.build([b.node("MatMul", [h, b.const("w2", (rng.standard_normal((64, 32)) * 0.1).astype(np.float32))])])


CASES = {
    "default": (conv_relu_chain, {}),
    "entropy": (conv_relu_chain, {"global_quant_config": {"input_tensors": {"calib_method": "entropy"},
                                                         "output_tensors": {"calib_method": "percentile"}}}),
    "bias_correction": (conv_relu_chain, {"algo_config": [{"name": "bias_correction"}]}),
    # float8 centring's channel statistics, one of them also bias correction's request
    # (every layer's input quantized; no AdaRound, which only a run with data can do:
    # test_a_preset_algorithm_that_reads_the_data_is_skipped_from_files)
    "float8": (conv_relu_chain, {"preset": "FP8_E4M3", "edge_input": None,
                                 "algo_config": [{"name": "adaround", "enabled": False}]}),
    "gptq_hessians": (_matmul_model, {"preset": "W4_GROUP128",
                                      "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}},
                                      "algo_config": [{"name": "gptq", "true_sequential": False}]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_shards_give_the_bytes_of_one_run(tmp_path, case):
    build, overrides = CASES[case]
    model = build()
    data = stack_feeds(random_feeds(model, 37, seed=3))
    config = {**overrides, "calibration": {"batch_size": 4}}
    reference = onnxq.quantize(model, None, config, data, progress=False).model.SerializeToString()
    files = []
    for i in range(3):
        result = calibrate_shard(model, tmp_path / f"s{i}.npz", config, data, f"{i + 1}/3", progress=False)
        files.append(str(result.path))
        assert result.total_batches == 10
    merged = onnxq.as_config(config)
    merged.calibration.stats = files[::-1]  # any order
    out = onnxq.quantize(model, None, merged, None, progress=False)
    assert out.model.SerializeToString() == reference
    assert out.summary.calibration_samples == 37
    onnx.checker.check_model(out.model)


def test_a_preset_algorithm_that_reads_the_data_is_skipped_from_files(tmp_path):
    """FP8_E4M3's AdaRound reads the calibration data itself: a run from statistics files
    skips it with a note, and the preset's bias correction, first then, takes its
    statistics from the files the shards wrote for it."""
    model = conv_relu_chain()
    data = stack_feeds(random_feeds(model, 16, seed=3))
    config = {"preset": "FP8_E4M3", "calibration": {"batch_size": 4}}
    files = [str(calibrate_shard(model, tmp_path / f"s{i}.npz", config, data, f"{i + 1}/2",
                                 progress=False).path) for i in range(2)]
    merged = onnxq.as_config(config)
    merged.calibration.stats = files
    notes = onnxq.quantize(model, None, merged, None, progress=False).summary.notes
    (skipped,) = of(notes, Topic.SKIPPED, "adaround")
    assert "it reads the calibration data itself, which statistics files do not hold" in skipped.text
    (corrected,) = of(notes, Topic.ALGORITHM, "bias_correction")
    assert "corrected" in corrected.text
    # as the note says: the same files with the data too, and AdaRound runs
    notes = onnxq.quantize(model, None, merged, data, progress=False).summary.note_texts
    assert any(n.startswith("adaround: 3 of 3 layers improved") for n in notes), notes


def test_cli_shards_files_processes_and_errors(tmp_path, capsys):
    model = conv_relu_chain()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    np.savez(tmp_path / "calib.npz", **stack_feeds(random_feeds(model, 24, seed=4)))
    calib = str(tmp_path / "calib.npz")
    flags = ["--per-tensor", "--batch-size", "4", "--quiet"]
    assert main(["quantize", str(path), str(tmp_path / "ref.onnx"), "--calib-data", calib, *flags]) == 0
    for i in (1, 2):
        assert main(["calibrate", str(path), "--calib-data", calib, "--shard", f"{i}/2",
                     "--stats", str(tmp_path / f"s{i}.npz"), *flags]) == 0
    assert main(["quantize", str(path), str(tmp_path / "sh.onnx"), "--stats", str(tmp_path / "s1.npz"),
                 str(tmp_path / "s2.npz"), *flags]) == 0
    reference = (tmp_path / "ref.onnx").read_bytes()
    assert (tmp_path / "sh.onnx").read_bytes() == reference
    # All shards in local processes, merged into one file.
    assert main(["calibrate", str(path), "--calib-data", calib, "--shards", "2", "--stats",
                 str(tmp_path / "all.npz"), *flags]) == 0
    assert main(["quantize", str(path), str(tmp_path / "all.onnx"), "--stats", str(tmp_path / "all.npz"), *flags]) == 0
    assert (tmp_path / "all.onnx").read_bytes() == reference
    capsys.readouterr()
    # without the data the output is not checked, and the summary says so and how to check it
    assert main(["quantize", str(path), str(tmp_path / "nock.onnx"), "--stats", str(tmp_path / "all.npz"),
                 "--per-tensor", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "output check skipped: the activations' ranges came from statistics files, with no samples" in out
    assert "check on" not in out

    def fails(argv: list[str], message: str) -> None:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    out = str(tmp_path / "x.onnx")
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), *flags], "a shard's file is missing")
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), str(tmp_path / "s1.npz"), *flags],
          "overlaps another file")
    # which part differs is named (they all read 'another model, config or batching')
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), str(tmp_path / "s2.npz"),
           *flags, "--calib-method", "entropy", "--quiet"], "calibrated for other calibrated tensors or methods")
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), str(tmp_path / "s2.npz"),
           "--per-tensor", "--quiet"], "calibrated for another batching (calibration.batch_size")
    fails(["quantize", str(path), out, "--stats", calib, *flags], "is not an onnxq stats file")
    fails(["quantize", str(path), out, "--stats", str(path), *flags], "is not an onnxq stats file")  # a model
    # a shard half copied from another machine, and one with a byte flipped: one line, not zipfile's traceback
    whole = (tmp_path / "s2.npz").read_bytes()
    (tmp_path / "half.npz").write_bytes(whole[: len(whole) // 2])
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), str(tmp_path / "half.npz"), *flags],
          "is damaged or truncated")
    flipped = bytearray(whole)
    at = whole.index(b".npy") + 200  # inside the first array's data
    flipped[at] ^= 0xFF
    (tmp_path / "flip.npz").write_bytes(bytes(flipped))
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "s1.npz"), str(tmp_path / "flip.npz"), *flags],
          "stats file")
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "none.npz"), *flags], "stats file not found")
    fails(["calibrate", str(path), "--calib-data", calib, "--shard", "3/2", "--stats", out], "1 <= i <= n")
    fails(["calibrate", str(path), "--calib-data", calib, "--shard", "1/30", "--stats", out, "--batch-size", "4"],
          "fewer than the 30 shards")
    fails(["calibrate", str(path), "--calib-data", calib, "--shard", "1/2", "--shards", "2", "--stats", out],
          "give one")
    # weight-only Convs get the target's bias correction, whose statistics a stats file holds: without it, none
    fails(["calibrate", str(path), "--calib-data", calib, "--stats", out, "--preset", "W4_GROUP128",
           "--no-target-algorithms"],
          "no statistics to write: quantize with this config and the data directly, or calibrate for a static")
    fails(["quantize", str(path), out, "--stats", str(tmp_path / "all.npz"), "--load-ranges", "r.json"],
          "give one")
    assert not (tmp_path / "x.onnx").exists()


def test_true_sequential_gptq_needs_the_data_itself(tmp_path):
    """Its Hessians come from replaying the data layer by layer, so shards would hold
    nothing, and quantize --stats without the data says what to do."""
    model = _matmul_model()
    data = stack_feeds(random_feeds(model, 8, seed=5))
    config = {"preset": "W4_GROUP128", "layer_type_quant_config": {"MatMul": {"weight": {"group_size": 32}}},
              "algo_config": [{"name": "gptq"}]}
    with pytest.raises(ConfigError, match="no statistics to write"):
        calibrate_shard(model, tmp_path / "s.npz", config, data, "1/1", progress=False)
    with pytest.raises(CalibrationDataError, match="statistics files do not carry it"):
        onnxq.quantize(model, None, config, None, progress=False)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray not installed (pip install 'onnxq[ray]')")
def test_shards_on_a_local_ray_instance(tmp_path):
    model = conv_relu_chain()
    data = stack_feeds(random_feeds(model, 20, seed=6))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    config = {"calibration": {"batch_size": 4}}
    reference = onnxq.quantize(str(path), None, config, data, progress=False).model.SerializeToString()
    result = calibrate_sharded(str(path), tmp_path / "ray.npz", config, data, shards=2, executor="ray",
                               progress=False)
    assert result.window == (0, 5)
    merged = onnxq.as_config(config)
    merged.calibration.stats = [str(result.path)]
    assert onnxq.quantize(str(path), None, merged, None, progress=False).model.SerializeToString() == reference


def test_an_accuracy_target_raising_layers_to_float_from_stats_files(tmp_path):
    """Layers raised to float leave tensors the files calibrated: the final model is
    calibrated on --calib-data (a note says so), and without it the error says to pass it."""
    model = conv_relu_chain()
    data = stack_feeds(random_feeds(model, 24, seed=3))
    np.savez(tmp_path / "eval.npz", **data)
    target = {"mixed_precision": {"target": "sqnr>=60", "eval_data": str(tmp_path / "eval.npz"),
                                  "ladder": ["float"]}}
    direct = onnxq.quantize(model, None, target, data, progress=False)
    assert direct.summary.mixed_precision.promotions
    stats = str(calibrate_shard(model, tmp_path / "t.npz", target, data, "1/1", progress=False).path)
    reused = onnxq.quantize(model, None, {**target, "calibration": {"stats": [stats]}}, data, progress=False)
    assert reused.model.SerializeToString() == direct.model.SerializeToString()
    assert any("calibrated on the calibration data" in n for n in reused.summary.note_texts)
    with pytest.raises(CalibrationDataError, match="pass calibration_data as well"):
        onnxq.quantize(model, None, {**target, "calibration": {"stats": [stats]}}, None, progress=False)


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_one_stats_file_serves_other_types_and_an_accuracy_target(tmp_path, method):
    """An observer's state does not depend on the type it calibrates for (only its method,
    bins and folding do): statistics calibrated for uint8 activations give, for int16 ones
    and for an accuracy target's promoted layers, the bytes a direct run gives."""
    model = conv_relu_chain()
    data = stack_feeds(random_feeds(model, 24, seed=3))
    acts = {"calib_method": method}
    base = {"global_quant_config": {"input_tensors": acts, "output_tensors": acts}}
    stats = calibrate_shard(model, tmp_path / "s.npz", base, data, "1/1", progress=False).path
    wide = {"global_quant_config": {"input_tensors": {**acts, "dtype": "int16"},
                                    "output_tensors": {**acts, "dtype": "int16"}}}
    direct = onnxq.quantize(model, None, wide, data, progress=False).model.SerializeToString()
    reused = onnxq.quantize(model, None, {**wide, "calibration": {"stats": [str(stats)]}}, None, progress=False)
    assert reused.model.SerializeToString() == direct
    other_bins = {"global_quant_config": {"input_tensors": {**acts, "num_bins": 512},
                                          "output_tensors": {**acts, "num_bins": 512}}}
    np.savez(tmp_path / "eval.npz", **data)
    target = {**base, "mixed_precision": {"target": "sqnr>=38", "eval_data": str(tmp_path / "eval.npz"),
                                          "ladder": ["int16"]}}
    direct = onnxq.quantize(model, None, target, data, progress=False)
    assert direct.summary.mixed_precision.promotions  # some layers went to int16 or float
    # calibrated with the same flags (the target's ladder sets the opset the model loads at)
    stats = calibrate_shard(model, tmp_path / "t.npz", target, data, "1/1", progress=False).path
    reused = onnxq.quantize(model, None, {**target, "calibration": {"stats": [str(stats)]}}, None, progress=False)
    assert reused.model.SerializeToString() == direct.model.SerializeToString()
    if method != "minmax":  # a histogram of other bins is another state: refused
        with pytest.raises(CalibrationDataError, match="other calibrated tensors or methods"):
            onnxq.quantize(model, None, {**other_bins, "calibration": {"stats": [str(stats)]}}, None, progress=False)


def test_sharding_a_one_shot_generator_is_one_line(tmp_path):
    """calibration.md: a one-shot generator is refused in one line; calibrate_sharded let
    multiprocessing raise 'cannot pickle generator' (new-user trial)."""
    from pathlib import Path

    import numpy as np

    from onnxq.errors import CalibrationDataError
    models = Path(__file__).resolve().parents[1] / "models"
    x = np.load(models / "digits_calib.npz")["input"]
    batches = ({"input": x[i:i + 32]} for i in range(0, len(x), 32))
    with pytest.raises(CalibrationDataError, match="generator can be read only once; pass a path"):
        calibrate_sharded(str(models / "digits_cnn.onnx"), tmp_path / "s.npz", None, batches, shards=2)
    assert not (tmp_path / "s.npz").exists()


def test_calibrate_takes_a_model_folder(tmp_path):
    """llm-weight-only.md: inspect and calibrate follow quantize's rule, a model folder
    stands for its model; calibrate refused it ('is a directory, not an .onnx file')."""
    import shutil
    from pathlib import Path

    import numpy as np
    models = Path(__file__).resolve().parents[1] / "models"
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(models / "digits_cnn.onnx", folder / "model.onnx")
    calib = tmp_path / "c.npz"
    np.savez(calib, input=np.load(models / "digits_calib.npz")["input"][:64])
    for given in (folder, folder / "model.onnx"):
        assert main(["calibrate", str(given), "--calib-data", str(calib), "--stats", str(tmp_path / "s.npz"),
                     "--quiet"]) == 0
        assert (tmp_path / "s.npz").exists()
        (tmp_path / "s.npz").unlink()
