"""One precedence rule for every config source, and AMCT's simplified config (issue 16).

preset < config file or Python dict < explicit flags or arguments; within each source,
node > op type > global. An AMCT `.cfg` is one more kind of config file: it must resolve,
node by node, to the same config as the onnxq YAML a user would write by hand.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

import onnxq
from onnxq.cli import main
from onnxq.config import (
    compose_config,
    config_to_dict,
    load_config,
    resolve_node_config,
)
from onnxq.config.io import config_from_dict
from onnxq.errors import ConfigError
from onnxq.quantize import calibrate_shard

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "models" / "digits_cnn.onnx"
SHARED = ROOT.parent / "shared"


# ---------------------------------------------------------------------------------------
# precedence


def test_flag_beats_the_presets_op_type_setting():
    """`--per-group 32` over W4_GROUP128 (MatMul at 128): MatMul gets 32, keeps int4."""
    flags = {"global_quant_config": {"weight": {"qscheme": "per_group", "group_size": 32}}}
    config = compose_config("W4_GROUP128", None, flags)
    matmul = resolve_node_config(config, "mm", "MatMul")
    assert matmul.weight.group_size == 32
    assert matmul.weight.dtype.value == "int4"


def test_a_flag_that_leaves_per_group_takes_the_presets_blocks_with_it():
    """`--per-tensor` over W4_GROUP128: MatMul per tensor, its 128-wide blocks gone (a
    group size without per_group would be an invalid config)."""
    config = compose_config("W4_GROUP128", None, {"global_quant_config": {"weight": {"qscheme": "per_tensor"}}})
    matmul = resolve_node_config(config, "mm", "MatMul")
    assert matmul.weight.qscheme == "per_tensor" and matmul.weight.group_size is None
    assert matmul.weight.dtype.value == "int4"


def test_a_flag_that_leaves_per_group_drops_a_files_global_group_size():
    file_layer = {"global_quant_config": {"weight": {"qscheme": "per_group", "group_size": 32}}}
    flags = {"global_quant_config": {"weight": {"qscheme": "per_channel"}}}
    from onnxq.config.compose import overlay

    merged = overlay(overlay({}, file_layer), flags)
    assert merged["global_quant_config"]["weight"] == {"qscheme": "per_channel"}


def test_float16_weights_are_judged_where_a_node_resolves():
    """A node's float16 weight over its op type's float16 inputs is a whole float16 op
    (valid); over the global uint8 inputs it is a mix no kernel computes (refused, per node)."""
    from onnxq.config.validate import validate_node_configs

    base = {"layer_quant_config": {"mm1": {"weight": {"dtype": "float16"}}}}
    fp16_inputs = {"layer_type_quant_config": {"MatMul": {"input_tensors": {"dtype": "float16"},
                                                          "output_tensors": {"dtype": "float16"}}}}
    validate_node_configs(compose_config("U8S8", None, {**base, **fp16_inputs}), [("mm1", "MatMul")])
    with pytest.raises(ConfigError, match="weight dtype float16 with uint8 input_tensors in node 'mm1'"):
        validate_node_configs(compose_config("U8S8", None, base), [("mm1", "MatMul")])


def test_activation_fields_do_not_make_a_weight_only_recipe_static(tmp_path, capsys):
    """`--calib-method percentile` over W4_GROUP128 (no activation spec) would merge into a
    uint8 spec and drop MatMulNBits: it is a one-line error naming the flag (exit 2), from a
    dict too; `--scale-type`, which writes the weights as well, applies to them alone; with
    an activation dtype the fields apply."""
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(DIGITS), str(out), "--preset", "W4_GROUP128", "--calib-method", "percentile"]) == 2
    err = capsys.readouterr().err
    assert "--calib-method percentile has no activations to apply to" in err and "such as U8S8" in err
    assert not out.exists()
    given = {"preset": "W4_GROUP128", "global_quant_config": {"output_tensors": {"num_bins": 512}}}
    with pytest.raises(ConfigError, match="num_bins 512 has no activations to apply to in global_quant_config.output"):
        compose_config(None, None, given)
    assert given["global_quant_config"] == {"output_tensors": {"num_bins": 512}}  # the caller's dict as given
    scaled = compose_config("W4_GROUP128", None, {"global_quant_config": {
        "input_tensors": {"scale_type": "float16"}, "output_tensors": {"scale_type": "float16"},
        "weight": {"scale_type": "float16"}}})
    assert scaled.global_quant_config.input_tensors is None and scaled.global_quant_config.weight.scale_type
    static = compose_config("W4_GROUP128", None, {"global_quant_config": {
        "input_tensors": {"dtype": "uint8", "calib_method": "percentile"}}})
    assert static.global_quant_config.input_tensors.calib_method.value == "percentile"


def test_cli_per_group_beats_the_preset(tmp_path, capsys):
    out = tmp_path / "show.yaml"
    assert main(["config", "show", "--preset", "W4_GROUP128", "--per-group", "32"]) == 0
    out.write_text(capsys.readouterr().out)
    config = load_config(out)
    assert resolve_node_config(config, "mm", "MatMul").weight.group_size == 32


def test_flags_do_not_unfloat_what_a_preset_keeps_float():
    """W8_DYNAMIC keeps Conv float; a weight-type flag changes how, not which, tensors are quantized."""
    config = compose_config("W8_DYNAMIC", None, {"global_quant_config": {"weight": {"dtype": "uint8"}}})
    assert resolve_node_config(config, "conv", "Conv").weight is None
    assert resolve_node_config(config, "mm", "MatMul").weight.dtype.value == "uint8"


def test_python_dict_is_overrides_on_the_default_preset():
    config = onnxq.as_config({"global_quant_config": {"weight": {"qscheme": "per_tensor"}}})
    resolved = resolve_node_config(config, "conv", "Conv")
    assert resolved.input_tensors.dtype.value == "uint8"  # from U8S8
    assert resolved.weight.qscheme == "per_tensor"


def test_preset_key_in_a_dict_or_file_and_the_explicit_preset_wins(tmp_path):
    assert onnxq.as_config({"preset": "s8s8"}) == onnxq.get_preset("S8S8")
    path = tmp_path / "c.yaml"
    path.write_text("preset: S8S8\ncalibration: {max_samples: 5}\n")
    from_file = load_config(path)
    assert from_file.global_quant_config.input_tensors.dtype.value == "int8"
    assert from_file.calibration.max_samples == 5
    explicit = compose_config("U8S8", path)
    assert explicit.global_quant_config.input_tensors.dtype.value == "uint8"
    assert explicit.calibration.max_samples == 5


def test_written_configs_read_back_exactly(tmp_path):
    config = compose_config("XINT8", None, {"exclude": ["fc"]})
    path = tmp_path / "saved.yaml"
    onnxq.config.save_config(config, path)
    assert yaml.safe_load(path.read_text())["preset"] == "none"
    assert load_config(path) == config


def test_typed_pass_configs_round_trip():
    config = onnxq.as_config({"pre_quant_opt_config": [onnxq.CLEConfig(steps=5)],
                              "algo_config": [onnxq.BiasCorrectionConfig(op_types=("Conv",))]})
    assert config.pre_quant_opt_config[0]["name"] == "cle" and config.pre_quant_opt_config[0]["steps"] == 5
    assert config.algo_config[0]["op_types"] == ["Conv"]
    again = config_from_dict(yaml.safe_load(onnxq.config.config_to_yaml(config)))
    assert again == config


def test_pass_in_the_wrong_list_names_the_right_one():
    with pytest.raises(ConfigError, match="cle belongs in pre_quant_opt_config"):
        from onnxq.optimize import check_config_entries

        check_config_entries([], [config_to_dict(onnxq.CLEConfig()) | {"name": "cle"}])


# ---------------------------------------------------------------------------------------
# AMCT


AMCT_CFG = """
# uniform quantization: ARQ 7-bit per channel, IFMR, skip layers and overrides
batch_num : 2
activation_offset : true
skip_layers : "conv1"
do_fusion : true
common_config : {
    arq_quantize : {
        channel_wise : true
        quant_bits : 7
    }
    ifmr_quantize : {
        search_range_start : 0.7
        search_range_end : 1.3
        search_step : 0.01
        max_percentile : 0.999999
        min_percentile : 0.999999
        asymmetric : true
    }
}
override_layer_types : {
    layer_type : "Gemm"
    calibration_config : {
        arq_quantize : { channel_wise : false }
        ifmr_quantize : {
            search_range_start : 0.8
            search_range_end : 1.2
            search_step : 0.02
            asymmetric : false
        }
    }
}
override_layer_configs : {
    layer_name : "conv3"
    calibration_config : {
        hfmg_quantize : { num_of_bins : 4096 }
    }
}
"""

# What a user would write in onnxq's own format for the same decisions.
HAND_WRITTEN = """
global_quant_config:
  input_tensors: &act
    dtype: uint8
    symmetric: false
    calib_method: ifmr
    calib_options: {search_range_start: 0.7, search_range_end: 1.3, search_step: 0.01,
                    max_percentile: 0.999999, min_percentile: 0.999999}
  output_tensors: *act
  weight: {dtype: int8, symmetric: true, qscheme: per_channel, calib_method: minmax}
layer_type_quant_config:
  Conv:
    weight: {bits: 7}
  Gemm:
    input_tensors: &gemm
      dtype: int8
      symmetric: true
      calib_method: ifmr
      calib_options: {search_range_start: 0.8, search_range_end: 1.2, search_step: 0.02}
    output_tensors: *gemm
    weight: {qscheme: per_tensor, calib_method: minmax}
layer_quant_config:
  conv3:
    input_tensors: {calib_method: hfmg, calib_options: {num_of_bins: 4096}}
    output_tensors: {calib_method: hfmg, calib_options: {num_of_bins: 4096}}
exclude: [conv1]
calibration: {max_batches: 2}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _nodes(model_path: Path) -> list[tuple[str, str]]:
    return [(n.name, n.op_type) for n in onnx.load(str(model_path), load_external_data=False).graph.node]


def _same_decisions(a: onnxq.Config, b: onnxq.Config, model_path: Path) -> None:
    for name, op_type in _nodes(model_path):
        assert resolve_node_config(a, name, op_type) == resolve_node_config(b, name, op_type), name
    assert a.calibration == b.calibration and a.algo_config == b.algo_config
    assert a.pre_quant_opt_config == b.pre_quant_opt_config


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_amct_config_resolves_like_the_hand_written_one(tmp_path):
    amct = load_config(_write(tmp_path, "quant.cfg", AMCT_CFG))
    hand = load_config(_write(tmp_path, "quant.yaml", HAND_WRITTEN))
    _same_decisions(amct, hand, DIGITS)
    assert resolve_node_config(amct, "conv1", "Conv") is None  # skip_layers
    assert resolve_node_config(amct, "conv2", "Conv").weight.bits == 7
    assert resolve_node_config(amct, "fc", "Gemm").weight.bits is None  # 7 bits: Conv only, as in AMCT
    assert resolve_node_config(amct, "fc", "Gemm").input_tensors.dtype.value == "int8"


def test_amct_config_quantizes_the_bundled_model_like_the_hand_written_one(tmp_path):
    cfg, hand = _write(tmp_path, "quant.cfg", AMCT_CFG), _write(tmp_path, "quant.yaml", HAND_WRITTEN)
    outs = []
    for config in (cfg, hand):
        out = tmp_path / f"{config.suffix[1:]}.onnx"
        assert main(["quantize", str(DIGITS), str(out), "--config", str(config), "--calib-data",
                     str(ROOT / "models" / "digits_calib.npz"), "--quiet"]) == 0
        outs.append(out)
    assert _digest(outs[0]) == _digest(outs[1])
    onnx.checker.check_model(str(outs[0]))


@pytest.mark.skipif(not (SHARED / "models" / "resnet20_cifar10.onnx").is_file(), reason="no ../shared models")
def test_amct_config_on_a_shared_model(tmp_path):
    model = SHARED / "models" / "resnet20_cifar10.onnx"
    images = np.load(SHARED / "data" / "cifar10_test2000" / "images_u8_nhwc.npy", mmap_mode="r")[:16]
    x = (images.astype(np.float32) / 255 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    data = tmp_path / "calib.npz"
    np.savez(data, input=x.transpose(0, 3, 1, 2).astype(np.float32))
    names = {"conv1": "/conv1/Conv", "conv3": "/layer2/layer2.0/conv1/Conv"}
    cfg_text, hand_text = AMCT_CFG, HAND_WRITTEN
    for short, full in names.items():
        cfg_text = cfg_text.replace(f'"{short}"', f'"{full}"')
        hand_text = hand_text.replace(f"  {short}:", f"  {full}:").replace(f"[{short}]", f"['{full}']")
    cfg, hand = _write(tmp_path, "quant.cfg", cfg_text), _write(tmp_path, "quant.yaml", hand_text)
    _same_decisions(load_config(cfg), load_config(hand), model)
    outs = []
    for config in (cfg, hand):
        out = tmp_path / f"{config.suffix[1:]}.onnx"
        assert main(["quantize", str(model), str(out), "--config", str(config), "--calib-data", str(data),
                     "--quiet"]) == 0
        outs.append(out)
    assert _digest(outs[0]) == _digest(outs[1])


@pytest.mark.parametrize(("text", "words"), [
    ("common_config { nuq_quantize { num_steps: 32 } }", ("line 1", "nuq_quantize", "non-uniform")),
    ("enable_auto_nuq: true", ("enable_auto_nuq", "NUQ")),
    ("joint_quant: true", ("joint_quant", "no onnxq counterpart")),
    ("fakequant_precision_mode: DEFALT", ("line 1", "fakequant_precision_mode DEFALT; did you mean DEFAULT?")),
    ("fakequant_precision_mode: FORCE_FP16_QUANT", ("FORCE_FP16_QUANT has no onnxq counterpart",)),
    ("common_config {\n  arq_quantize { chanel_wise: true }\n}", ("line 2", "chanel_wise", "did you mean 'channel_wise'")),
    ("common_config { ifmr_quantize { search_step: fast } }", ("search_step must be a number",)),
    ("common_config {\n  arq_quantize { channel_wise: true }\n", ("never closed",)),
    ("override_layer_configs { layer_name: 'a' calibration_config { dmq_balancer { migration_strength: 0.5 } } }",
     ("dmq_balancer in override_layer_configs",)),
    ("skip_layer_types: 'Conv'\noverride_layer_types { layer_type: 'Conv' calibration_config { } }",
     ("both in skip_layer_types and override_layer_types",)),
])
def test_amct_config_errors_are_one_line_with_exit_2(tmp_path, text, words):
    cfg = _write(tmp_path, "bad.cfg", text)
    out = tmp_path / "out.onnx"
    proc = subprocess.run([sys.executable, "-m", "onnxq", "quantize", str(DIGITS), str(out), "--config", str(cfg),
                           "--calib-data", str(ROOT / "models" / "digits_calib.npz")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cfg) in lines[0], proc.stderr
    for word in words:
        assert word in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(("text", "says"), [
    ('skip_layers : "conv9"\n', "bad.cfg: skip_layers entry 'conv9' matches no node of the model; did you mean 'conv3'?"),
    ('override_layer_configs {\n layer_name : "conv9"\n calibration_config { arq_quantize { channel_wise : true } }\n}\n',
     "bad.cfg: layer_name 'conv9' is no node of the model; did you mean 'conv3'?"),
])
def test_amct_node_names_are_refused_in_the_files_words(tmp_path, capsys, text, says):
    """A node the AMCT file names that the model lacks was refused in onnxq's words
    ("exclude entry 'conv9'", "layer_quant_config names 'conv9'"), which the file never
    says (configuration trial)."""
    cfg = _write(tmp_path, "bad.cfg", text)
    assert main(["quantize", str(DIGITS), str(tmp_path / "o.onnx"), "--config", str(cfg), "--calib-data",
                 str(ROOT / "models" / "digits_calib.npz")]) == 2
    assert says in capsys.readouterr().err
    # a name the command line gave keeps onnxq's words (the file did not say it)
    good = _write(tmp_path, "good.cfg", 'skip_layers : "conv1"\n')
    assert main(["quantize", str(DIGITS), str(tmp_path / "o.onnx"), "--config", str(good), "--calib-data",
                 str(ROOT / "models" / "digits_calib.npz"), "--exclude", "conv8"]) == 2
    err = capsys.readouterr().err
    assert "exclude entry 'conv8'" in err and "good.cfg" not in err, err


def test_amct_algorithms_map_to_onnxq_entries(tmp_path):
    text = """
    do_fusion: false
    common_config {
      arq_quantize { channel_wise: true }
      dmq_balancer { migration_strength: 0.6 }
    }
    override_layer_types { layer_type: "Conv"
      calibration_config { ada_quantize { num_iteration: 50 reg_param: 0.02 channel_wise: false } } }
    override_layer_configs { layer_name: "conv2"
      calibration_config { arq_quantize { channel_wise: true } } }
    override_layer_configs { layer_name: "fc"
      calibration_config { ada_quantize { num_iteration: 50 reg_param: 0.02 } weight_compress_only: true } }
    """
    config = load_config(_write(tmp_path, "algos.cfg", text))
    assert config.pre_quant_opt_config == [{"name": "fold_batchnorm", "enabled": False},
                                           {"name": "smoothquant", "migration_strength": 0.6}]
    assert config.algo_config == [{"name": "adaround", "num_iteration": 50, "reg_param": 0.02,
                                   "op_types": ["Conv"], "layers": ["fc"], "skip_layers": ["conv2"]}]
    assert resolve_node_config(config, "conv1", "Conv").weight.qscheme == "per_tensor"
    assert resolve_node_config(config, "conv2", "Conv").weight.qscheme == "per_channel"
    fc = resolve_node_config(config, "fc", "Gemm")
    assert fc.input_tensors is None and fc.weight is not None  # weight_compress_only


def test_config_convert_and_show(tmp_path, capsys):
    cfg = _write(tmp_path, "quant.cfg", AMCT_CFG)
    out = tmp_path / "quant.yaml"
    assert main(["config", "convert", str(cfg), str(out)]) == 0
    assert load_config(out) == load_config(cfg)
    capsys.readouterr()
    assert main(["config", "show", "--config", str(cfg)]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(out.read_text())
    assert main(["config", "convert", str(cfg), str(cfg)]) == 2
    assert "overwrite its input" in capsys.readouterr().err


def test_unknown_calib_option_is_refused_by_every_route(tmp_path, capsys):
    """`config show`, `config convert` and `load_config` refuse what `quantize` refuses
    (an unknown option of the calibration method), naming the valid ones."""
    path = tmp_path / "bad.yaml"
    path.write_text("global_quant_config:\n  input_tensors:\n    calib_method: hfmg\n"
                    "    calib_options: {bogus: 1}\n")
    assert main(["config", "show", "--calib-method", "hfmg", "--calib-option", "bogus=1"]) == 2
    assert "unknown calib option 'bogus' for method 'hfmg'" in capsys.readouterr().err
    assert main(["config", "convert", str(path), str(tmp_path / "bad.json")]) == 2
    assert "valid options: num_of_bins, asymmetric" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="bogus"):
        onnxq.load_config(path)


@pytest.mark.parametrize(("text", "flags", "message"), [
    ("algo_config: [{name: adarond}]\n", [], "unknown algo_config algorithm 'adarond'; did you mean 'adaround'?"),
    ("pre_quant_opt_config: [{name: cel}]\n", [], "unknown pre_quant_opt_config pass 'cel'; did you mean 'cle'?"),
    ("pre_quant_opt_config: [{name: smoothquant, alpha: 1.5}]\n", [], "alpha must be in [0, 1], got 1.5"),
    ("", ["--adaround", "--algo-option", "num_iterations=5"], "unknown option 'num_iterations'; did you mean "
                                                            "'num_iteration'?"),
    ("", ["--smoothquant", "1.5"], "alpha must be in [0, 1], got 1.5"),
    ("", ["--gptq"], "--gptq rounds the weight-only blocks of MatMulNBits"),
])
def test_passes_and_algorithms_are_refused_by_every_route(tmp_path, capsys, text, flags, message):
    """`config show`, `config convert` and `compose_config` refuse the passes and algorithms
    (names, options) that `quantize` refuses, with the same one line and status 2."""
    path = tmp_path / "bad.yaml"
    path.write_text(text or "{}\n")
    data = str(ROOT / "models" / "digits_calib.npz")
    for argv in (["config", "show", "--config", str(path), *flags],
                 ["quantize", str(DIGITS), str(tmp_path / "q.onnx"), "--calib-data", data, "--config", str(path), *flags],
                 *([["config", "convert", str(path), str(tmp_path / "out.yaml")]] if not flags else [])):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("onnxq: error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out.yaml").exists() and not (tmp_path / "q.onnx").exists()
    if text:
        with pytest.raises(ConfigError, match=re.escape(message)):
            compose_config("U8S8", path)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"layer_quant_config": {"conv3": {"input_tensors": {"percentile": 99.0}}}},
     "percentile 99.0 with calib_method minmax (inherited: the level sets none), which does not use it in "
     "layer_quant_config['conv3'].input_tensors; use calib_method percentile there, or remove percentile"),
    ({"layer_type_quant_config": {"Conv": {"input_tensors": {"num_bins": 512}}}},
     "num_bins 512 with calib_method minmax (inherited: the level sets none), which does not use it in "
     "layer_type_quant_config['Conv'].input_tensors"),
    ({"layer_type_quant_config": {"Conv": {"output_tensors": {"calib_method": "minmax", "percentile": 99.0}}}},
     "percentile 99.0 with calib_method minmax, which does not use it in layer_type_quant_config['Conv']"),
])
def test_an_override_setting_what_its_method_ignores_is_refused(overrides, message):
    """A percentile or num_bins the (inherited) method of an override ignores is refused as
    the global one is, naming the override (it was dropped without a word)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config("U8S8", None, overrides)


def test_a_node_override_is_judged_with_the_method_its_op_type_gives(tmp_path):
    """A node override may inherit its op type's method, known with the model only: the
    config alone passes, the model's Conv node (whose op type sets none) is refused."""
    overrides = {"layer_type_quant_config": {"Gemm": {"input_tensors": {"calib_method": "percentile"}}},
                 "layer_quant_config": {"fc": {"input_tensors": {"percentile": 99.0}},
                                        "conv3": {"input_tensors": {"percentile": 99.0}}}}
    compose_config("U8S8", None, overrides)  # conv3 might be a Gemm
    data = str(ROOT / "models" / "digits_calib.npz")
    with pytest.raises(ConfigError, match=re.escape("percentile 99.0 with calib_method minmax (inherited: the level "
                                                    "sets none), which does not use it in layer_quant_config['conv3']"
                                                    ".input_tensors (Conv)")):
        onnxq.quantize(str(DIGITS), None, overrides, data, progress=False)
    del overrides["layer_quant_config"]["conv3"]
    onnxq.quantize(str(DIGITS), None, overrides, data, progress=False)  # fc is a Gemm: percentile reads it


def test_a_calib_method_flag_overrides_the_files_and_drops_what_it_ignores(tmp_path, capsys):
    """`--calib-method minmax` over a file whose method is percentile: the flag wins (flags
    override the file) and the file's percentile, which minmax ignores, goes with its
    method instead of being refused; an op type's entropy bins too. What the new method
    reads stays (num_bins under percentile)."""
    pct = tmp_path / "pct.yaml"
    pct.write_text("global_quant_config:\n  input_tensors: {calib_method: percentile, percentile: 99.9}\n"
                   "  output_tensors: {calib_method: percentile, percentile: 99.9}\n")
    flag = {"global_quant_config": {tc: {"calib_method": "minmax"} for tc in ("input_tensors", "output_tensors")}}
    assert compose_config(None, pct, flag) == onnxq.get_preset("U8S8")
    data = str(ROOT / "models" / "digits_calib.npz")
    assert main(["quantize", str(DIGITS), str(tmp_path / "o.onnx"), "--calib-data", data, "--config", str(pct),
                 "--calib-method", "minmax", "--quiet"]) == 0
    assert main(["quantize", str(DIGITS), str(tmp_path / "base.onnx"), "--calib-data", data, "--quiet"]) == 0
    assert (tmp_path / "o.onnx").read_bytes() == (tmp_path / "base.onnx").read_bytes()
    bins = tmp_path / "bins.yaml"
    bins.write_text("layer_type_quant_config:\n  Conv:\n    input_tensors: {calib_method: entropy, num_bins: 512}\n")
    capsys.readouterr()
    assert main(["config", "show", "--config", str(bins), "--calib-method", "minmax"]) == 0
    conv = yaml.safe_load(capsys.readouterr().out)["layer_type_quant_config"]["Conv"]["input_tensors"]
    assert "num_bins" not in conv and "calib_method" not in conv
    assert main(["config", "show", "--config", str(bins), "--calib-method", "percentile"]) == 0
    conv = yaml.safe_load(capsys.readouterr().out)["layer_type_quant_config"]["Conv"]["input_tensors"]
    assert conv == {"num_bins": 512}  # percentile reads bins: the file's stay
    # The flags' own dead value is the user's own mistake: refused, in the flags' words
    assert main(["config", "show", "--config", str(pct), "--calib-method", "minmax", "--percentile", "99"]) == 2
    assert "--percentile 99.0 with --calib-method minmax" in capsys.readouterr().err


def test_a_saved_config_leaves_out_the_runs_output_paths(tmp_path, monkeypatch):
    """--save-config writes the config to run again: without save_ranges, which a rerun
    would write over (and beside --load-ranges of the same file, refuse)."""
    monkeypatch.chdir(tmp_path)
    data = str(ROOT / "models" / "digits_calib.npz")
    assert main(["quantize", str(DIGITS), "a.onnx", "--calib-data", data, "--save-ranges", "r.json",
                 "--save-config", "s.yaml", "--quiet"]) == 0
    assert "save_ranges" not in Path("s.yaml").read_text()
    assert main(["quantize", str(DIGITS), "b.onnx", "--calib-data", data, "--config", "s.yaml",
                 "--load-ranges", "r.json", "--quiet"]) == 0
    assert Path("a.onnx").read_bytes() == Path("b.onnx").read_bytes()


def test_relative_paths_in_a_config_file_read_against_its_folder(tmp_path, monkeypatch):
    """`calibration: {load_ranges: r8.json}` in sub/lr.yaml names sub/r8.json, as its author
    sees it, whatever the working directory; a flag's path stays relative to it. A config
    saved elsewhere keeps its paths relative to its own folder, reading back the same."""
    monkeypatch.chdir(tmp_path)
    data = str(ROOT / "models" / "digits_calib.npz")
    Path("sub").mkdir()
    assert main(["quantize", str(DIGITS), "r.onnx", "--calib-data", data, "--save-ranges", "sub/r8.json",
                 "--quiet"]) == 0
    Path("sub/lr.yaml").write_text("calibration: {load_ranges: r8.json}\n")
    config = load_config("sub/lr.yaml")
    assert Path(config.calibration.load_ranges) == Path("sub/r8.json")
    assert main(["quantize", str(DIGITS), "y.onnx", "--calib-data", data, "--config", "sub/lr.yaml", "--quiet"]) == 0
    assert compose_config(None, "sub/lr.yaml", {"calibration": {"load_ranges": "sub/r8.json"}}) == config
    Path("elsewhere").mkdir()
    onnxq.save_config(config, "elsewhere/c.yaml")
    assert "load_ranges: ../sub/r8.json" in Path("elsewhere/c.yaml").read_text()
    assert load_config("elsewhere/c.yaml") == config
    absolute = str(tmp_path / "sub" / "r8.json")
    Path("sub/abs.yaml").write_text(f"calibration: {{load_ranges: {absolute}}}\n")
    assert load_config("sub/abs.yaml").calibration.load_ranges == absolute


def test_enum_values_read_in_any_case_from_every_source(tmp_path, capsys):
    """`--format QDQ --optimize-for Accuracy --metric TOP1` mean what `quant_format: QDQ`
    and `optimize_for: Accuracy` mean in a file (and `--target X86-AVX2` on the command
    line): one normaliser (`spec.enum_text`) for every source."""
    flags = ["--format", "QDQ-Ext", "--optimize-for", "Accuracy", "--metric", "TOP1", "--accuracy-target", "float-1"]
    assert main(["config", "show", *flags]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert main(["config", "show", *(f.lower() for f in flags)]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == shown
    assert shown["quant_format"] == "qdq-ext" and shown["optimize_for"] == "accuracy"
    path = tmp_path / "c.yaml"
    path.write_text("quant_format: QDQ-EXT\noptimize_for: Accuracy\n")
    assert compose_config(None, path).quant_format == compose_config(None, None, {"quant_format": "qdq-ext"}).quant_format
    with pytest.raises(SystemExit) as exit_info:  # still a choice: a wrong one is named
        main(["config", "show", "--format", "QDQX"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'qdqx'" in capsys.readouterr().err


def test_algorithm_option_names_read_in_any_case(tmp_path, capsys):
    """An algorithm's named options (`reconstruct: Block`, `scaling: Both`) read as the
    enums do, in a file and with `--reconstruct BLOCK`; a wrong name is still refused."""
    from onnxq.errors import ConfigError
    from onnxq.optimize.registry import parse_algorithms

    def options(config):
        return [e.options for e in parse_algorithms(config.algo_config)]

    path = tmp_path / "c.yaml"
    path.write_text("preset: W4A8\nalgo_config: [{name: adaround, reconstruct: Block}]\n")
    assert main(["config", "show", "--config", str(path)]) == 0
    assert main(["config", "show", "--preset", "W4A8", "--reconstruct", "BLOCK"]) == 0
    assert "block" in capsys.readouterr().out
    from_file = options(compose_config(None, path))
    assert [o.reconstruct for o in from_file] == ["block"]
    assert from_file == options(compose_config("W4A8", None, {"algo_config": [{"name": "adaround",
                                                                                "reconstruct": "block"}]}))
    assert [o.scaling for o in options(compose_config("W4_GROUP128", None, {"algo_config": [
        {"name": "awq", "scaling": "Both"}]}))] == ["both"]
    with pytest.raises(ConfigError, match="reconstruct"):
        compose_config("W4A8", None, {"algo_config": [{"name": "adaround", "reconstruct": "Blocks"}]})


def test_opset_and_no_matmul_nbits_flags(tmp_path, capsys):
    """`opset: 21` and `matmul_nbits: false` work in a file: `--opset 21` and
    `--no-matmul-nbits` say the same on the command line, are listed in --help, and round
    trip through `config show` and `--save-config`."""
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--opset N" in text and "--matmul-nbits, --no-matmul-nbits" in text
    flags = ["--preset", "W4_GROUP128", "--no-matmul-nbits", "--opset", "21"]
    path = tmp_path / "f.yaml"
    path.write_text("preset: W4_GROUP128\nmatmul_nbits: false\nopset: 21\n")
    assert main(["config", "show", *flags]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["opset"] == 21 and shown["matmul_nbits"] is False and shown["accuracy_level"] == 0
    assert config_from_dict(shown) == compose_config(None, path)
    data = str(ROOT / "models" / "digits_calib.npz")
    assert main(["quantize", str(DIGITS), str(tmp_path / "q.onnx"), "--calib-data", data, "--opset", "21",
                 "--save-config", str(tmp_path / "s.yaml"), "--quiet"]) == 0
    assert load_config(tmp_path / "s.yaml").opset == 21
    assert {o.domain: o.version for o in onnx.load(tmp_path / "q.onnx").opset_import}[""] == 21
    assert main(["config", "show", "--opset", "12"]) == 2
    assert "invalid --opset 12; use 13..23" in capsys.readouterr().err


def test_errors_name_what_the_user_gave(tmp_path, capsys):
    """The Python API names its parameter, the command line its flags (a config field a
    flag set reads as that flag), and an unknown flag points to its own command's help."""
    with pytest.raises(onnxq.OnnxqError, match=r"needs calibration data; pass calibration_data \(") as error:
        onnxq.quantize(str(DIGITS), None, "U8S8", None, progress=False)
    assert "--" not in str(error.value)
    assert main(["quantize", str(DIGITS), str(tmp_path / "q.onnx"), "--quiet"]) == 2
    assert capsys.readouterr().err == ("onnxq: error: static quantization needs calibration data; "
                                       "pass --calib-data PATH\n")
    assert main(["config", "show", "--stats", "a.npz", "--load-ranges", "b.json"]) == 2
    assert capsys.readouterr().err == "onnxq: error: --stats and --load-ranges both replace calibration; give one\n"
    with pytest.raises(ConfigError, match=r"^overrides: calibration.stats and calibration.load_ranges both"):
        compose_config("U8S8", None, {"calibration": {"stats": ["a.npz"], "load_ranges": "b.json"}})
    # quantize's dict is its `config` (it read 'options:', which names nothing a caller passed)
    with pytest.raises(ConfigError, match=r"^config: unknown key 'global_quant_confg' in config; did you mean"):
        onnxq.quantize(str(DIGITS), None, {"global_quant_confg": {}}, None, progress=False)
    with pytest.raises(SystemExit):
        main(["config", "show", "--bogus"])
    assert capsys.readouterr().err.endswith("--bogus; see onnxq config show --help\n")
    # the calibration text's words too: the config field in Python, its flag on the command line
    with pytest.raises(onnxq.OnnxqError, match="pass calibration_data, or calibration.text for an LLM"):
        calibrate_shard(str(DIGITS), tmp_path / "s.npz", "U8S8", None)
    assert main(["calibrate", str(DIGITS), "--shard", "1/2", "--stats", str(tmp_path / "s.npz"), "--quiet"]) == 2
    assert "pass --calib-data PATH, or --calib-text FILE for an LLM" in capsys.readouterr().err


def test_an_op_type_under_node_overrides_points_to_op_type_overrides():
    """`layer_quant_config: {Gemm: ...}` names an op type where node names go: the error
    says where it belongs."""
    with pytest.raises(ConfigError, match="one of its op types; put it under layer_type_quant_config for every Gemm"):
        onnxq.quantize(str(DIGITS), None, {"layer_quant_config": {"Gemm": {"weight": {"dtype": "float32"}}}},
                       str(ROOT / "models" / "digits_calib.npz"))


def test_config_show_says_what_it_resolved_from(capsys):
    """`config show --preset U8S8` heads its complete document `preset: none`; a comment line
    above says it is U8S8 resolved, not no preset (a trial read it as U8S8 ignored)."""
    from onnxq.cli import main

    assert main(["config", "show", "--preset", "U8S8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("#") and "--preset U8S8" in lines[0] and lines[1] == "preset: none"


@pytest.mark.parametrize("argv, want", [
    (["--cle", "--algo-option", "steps=5"], {"name": "cle", "steps": 5}),
    (["--cle", "--algo-option", "cle.steps=5"], {"name": "cle", "steps": 5}),
    (["--algo-option", "cle.steps=3"], {"name": "cle", "steps": 3}),
    (["--smoothquant", "0.5", "--algo-option", "smoothquant.alpha=0.7"], {"name": "smoothquant", "alpha": 0.7}),
    (["--smoothquant", "0.5", "--algo-option", "migration_strength=0.3"],
     {"name": "smoothquant", "migration_strength": 0.3}),
])
def test_algo_option_reaches_a_pass(capsys, argv, want):
    """algorithms.md: `--algo-option [ALGO.]KEY=VALUE` for every row of its table, passes
    too. `--cle --algo-option steps=20` said to name the algorithm, and `cle.steps=20` then
    said 'cle belongs in pre_quant_opt_config': no command line worked (new-user trial)."""
    assert main(["config", "show", *argv]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["pre_quant_opt_config"] == [want] and shown["algo_config"] == []


def test_algo_option_splits_between_a_pass_and_an_algorithm(capsys):
    argv = ["--cle", "--adaround", "--algo-option", "cle.steps=2", "--algo-option", "num_iteration=20"]
    assert main(["config", "show", *argv]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["pre_quant_opt_config"] == [{"name": "cle", "steps": 2}]
    assert shown["algo_config"][0]["name"] == "adaround" and shown["algo_config"][0]["num_iteration"] == 20


@pytest.mark.parametrize("argv", [["--preset", "W4A8"], ["--preset", "FP8_E4M3"]])
def test_a_bare_algo_option_goes_to_the_presets_algorithm(capsys, argv):
    """`--preset W4A8 --algo-option num_iteration=50` said to name the algorithm, 'e.g.
    adaquant.num_iteration', and following that replaced the preset's AdaRound (trial)."""
    assert main(["config", "show", *argv, "--algo-option", "num_iteration=50"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    entries = {e["name"]: e for e in shown["algo_config"]}
    assert "adaquant" not in entries and entries["adaround"]["num_iteration"] == 50


def test_a_bare_algo_option_goes_to_the_config_files_algorithm(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("algo_config:\n  - name: adaquant\n")
    assert main(["config", "show", "--config", str(config), "--algo-option", "num_iteration=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["algo_config"] == [{"name": "adaquant", "num_iteration": 7}]


def test_quantize_leaves_the_callers_config_as_it_was():
    """Validation normalises a config in place (typed entries to dicts, 'INT8' to 'int8'):
    the caller's Config came back changed, its AdaRoundConfig a dict (API trial)."""
    import copy

    config = onnxq.get_preset("S8S8")
    config.pre_quant_opt_config.append(onnxq.CLEConfig())
    config.algo_config.append(onnxq.AdaRoundConfig(num_iteration=20))
    config.global_quant_config.weight = onnxq.QuantizationSpec(dtype="INT8", qscheme="per_channel")
    before = copy.deepcopy(config)
    data = str(ROOT / "models" / "digits_calib.npz")
    first = onnxq.quantize(str(DIGITS), None, config, data, progress=False).model.SerializeToString()
    assert config == before and isinstance(config.algo_config[0], onnxq.AdaRoundConfig)
    assert onnxq.quantize(str(DIGITS), None, config, data, progress=False).model.SerializeToString() == first


def test_float_op_types_add_to_the_presets(tmp_path):
    """A file's `float_op_types: [Erf]` replaced the preset's list and put Softmax and the
    normalizations back into quantization (configuration trial); it adds to it, as
    `exclude` does, from a file, a dict and `--float-op-types`."""
    path = tmp_path / "f.yaml"
    path.write_text("float_op_types: [Erf]\n")
    preset = onnxq.get_preset("U8S8").float_op_types
    assert compose_config("U8S8", str(path)).float_op_types == [*preset, "Erf"]
    assert compose_config("U8S8", None, {"float_op_types": ["Erf", "Softmax"]}).float_op_types == [*preset, "Erf"]
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(DIGITS), str(out), "--calib-data", str(ROOT / "models" / "digits_calib.npz"),
                 "--float-op-types", "Conv", "--quiet"]) == 0
    graph = onnx.load(out).graph
    assert all(n.op_type != "QLinearConv" for n in graph.node)
    producers = {o: n.op_type for n in graph.node for o in n.output}
    assert all(producers.get(n.input[1]) != "DequantizeLinear" for n in graph.node if n.op_type == "Conv")


def test_float_op_types_of_a_whole_config_and_an_empty_list(tmp_path):
    """A whole config without float_op_types under --float-op-types Erf kept only Erf
    (review); a whole config's own list is its list; [] over a preset, which once meant
    'quantize Softmax too', now adds nothing and says how to quantize one."""
    whole = tmp_path / "w.yaml"
    whole.write_text("preset: none\n")
    assert compose_config(None, str(whole), {"float_op_types": ["Erf"]}).float_op_types == [
        *onnxq.Config().float_op_types, "Erf"]
    whole.write_text("preset: none\nfloat_op_types: [Softmax]\n")
    assert compose_config(None, str(whole)).float_op_types == ["Softmax"]
    with pytest.raises(ConfigError, match=r"float_op_types \[\] adds nothing to the preset's list .*"
                                          r"layer_type_quant_config: \{Softmax: \{\}\}"):
        compose_config("U8S8", None, {"float_op_types": []})


def test_an_op_type_given_to_exclude_names_float_op_types():
    with pytest.raises(ConfigError, match=r"exclude entry 'Conv' matches no node of the model but is one of its op "
                                          r"types; keep every Conv float with float_op_types: \[Conv\]"):
        onnxq.quantize(str(DIGITS), None, {"exclude": ["Conv"]}, str(ROOT / "models" / "digits_calib.npz"),
                       progress=False)


@pytest.mark.parametrize("entries", [{"pre_quant_opt_config": [{"name": "fold_batchnorm", "skip_fusion_layers": ["conv9"]}]},
                                     {"pre_quant_opt_config": [{"name": "cle", "skip_layers": ["conv9"]}]},
                                     {"algo_config": [{"name": "adaround", "layers": ["conv9"]}]}])
def test_node_names_in_pass_and_algorithm_options_must_name_nodes(entries):
    """skip_fusion_layers, skip_layers and layers naming no node changed nothing without a
    word, where a misspelt exclude entry is an error (configuration trial)."""
    with pytest.raises(ConfigError, match="names 'conv9', which is no node of the model; did you mean 'conv3'"):
        onnxq.quantize(str(DIGITS), None, entries, str(ROOT / "models" / "digits_calib.npz"), progress=False)


def test_a_spec_given_as_a_mapping_in_code_reads_as_a_spec():
    """`config.global_quant_config.weight = {...}` raised a raw TypeError (configuration
    trial), where a mapping for a whole level already worked: the same bytes as the typed
    spec, and a typo in it a ConfigError naming its place."""
    data = str(ROOT / "models" / "digits_calib.npz")
    typed, mapped = onnxq.get_preset("U8S8"), onnxq.get_preset("U8S8")
    typed.global_quant_config.weight = onnxq.QuantizationSpec(dtype="int8", qscheme="per_tensor")
    mapped.global_quant_config.weight = {"dtype": "int8", "qscheme": "per_tensor"}
    assert (onnxq.quantize(str(DIGITS), None, mapped, data, progress=False).model.SerializeToString()
            == onnxq.quantize(str(DIGITS), None, typed, data, progress=False).model.SerializeToString())
    mapped.layer_quant_config["conv1"] = onnxq.QuantizationConfig(weight={"qschem": "per_tensor"})
    with pytest.raises(ConfigError, match=re.escape("unknown key 'qschem' in layer_quant_config['conv1'].weight; "
                                                    "did you mean 'qscheme'?")):
        onnxq.quantize(str(DIGITS), None, mapped, data, progress=False)


@pytest.mark.parametrize("make, says", [
    (lambda: onnxq.AdaRoundConfig(learning_rate="fast"), "adaround: option 'learning_rate' must be float, got 'fast'"),
    (lambda: onnxq.AdaRoundConfig(op_types="Conv"), "option 'op_types' must be a list of names, got 'Conv'"),
    (lambda: onnxq.GPTQConfig(block_size="128"), "gptq: option 'block_size' must be int"),
    (lambda: onnxq.CLEConfig(steps=2.5), "cle: option 'steps' must be int"),
])
def test_typed_options_of_the_wrong_type_are_config_errors(make, says):
    """AdaRoundConfig(learning_rate='fast') raised a TypeError from its range check (API trial)."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        make()


def test_an_algo_config_that_is_no_list_is_a_config_error():
    config = onnxq.get_preset("S8S8")
    config.algo_config = onnxq.AdaRoundConfig(num_iteration=5)
    with pytest.raises(ConfigError, match=re.escape("algo_config must be a list of entries, got AdaRoundConfig")):
        onnxq.quantize(str(DIGITS), None, config, str(ROOT / "models" / "digits_calib.npz"), progress=False)
    config.algo_config = (onnxq.AdaRoundConfig(num_iteration=5),)  # a tuple reads as the list it holds
    assert onnxq.quantize(str(DIGITS), None, config, str(ROOT / "models" / "digits_calib.npz"), progress=False)


def test_api_slips_are_one_line_errors():
    """compose_config("S8S8", {...}) failed in pathlib; format_summary(result) in an
    AttributeError; the error classes were not importable from onnxq (API trial)."""
    with pytest.raises(onnxq.ConfigError, match="second argument is a config file path"):
        onnxq.compose_config("S8S8", {"quant_format": "qdq"})
    result = onnxq.quantize(str(DIGITS), None, None, str(ROOT / "models" / "digits_calib.npz"), progress=False)
    assert onnxq.format_summary(result) == onnxq.format_summary(result.summary)
    assert issubclass(onnxq.CalibrationDataError, onnxq.OnnxqError) and issubclass(onnxq.ModelError, onnxq.OnnxqError)
    assert issubclass(onnxq.UnsupportedModelError, onnxq.ModelError) and onnxq.ConfigError is ConfigError


def test_float16_activations_of_a_weightless_op_beside_int8_weights():
    """A Softmax computing in float16 beside int8 MatMul weights is a whole float16 op; the
    float16-with-integer-weights check refused it (it judged every node; review)."""
    rng = np.random.default_rng(0)
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             onnx.helper.make_node("Softmax", ["m"], ["y"], name="sm")]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 16])],
        [onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    data = {"x": rng.standard_normal((16, 16)).astype(np.float32)}
    half = {"input_tensors": {"dtype": "float16"}, "output_tensors": {"dtype": "float16"}}
    result = onnxq.quantize(model, None, {"layer_type_quant_config": {"Softmax": half}}, data, progress=False)
    assert result.summary.quantized_by_op["MatMul"] == 1
    with pytest.raises(ConfigError, match="weight dtype int8 with float16 input_tensors in node 'mm'"):
        onnxq.quantize(model, None, {"layer_type_quant_config": {"MatMul": half}}, data, progress=False)


def test_options_take_numpy_scalars_and_entries_keep_their_objects():
    """np.int64 / np.float32 options (read from an array) are ints and floats; an entry
    holding an object that cannot be copied (a lock) is shared, not copied (review)."""
    import threading

    options = onnxq.AdaRoundConfig(num_iteration=np.int64(50), learning_rate=np.float32(0.01))
    assert type(options.num_iteration) is int and type(options.learning_rate) is float
    from onnxq.config.compose import _own_copy

    config = onnxq.get_preset("U8S8")
    holder = {"name": "bias_correction", "collector": threading.Lock()}
    config.algo_config.append(holder)
    copied = _own_copy(config)
    assert copied.algo_config[0] is not holder and copied.algo_config[0]["collector"] is holder["collector"]
