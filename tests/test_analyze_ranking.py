"""`onnxq analyze` ranks layers by what each alone does to the model's output, the rule the
accuracy search ranks them by (`analyze/impact.py`), not by their own channels' noise,
which a layer whose damage the rest of the network drops can top."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, random_feeds, sqnr_db, stack_feeds

from onnxq.analyze import analyze_models, format_analysis
from onnxq.config.compose import compose_config
from onnxq.quantize import quantize

SAMPLES = 32  # impact.IMPACT_SAMPLES: the output ranking's samples


def _masked_channel_model() -> tuple[onnx.ModelProto, str, str]:
    """Two 1x1 convolutions. The first's output channel 3 is 1000x smaller than the others:
    its per-tensor uint8 output grid rounds that channel away (its channels' mean noise is
    the larger), but the second conv reads channel 3 with zero weights, so none of that
    reaches the output. The second conv gets 3-bit weights: little noise per channel, all
    of it in the output."""
    b = GraphBuilder(3)
    x = b.input("x", ["N", 4, 8, 8])
    w_a = b.he((4, 4, 1, 1), 4)
    w_a[3] *= 1e-3
    a = b.node("Conv", [x, b.const("w_a", w_a), b.const("b_a", np.zeros(4, np.float32))], kernel_shape=[1, 1])
    w_b = b.he((4, 4, 1, 1), 4)
    w_b[:, 3] = 0.0
    y = b.node("Conv", [a, b.const("w_b", w_b), b.const("b_b", np.zeros(4, np.float32))], kernel_shape=[1, 1])
    model = b.build([y], name="masked_channel")
    first, second = (n.name for n in model.graph.node)
    return model, first, second


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    model, first, second = _masked_channel_model()
    folder = tmp_path_factory.mktemp("ranking")
    onnx.save(model, folder / "m.onnx")
    overrides = {"layer_quant_config": {second: {"weight": {"bits": 3}}}}
    calib = stack_feeds(random_feeds(model, 64, 0))
    quantize(folder / "m.onnx", folder / "q.onnx", compose_config("U8S8", None, overrides), calib, progress=False)
    data = stack_feeds(random_feeds(model, 48, 1))
    return folder, overrides, calib, data, first, second


def _output_sqnr(folder, quantized, data) -> float:
    feeds = {k: v[:SAMPLES] for k, v in data.items()}
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            for p in (folder / "m.onnx", quantized)]
    return sqnr_db(*outs)


def test_layers_rank_by_the_output_damage_not_their_channels_noise(masked, tmp_path):
    folder, overrides, calib, data, first, second = masked
    analysis = analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False)
    rows = {r.name: r for r in analysis.layers}
    assert rows[first].channel_noise > 5 * rows[second].channel_noise  # what ranked it first before
    assert [r.name for r in analysis.layers] == [second, first]
    assert rows[second].output_sqnr_db < rows[first].output_sqnr_db - 10

    # 'output dB' is the output SQNR of the model with that layer alone quantized: the other
    # one kept float (excluded) gives it, on the same samples, in a default session
    for layer, other in ((second, first), (first, second)):
        alone = tmp_path / f"{other}_float.onnx"
        config = compose_config("U8S8", None, {**overrides, "exclude": [other]})
        quantize(folder / "m.onnx", alone, config, calib, progress=False)
        assert rows[layer].output_sqnr_db == pytest.approx(_output_sqnr(folder, alone, data), abs=0.01)
    # and so the top row is the layer to raise: the model with it float is much the better
    assert _output_sqnr(folder, tmp_path / f"{second}_float.onnx", data) > (
        _output_sqnr(folder, tmp_path / f"{first}_float.onnx", data) + 10)

    text = format_analysis(analysis)
    assert "by output dB, the SQNR of the model's first output on the first 32 samples with only that layer quantized" in text
    header = next(line for line in text.splitlines() if "alone dB" in line).split()
    assert header[2:] == ["output", "dB", "alone", "dB", "w/", "prefix", "dB", "ch", "noise", "cosine"]


def test_analyze_and_the_search_rank_alike(masked):
    """One rule: the search's ranking (emitted from its calibrated state) and analyze's
    (from the written model) put the layers in the same order, with the same noise."""
    from onnxq.evaluate import deployed_session
    from onnxq.pipeline.run import run_pipeline
    from onnxq.search.driver import sensitivity_order
    from onnxq.search.target import EvalSet

    folder, overrides, calib, data, first, second = masked
    config = compose_config("U8S8", None, overrides)
    base = run_pipeline(str(folder / "m.onnx"), None, config, calib, False, keep_state=True)
    float_session = deployed_session(base.state.float_model, ["CPUExecutionProvider"])
    searched = sensitivity_order(base, config, EvalSet(data, None, None), float_session, "float", False)
    analysed = analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False).layers
    assert [n for n, _ in searched] == [r.name for r in analysed] == [second, first]
    for (_, noise), row in zip(searched, analysed, strict=True):
        assert -10 * np.log10(noise) == pytest.approx(row.output_sqnr_db, abs=0.01)


def test_without_the_output_ranking_layers_keep_their_channels_order(masked):
    """The search's own pass (layers_only) and data that can be read once keep the order of
    the channels' noise, and say which order it is."""
    folder, _, _, data, first, second = masked
    quick = analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False, layers_only=True)
    assert [r.name for r in quick.layers] == [first, second]
    assert all(r.output_sqnr_db is None for r in quick.layers)

    once = (dict(feed) for feed in [{k: v[i:i + 8] for k, v in data.items()} for i in range(0, 48, 8)])
    analysis = analyze_models(folder / "m.onnx", folder / "q.onnx", once, progress=False)
    assert [r.name for r in analysis.layers] == [first, second]
    assert any("can be read only once" in n for n in analysis.notes)
    assert "by ch noise, the mean over output channels" in format_analysis(analysis)


def test_the_ranking_reads_fewer_samples_where_the_output_is_large(masked, monkeypatch):
    """An LLM's logits are 50 MB a window: past IMPACT_OUTPUT_BYTES the ranking stops
    reading batches (here at the first: 8 samples), and its figures are those samples'."""
    import onnxq.analyze.analysis as analysis_module

    folder, overrides, calib, data, first, second = masked
    monkeypatch.setattr(analysis_module, "IMPACT_OUTPUT_BYTES", 1)
    rows = {r.name: r for r in analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False).layers}
    first_batch = {k: v[:8] for k, v in data.items()}  # analyze's batch
    alone = folder / "second_only.onnx"
    quantize(folder / "m.onnx", alone, compose_config("U8S8", None, {**overrides, "exclude": [first]}), calib,
             progress=False)
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, first_batch)[0]
            for p in (folder / "m.onnx", alone)]
    assert rows[second].output_sqnr_db == pytest.approx(sqnr_db(*outs), abs=0.01)
    assert rows[second].output_sqnr_db != pytest.approx(_output_sqnr(folder, alone, data), abs=0.01)


def test_rank_noise_skips_the_output_runs_and_a_bad_rank_is_one_line(masked, capsys):
    """`--rank noise` (rank="noise") keeps the channels' order without a model per layer;
    an unknown rank is refused by name, from Python and from the CLI (exit 2)."""
    from onnxq.cli import main

    folder, _, _, data, first, second = masked
    quick = analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False, rank="noise")
    assert [r.name for r in quick.layers] == [first, second]
    assert all(r.output_sqnr_db is None for r in quick.layers)
    with pytest.raises(ValueError, match="rank must be one of output, noise, got 'loss'"):
        analyze_models(folder / "m.onnx", folder / "q.onnx", data, progress=False, rank="loss")
    np.savez(folder / "d.npz", **data)
    assert main(["analyze", str(folder / "m.onnx"), str(folder / "q.onnx"), "--data", str(folder / "d.npz"),
                 "--rank", "noise", "--quiet"]) == 0
    assert "by ch noise" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", str(folder / "m.onnx"), str(folder / "q.onnx"), "--data", str(folder / "d.npz"),
              "--rank", "loss"])
    assert exit_info.value.code == 2 and "invalid choice: 'loss'" in capsys.readouterr().err


def test_layers_rescaled_by_cle_are_not_ranked_by_a_rescaling(tmp_path):
    """After CLE a layer's quantized weights are rescaled against the float model's; with
    only it quantized, the float model measures that rescaling (digits CNN: conv3 alone
    11.6 dB in a model at 39 dB). Such layers leave the output ranking, named in a note;
    the layers measured stay within reach of the whole model's figure."""
    from pathlib import Path

    models = Path(__file__).resolve().parents[1] / "models"
    out = tmp_path / "cle.onnx"
    quantize(models / "digits_cnn.onnx", out, compose_config("U8S8", None, {"pre_quant_opt_config": [{"name": "cle"}]}),
             str(models / "digits_calib.npz"), progress=False)
    data = dict(np.load(models / "digits_eval.npz"))
    data.pop("labels", None)
    analysis = analyze_models(models / "digits_cnn.onnx", out, {k: v[:64] for k, v in data.items()}, progress=False)
    whole = analysis.outputs[0].sqnr_db
    measured = [r for r in analysis.layers if r.output_sqnr_db is not None]
    assert measured and all(r.output_sqnr_db >= whole - 6.0 for r in measured)
    note = next(n for n in analysis.notes if "far worse alone than the whole model" in n)
    dropped = [r.name for r in analysis.layers if r.output_sqnr_db is None]
    assert dropped and all(name in note for name in dropped[:3])
    assert [r.name for r in analysis.layers[:len(measured)]] == [r.name for r in measured]


def test_a_rescaled_layer_worse_alone_than_its_output_is_not_ranked():
    """MobileNet-v1 XINT8 after CLE, analysed against the user's float model: a rescaled
    layer ranked first at output 5.6 dB (the whole model 10.8: inside the 6 dB margin) and
    alone -41 dB, the rescaling measured; keeping it float gained 0.05 dB (trust trial). A
    rescaled layer whose own error exceeds its output is moved among the unmeasured; an
    unrescaled one with the same figures keeps its rank (a wiped-out layer is real)."""
    from onnxq.analyze.analysis import LayerReport, _consistent

    def layer(name: str, output_db: float, own_db: float) -> LayerReport:
        return LayerReport(name, "Conv", own_db, 0.1, 1.0, None, None, 1.0, 1.0, output_db)

    reports = [layer("body.36", 5.6, -41.2), layer("body.22", 9.0, 20.0), layer("wiped", 7.0, -3.0)]
    kept, dropped = _consistent(reports, 10.8, {"body.36", "body.22"})
    assert dropped == ["body.36"] and [r.name for r in kept][:2] == ["body.22", "wiped"]


def test_a_scalar_first_output_is_ranked_and_its_samples_counted(tmp_path):
    """The ranking's sample count read the first output's length, which a scalar output
    has none of (review): counted from the inputs fed."""
    b = GraphBuilder(0)
    x = b.input("x", ["N", 16])
    h = b.matmul(b.node("Relu", [b.matmul(x, 16, 32)]), 32, 16)
    path = tmp_path / "m.onnx"
    onnx.save(b.build([b.node("ReduceSum", [h], keepdims=0), h]), path)
    data = {"x": np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)}
    quantize(str(path), str(tmp_path / "q.onnx"), None, data, progress=False)
    analysis = analyze_models(str(path), str(tmp_path / "q.onnx"), data, progress=False)
    assert analysis.ranked_samples == 32 and all(r.output_sqnr_db is not None for r in analysis.layers)
