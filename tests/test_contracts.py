"""What the pipeline reads from a registered contract, not from a name: a plugin's own
algorithm gets its CLI flag and its place among `--algorithm`'s choices; a pass or
algorithm that hands back the wrong thing is a one-line error naming it; a stage that
needs another read of data read once says why, then the fix."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, cosine, random_feeds, run

import onnxq
from onnxq.cli import main
from onnxq.config.compose import compose_config
from onnxq.errors import CalibrationDataError, OnnxqError
from onnxq.notes import Topic, of
from onnxq.optimize import ALGORITHMS, CONTRACTS, PASSES

PLUGIN = '''
from dataclasses import dataclass
from onnxq.optimize import register_algorithm


@dataclass(frozen=True)
class CountOptions:
    op_types: tuple = ("Conv",)


@register_algorithm("count_layers_toy", options=CountOptions, data="none", flag=9,
                    flag_help="count the layers (a toy)")
def count_layers(model, plan, ranges, options, ctx):
    n = sum(1 for op in plan.quantized_nodes.values() if op in options.op_types)
    return f"{n} quantized {'/'.join(options.op_types)} layers"


@register_algorithm("round_blocks_toy", options=CountOptions, data="none", rounds_blocks=True)
def round_blocks(model, plan, ranges, options, ctx):
    return "rounded nothing"
'''


def conv_model() -> onnx.ModelProto:
    b = GraphBuilder(21)
    x = b.input("x", ["N", 3, 8, 8])
    y = b.conv(b.node("Relu", [b.conv(x, 3, 4, 3)]), 4, 5, 1)
    return b.build([y], name="contracts")


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "count_plugin.py"
    path.write_text(PLUGIN)
    yield str(path)
    for name in ("count_layers_toy", "round_blocks_toy"):
        ALGORITHMS.pop(name, None)
        CONTRACTS.pop(name, None)


def test_a_plugin_algorithm_gets_its_flag_from_its_contract(tmp_path, plugin, capsys):
    model = tmp_path / "m.onnx"
    onnx.save(conv_model(), model)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=random_feeds(conv_model(), 16, seed=1)[0]["x"])
    out = tmp_path / "q.onnx"
    argv = ["quantize", str(model), str(out), "--calib-data", str(calib), "--bias-correction", "--count-layers-toy",
            "--save-config",
            str(tmp_path / "used.yaml")]
    assert main(["--plugin", plugin, *argv]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "note: count_layers_toy: 2 quantized Conv layers" in printed
    # Its entry comes before bias correction (given first), whose contract runs it last.
    used = (tmp_path / "used.yaml").read_text()
    assert used.index("count_layers_toy") < used.index("bias_correction")
    onnx.checker.check_model(str(out), full_check=True)
    feeds = random_feeds(conv_model(), 4, seed=2)
    assert cosine(run(conv_model(), feeds), run(str(out), feeds)) > 0.999
    # One that rounds weight-only blocks is among --algorithm's choices, and refused where
    # the recipe lowers no MatMul to MatMulNBits (it would round nothing)
    with pytest.raises(SystemExit):
        main(["--plugin", plugin, "quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--count-layers-toy count the layers (a toy)" in text
    assert "--algorithm {rtn,gptq,awq,hqq,round_blocks_toy}" in text
    assert main(["--plugin", plugin, "quantize", str(model), str(tmp_path / "r.onnx"), "--calib-data", str(calib),
                 "--algorithm", "round_blocks_toy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onnxq: error: --algorithm round_blocks_toy rounds the weight-only blocks of MatMulNBits") \
        and err.endswith("or remove --algorithm round_blocks_toy") and "\n" not in err  # the flag given, not algo_config


def test_the_help_lists_the_algorithm_flags_in_flag_order(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    text = capsys.readouterr().out
    flags = ["--bias-correction", "--adaround", "--adaquant", "--gptq", "--awq"]
    assert [text.index(f"  {flag} ") for flag in flags] == sorted(text.index(f"  {flag} ") for flag in flags)


def _with_pass(returns: str) -> onnxq.Config:
    config = onnxq.get_preset("U8S8")
    config.pre_quant_opt_config = [{"name": "returns_wrong_toy"}]
    exec(f"from onnxq.optimize import register_pass\n@register_pass('returns_wrong_toy')\n"
         f"def wrong(model, options, ctx):\n    return {returns}\n", {})
    return config


@pytest.mark.parametrize("returns, says", [
    ("None", "pass returns_wrong_toy returned NoneType; a pass returns its report line"),
    ("__import__('onnxq.optimize.context').optimize.context.PassResult('x', deferred=object())",
     "pass returns_wrong_toy deferred its second half where it may not"),
])
def test_a_pass_handing_back_the_wrong_thing_is_named(returns, says):
    config = _with_pass(returns)
    config.pre_quant_opt_config.append({"name": "fold_batchnorm"})  # not the last pass: it may not defer
    try:
        with pytest.raises(OnnxqError, match=says):
            onnxq.quantize(conv_model(), None, config, random_feeds(conv_model(), 8, seed=3), progress=False)
    finally:
        PASSES.pop("returns_wrong_toy", None)
        CONTRACTS.pop("returns_wrong_toy", None)


def test_data_read_once_refusals_say_why_then_the_fix():
    feeds = iter([{"x": f["x"]} for f in random_feeds(conv_model(), 8, seed=4)])
    config = compose_config("U8S8", None, {"algo_config": [{"name": "adaround"}]})
    result = onnxq.quantize(conv_model(), None, config, feeds, progress=False)
    (skipped,) = of(result.summary.notes, Topic.SKIPPED, "adaround")
    assert skipped.text == ("adaround: skipped: the calibration data can be read only once; pass a path, a dict of "
                            "arrays, a list of feeds or a reader with rewind()")
    (target,) = of(result.summary.notes, Topic.TARGET, "bias_correction")
    assert target.text.startswith("target ") and "adds bias_correction" in target.text
    with pytest.raises(CalibrationDataError, match=r"more than once, but generator data can be read only once; "
                                                   r"pass a path"):
        onnxq.quantize(conv_model(), None, compose_config("U8S8", None, {"mixed_precision": {"target": "sqnr>=20"}}),
                       (f for f in random_feeds(conv_model(), 8, seed=5)), progress=False)


def test_one_algorithm_learns_the_rounding(tmp_path, capsys):
    """A preset with AdaRound under a source that asks for AdaQuant: both learn the same
    layers' rounding, and the two results disagree (MobileNet-v1's logits fell to -2.8 dB
    SQNR). The higher source's choice replaces the preset's, as any setting does; two in
    one source are a choice left to make, refused alike from flags, a file or a dict."""
    from pathlib import Path

    models = Path(__file__).resolve().parent.parent / "models"
    assert CONTRACTS["adaround"].learns_rounding and CONTRACTS["adaquant"].learns_rounding
    config = compose_config("W4A8", None, {"algo_config": [{"name": "adaquant", "num_iteration": 50}]})
    assert [e["name"] for e in config.algo_config] == ["adaquant"]
    result = onnxq.quantize(str(models / "digits_cnn.onnx"), tmp_path / "q.onnx", config,
                            str(models / "digits_calib.npz"), progress=False)
    said = " ".join(result.summary.note_texts)
    assert "adaround:" not in said and "adaquant:" in said  # only AdaQuant reports layers
    assert result.summary.fidelity.sqnr_db > 30  # 33.7 dB measured; the two stacked gave 27.2
    onnx.checker.check_model(str(tmp_path / "q.onnx"))
    two = [{"name": "adaround"}, {"name": "adaquant"}]
    with pytest.raises(OnnxqError, match=r"^overrides: adaround and adaquant in algo_config both learn the layers' rounding, "
                                         r"and one would undo the other; give one \(remove the other entry"):
        compose_config("U8S8", None, {"algo_config": two})
    (tmp_path / "two.yaml").write_text("algo_config: [{name: adaround}, {name: adaquant}]\n")
    for argv in (["--adaround", "--adaquant"], ["--config", str(tmp_path / "two.yaml")]):
        assert main(["quantize", str(models / "digits_cnn.onnx"), str(tmp_path / "two.onnx"), "--calib-data",
                     str(models / "digits_calib.npz"), *argv]) == 2
        assert not (tmp_path / "two.onnx").exists()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("onnxq: error: --adaround and --adaquant both learn the layers' rounding, and one would "
                      "undo the other; give one")
    assert err[1].startswith("onnxq: error: ") and "two.yaml: adaround and adaquant in algo_config both learn" in err[1]
    with pytest.raises(OnnxqError, match="algo_config lists adaround twice"):  # one entry per algorithm
        compose_config("U8S8", None, {"algo_config": [*two, {"name": "adaround", "enabled": True}]})
    assert [e.get("enabled", True) for e in compose_config(
        "U8S8", None, {"algo_config": [{"name": "adaround", "enabled": False}, {"name": "adaquant"}]}).algo_config] \
        == [False, True]
