"""Config: resolution, YAML/JSON round trips, strict parsing, validation, presets."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from onnxq import quantize as onnxq_quantize
from onnxq.config import (
    PRESETS,
    CalibMethod,
    CalibrationConfig,
    Config,
    DType,
    QScheme,
    QuantizationConfig,
    QuantizationSpec,
    RoundMethod,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    get_preset,
    load_config,
    resolve_node_config,
    save_config,
    spec_from_dict,
    validate_config,
    validate_node_configs,
)
from onnxq.config.compose import compose_config
from onnxq.config.spec import SPEC_DEFAULTS
from onnxq.errors import ConfigError

# ---------------------------------------------------------------------------------------
# helpers


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str) -> Config:
    return load_config(write(tmp_path, text))


def three_level_config() -> Config:
    return Config(
        global_quant_config=QuantizationConfig(
            input_tensors=QuantizationSpec(dtype=DType.UINT8, symmetric=False),
            weight=QuantizationSpec(dtype=DType.INT8, symmetric=True, qscheme=QScheme.PER_CHANNEL),
            target_device="cpu",
        ),
        layer_type_quant_config={
            "Conv": QuantizationConfig(
                weight=QuantizationSpec(symmetric=False, round_method=RoundMethod.HALF_UP)
            )
        },
        layer_quant_config={
            "conv1": QuantizationConfig(
                weight=QuantizationSpec(dtype=DType.UINT8),
                input_tensors=QuantizationSpec(dtype=DType.INT8),
            )
        },
    )


def rich_config() -> Config:
    """A config that sets something in every kind of field, for round trips."""
    config = three_level_config()
    config.exclude = ["head/.*", "fc_out"]
    config.calibration = CalibrationConfig(
        max_samples=64, batch_size=4, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    config.fuse_activations = False
    config.float_op_types = ["Softmax"]
    config.global_quant_config.output_tensors = QuantizationSpec(
        dtype=DType.UINT8,
        calib_method=CalibMethod.PERCENTILE,
        percentile=99.99,
        num_bins=1024,
    )
    config.global_quant_config.input_tensors = QuantizationSpec(
        dtype=DType.UINT8, calib_method=CalibMethod.IFMR, calib_options={"search_step": 0.02, "asymmetric": True},
    )
    config.global_quant_config.bias = QuantizationSpec(dtype=DType.INT32)
    config.layer_quant_config["matmul7"] = QuantizationConfig(
        weight=QuantizationSpec(qscheme=QScheme.PER_GROUP, group_size=64, ch_axis=1)
    )
    config.pre_quant_opt_config = [{"name": "cle"}, {"name": "fold_batchnorm", "skip_fusion_layers": ["bn1"]}]
    config.algo_config = [{"name": "adaround", "num_iteration": 20}]
    return config


# ---------------------------------------------------------------------------------------
# resolution


def test_node_beats_op_type_beats_global_field_by_field():
    config = three_level_config()
    conv1 = resolve_node_config(config, "conv1", "Conv")
    assert conv1.weight.dtype is DType.UINT8  # node
    assert conv1.weight.symmetric is False  # op type
    assert conv1.weight.round_method == "half_up"  # op type
    assert conv1.weight.qscheme == "per_channel"  # global
    assert conv1.input_tensors.dtype is DType.INT8  # node
    assert conv1.input_tensors.symmetric is False  # global

    conv2 = resolve_node_config(config, "conv2", "Conv")
    assert (conv2.weight.dtype, conv2.weight.symmetric) == (DType.INT8, False)

    matmul = resolve_node_config(config, "conv1_like", "MatMul")
    assert (matmul.weight.dtype, matmul.weight.symmetric) == (DType.INT8, True)
    assert matmul.weight.round_method == "half_even"


def test_unset_fields_fall_back_to_spec_defaults():
    config = Config(
        global_quant_config=QuantizationConfig(weight=QuantizationSpec(dtype=DType.UINT8))
    )
    weight = resolve_node_config(config, "n", "Conv").weight
    assert weight.dtype is DType.UINT8
    for name in ("symmetric", "ch_axis", "group_size", "percentile", "num_bins", "is_dynamic"):
        assert getattr(weight, name) == SPEC_DEFAULTS[name]
    assert weight.qscheme == str(SPEC_DEFAULTS["qscheme"])
    assert weight.round_method == "half_even"
    assert weight.calib_options == ()


def test_tensor_class_without_any_spec_stays_float():
    config = Config(
        global_quant_config=QuantizationConfig(weight=QuantizationSpec(dtype=DType.INT8))
    )
    resolved = resolve_node_config(config, "n", "Conv")
    assert resolved.weight is not None
    assert resolved.input_tensors is None
    assert resolved.output_tensors is None
    assert resolved.bias is None


def test_target_device_falls_back_to_global():
    config = three_level_config()
    assert resolve_node_config(config, "conv1", "Conv").target_device == "cpu"
    config.layer_quant_config["conv1"].target_device = "npu"
    assert resolve_node_config(config, "conv1", "Conv").target_device == "npu"


@pytest.mark.parametrize(
    ("node", "excluded"),
    [
        ("fc_out", True),  # exact name
        ("head/conv", True),  # regex, full match
        ("head/", True),
        ("my_head/conv", False),  # full match, not search
        ("fc_out_2", False),
        ("conv[", True),  # not a valid regex: compared as a plain name
        ("conv1", False),
    ],
)
def test_exclude_by_name_and_regex(node, excluded):
    config = get_preset("U8S8")
    config.exclude = ["fc_out", "head/.*", "conv["]
    resolved = resolve_node_config(config, node, "Conv")
    assert (resolved is None) is excluded


def test_a_float_node_names_the_config_level_that_kept_it():
    """accuracy.md: each float node's reason names the config level that kept it float
    (before: 'excluded or kept in float by config' for an exclude and a float op type)."""
    from onnxq.config.resolve import float_reason
    config = get_preset("U8S8")
    config.exclude = ["fc_out", "head/.*"]
    config.float_op_types = ["Softmax"]
    assert float_reason(config, "fc_out", "Gemm") == "excluded by the config (exclude: fc_out)"
    assert float_reason(config, "head/conv", "Conv") == "excluded by the config (exclude: pattern 'head/.*')"
    assert float_reason(config, "attn/softmax", "Softmax") == "kept float by the config's float_op_types (Softmax)"
    model = Path(__file__).resolve().parents[1] / "models"
    result = onnxq_quantize(model / "digits_cnn.onnx", None, {"exclude": ["fc"]}, model / "digits_calib.npz",
                            progress=False)
    assert result.summary.float_nodes["fc"] == ("Gemm", "excluded by the config (exclude: fc)")


def test_a_regex_is_shown_as_written():
    """The summary showed exclude patterns through repr, backslashes doubled
    ('/body\\\\.9\\\\d/.*'), so what the user wrote was not what they read (configuration trial)."""
    from onnxq.config.resolve import float_reason
    config = Config(exclude=[r"body\.9\d/.*"])
    assert float_reason(config, "body.91/conv", "Conv") == r"excluded by the config (exclude: pattern 'body\.9\d/.*')"


def test_exclude_beats_node_override():
    config = three_level_config()
    config.exclude = ["conv1"]
    assert resolve_node_config(config, "conv1", "Conv") is None


def test_float_op_types_stay_float_unless_overridden():
    config = get_preset("U8S8")
    assert "Softmax" in config.float_op_types
    assert resolve_node_config(config, "sm", "Softmax") is None
    assert resolve_node_config(config, "conv", "Conv") is not None

    by_node = get_preset("U8S8")
    by_node.layer_quant_config["sm"] = QuantizationConfig()
    assert resolve_node_config(by_node, "sm", "Softmax").input_tensors.dtype is DType.UINT8
    assert resolve_node_config(by_node, "other_sm", "Softmax") is None

    by_type = get_preset("U8S8")
    by_type.layer_type_quant_config["Softmax"] = QuantizationConfig(
        output_tensors=QuantizationSpec(dtype=DType.INT8)
    )
    resolved = resolve_node_config(by_type, "sm", "Softmax")
    assert resolved.output_tensors.dtype is DType.INT8
    assert resolved.input_tensors.dtype is DType.UINT8


def test_dtype_float32_disables_a_tensor_class():
    config = get_preset("U8S8")
    config.global_quant_config.output_tensors = QuantizationSpec(dtype=DType.FLOAT32)
    config.layer_quant_config["conv1"] = QuantizationConfig(
        weight=QuantizationSpec(dtype=DType.FLOAT32)
    )
    conv1 = resolve_node_config(config, "conv1", "Conv")
    assert conv1.output_tensors is None
    assert conv1.weight is None
    assert conv1.input_tensors is not None
    assert conv1.bias is not None
    conv2 = resolve_node_config(config, "conv2", "Conv")
    assert conv2.weight is not None
    assert conv2.output_tensors is None


def test_override_can_reenable_a_float32_class():
    config = get_preset("U8S8")
    config.global_quant_config.output_tensors = QuantizationSpec(dtype=DType.FLOAT32)
    config.layer_type_quant_config["Conv"] = QuantizationConfig(
        output_tensors=QuantizationSpec(dtype=DType.UINT8)
    )
    assert resolve_node_config(config, "c", "Conv").output_tensors.dtype is DType.UINT8
    assert resolve_node_config(config, "m", "MatMul").output_tensors is None


# ---------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_preset_file_round_trip(tmp_path, name, suffix):
    config = get_preset(name)
    path = tmp_path / f"{name}{suffix}"
    save_config(config, path)
    assert load_config(path) == config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_text_round_trip(name):
    config = get_preset(name)
    assert config_from_dict(yaml.safe_load(config_to_yaml(config))) == config
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_rich_config_round_trip(tmp_path, suffix):
    config = rich_config()
    path = tmp_path / f"rich{suffix}"
    save_config(config, path)
    loaded = load_config(path)
    assert loaded == config
    assert loaded.pre_quant_opt_config == [
        {"name": "cle"},
        {"name": "fold_batchnorm", "skip_fusion_layers": ["bn1"]},
    ]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_typed_pass_and_algorithm_entries_are_saved_with_their_names(tmp_path, suffix):
    """configuration.md's snippet: typed entries (CLEConfig(), AdaRoundConfig(...)) on a
    preset, saved and read back, give the same model as the config itself."""
    import onnxq
    config = get_preset("U8S8")
    config.pre_quant_opt_config.append(onnxq.CLEConfig())
    config.algo_config.append(onnxq.AdaRoundConfig(num_iteration=20))
    path = tmp_path / f"typed{suffix}"
    save_config(config, path)
    loaded = load_config(path)
    assert [e["name"] for e in loaded.pre_quant_opt_config] == ["cle"]
    assert loaded.algo_config[0]["name"] == "adaround" and loaded.algo_config[0]["num_iteration"] == 20
    root = Path(__file__).resolve().parents[1]
    model, data = root / "models" / "digits_cnn.onnx", root / "models" / "digits_calib.npz"
    first = onnxq.quantize(model, None, config, data, progress=False).model.SerializeToString()
    again = onnxq.quantize(model, None, loaded, data, progress=False).model.SerializeToString()
    assert first == again


def test_a_preset_beside_a_whole_config_file_is_refused(tmp_path):
    """A file --save-config wrote sets every field (preset: none): a preset beside it
    would change nothing, so it is one line instead of silently ignored."""
    from onnxq.config.compose import compose_config

    path = tmp_path / "whole.yaml"
    save_config(get_preset("S8S8"), path)
    with pytest.raises(ConfigError, match="whole.yaml is a whole config.*preset U8S8 would change nothing"):
        compose_config("U8S8", path)
    assert compose_config(None, path) == get_preset("S8S8")
    assert compose_config("none", path) == get_preset("S8S8")


def test_a_misspelled_preset_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'presett' in config; did you mean 'preset'\?"):
        config_from_dict({"presett": "U8S8"})


def test_saved_json_is_json(tmp_path):
    path = tmp_path / "c.json"
    save_config(get_preset("S8S8"), path)
    assert json.loads(path.read_text())["global_quant_config"]["weight"]["qscheme"] == "per_channel"


def test_to_dict_is_plain_and_omits_unset_spec_fields():
    d = config_to_dict(get_preset("U8S8"))
    weight = d["global_quant_config"]["weight"]
    assert weight == {
        "dtype": "int8",
        "symmetric": True,
        "qscheme": "per_channel",
        "calib_method": "minmax",
    }
    assert type(weight["dtype"]) is str  # not the str-based enum
    assert d["quant_format"] == "qdq"
    assert "max_samples" not in d["calibration"]
    assert "target_device" not in d["global_quant_config"]
    assert "ch_axis:" not in config_to_yaml(get_preset("U8S8"))


def test_config_to_dict_does_not_share_state():
    config = rich_config()
    d = config_to_dict(config)
    loaded = config_from_dict(d)
    d["pre_quant_opt_config"][0]["name"] = "changed"
    d["global_quant_config"]["input_tensors"]["calib_options"]["search_step"] = 0.5
    assert loaded == config


# ---------------------------------------------------------------------------------------
# strict parsing


def test_unknown_key_names_path_and_suggestion():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"global_quant_config": {"weight": {"symetric": True}}})
    assert str(e.value) == (
        "unknown key 'symetric' in global_quant_config.weight; did you mean 'symmetric'?"
    )


def test_unknown_key_in_layer_override_names_the_layer():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"layer_quant_config": {"conv1": {"weights": {}}}})
    assert str(e.value) == (
        "unknown key 'weights' in layer_quant_config['conv1']; did you mean 'weight'?"
    )


def test_unknown_top_level_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"zzz": 1})
    message = str(e.value)
    assert message.startswith("unknown key 'zzz' in config; valid keys: global_quant_config, ")
    assert "algo_config" in message
    assert "did you mean" not in message


def test_unknown_key_in_calibration():
    with pytest.raises(ConfigError, match=r"in calibration; did you mean 'batch_size'\?"):
        config_from_dict({"calibration": {"batchsize": 2}})


def test_bad_enum_value_lists_valid_values():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"global_quant_config": {"weight": {"dtype": "int9"}}})
    assert str(e.value) == (
        "invalid dtype 'int9' in global_quant_config.weight; "
        "valid values: int4, uint4, int8, uint8, int16, uint16, int32, uint32, "
        "float8_e4m3fn, float8_e5m2, float16, bfloat16, float32, mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, "
        "mxfp6_e2m3, mxfp4_e2m1, bfp16"
    )


def test_bad_enum_value_suggests_close_one():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"global_quant_config": {"input_tensors": {"qscheme": "per_chanel"}}})
    assert str(e.value) == (
        "invalid qscheme 'per_chanel' in global_quant_config.input_tensors; "
        "did you mean 'per_channel'? valid values: per_tensor, per_channel, per_group"
    )


def test_enum_values_are_case_insensitive():
    config = config_from_dict(
        {
            "global_quant_config": {
                "weight": {"dtype": "INT8", "qscheme": "Per_Channel", "calib_method": "MinMax"}
            },
            "quant_format": "QDQ",
        }
    )
    weight = config.global_quant_config.weight
    assert (weight.dtype, weight.qscheme, weight.calib_method) == (
        DType.INT8,
        QScheme.PER_CHANNEL,
        CalibMethod.MINMAX,
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"global_quant_config": {"weight": {"symmetric": "yes"}}},
            "global_quant_config.weight.symmetric must be true or false, got str 'yes'",
        ),
        (
            {"layer_quant_config": ["conv1"]},
            "layer_quant_config must be a mapping, got list ['conv1']",
        ),
        (
            {"global_quant_config": {"weight": [1]}},
            "global_quant_config.weight must be a mapping, got list [1]",
        ),
        (
            {"layer_type_quant_config": {"Conv": {"weight": {"ch_axis": True}}}},
            "layer_type_quant_config['Conv'].weight.ch_axis must be an integer, got bool True",
        ),
        (
            {"global_quant_config": {"output_tensors": {"percentile": "99"}}},
            "global_quant_config.output_tensors.percentile must be a number, got str '99'",
        ),
        ({"exclude": "conv1"}, "exclude must be a list, got str 'conv1'"),
        ({"exclude": ["a", 3]}, "exclude[1] must be a string, got int 3"),
        ({"calibration": {"batch_size": None}}, "calibration.batch_size must be an integer"),
        ({"pre_quant_opt_config": [["fold"]]}, "pre_quant_opt_config[0] must be a mapping"),
        ({"layer_quant_config": {1: {}}}, "key 1 in layer_quant_config must be a string"),
        (["global_quant_config"], "config must be a mapping, got list"),
    ],
)
def test_wrong_value_types_name_the_path(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message)


def test_ints_are_accepted_for_floats():
    config = config_from_dict({"global_quant_config": {"output_tensors": {"calib_method": "percentile", "percentile": 100}}})
    assert config.global_quant_config.output_tensors.percentile == 100.0
    assert isinstance(config.global_quant_config.output_tensors.percentile, float)


def test_passthrough_lists_keep_their_content():
    passes = [{"name": "smoothquant", "alpha": 0.3, "skip_layers": ["a", "b"]}]
    config = config_from_dict({"pre_quant_opt_config": passes, "algo_config": [{"name": "adaround", "num_iteration": 5}]})
    assert config.pre_quant_opt_config == passes
    assert config.algo_config == [{"name": "adaround", "num_iteration": 5}]


@pytest.mark.parametrize(("entries", "message"), [
    ({"pre_quant_opt_config": [{"name": "cel"}]}, r"unknown pre_quant_opt_config pass 'cel'; did you mean 'cle'\?"),
    ({"pre_quant_opt_config": [{"name": "smoothquant", "alpha": 1.5}]}, r"alpha must be in \[0, 1\], got 1.5"),
    ({"algo_config": [{"name": "adarond"}]}, r"unknown algo_config algorithm 'adarond'; did you mean 'adaround'\?"),
    ({"algo_config": [{"name": "adaround", "num_iterations": 5}]}, r"did you mean 'num_iteration'\?"),
    ({"algo_config": [{"x": 1}]}, r"each algo_config algorithm entry needs a 'name' key"),
])
def test_config_from_dict_refuses_what_quantize_refuses(entries, message):
    """The passes and algorithms are checked with the config (`config show`, `convert`, a
    file, a dict), not first when quantize parses them."""
    with pytest.raises(ConfigError, match=message):
        config_from_dict(entries)


def test_spec_from_dict():
    spec = spec_from_dict({"dtype": "uint8", "symmetric": False})
    assert spec == QuantizationSpec(dtype=DType.UINT8, symmetric=False)
    with pytest.raises(ConfigError, match=r"^unknown key 'dtpe' in spec; did you mean 'dtype'\?$"):
        spec_from_dict({"dtpe": "int8"})


def test_empty_dict_gives_default_config():
    assert config_from_dict({}) == Config()


# ---------------------------------------------------------------------------------------
# files


def test_load_yaml_file(tmp_path):
    config = load_text(
        tmp_path,
        """
        global_quant_config:
          weight: {dtype: int8, qscheme: per_channel}
        layer_type_quant_config:
          MatMul:
            weight: {qscheme: per_tensor}
        exclude: [fc_out]
        """,
    )
    assert config.global_quant_config.weight.qscheme is QScheme.PER_CHANNEL
    assert config.layer_type_quant_config["MatMul"].weight.qscheme is QScheme.PER_TENSOR
    assert config.exclude == ["fc_out"]


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    """PyYAML reads `1e-2` (no dot) as a string, and a number option refused it: "must be a
    number, got '1e-2'" (new-user trial). YAML 1.2 and JSON read a number; so do onnxq's
    files and KEY=VALUE flags."""
    config = load_text(tmp_path, """
        global_quant_config:
          input_tensors: {calib_method: ifmr, calib_options: {search_step: 1e-2, search_range_end: 13E-1}}
        """)
    assert config.global_quant_config.input_tensors.calib_options == {"search_step": 0.01, "search_range_end": 1.3}
    from onnxq.cli.arguments import key_values
    assert key_values(["search_step=1e-2", "name=e5", "n=10"]) == {"search_step": 0.01, "name": "e5", "n": 10}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_calib_options_are_config_errors(value):
    """`search_step: .nan` passed every range check and raised ValueError in the observer
    after calibration, exit 1 (new-user trial)."""
    from helpers import random_feeds, residual
    model = residual()
    config = {"global_quant_config": {"input_tensors": {"calib_method": "ifmr",
                                                        "calib_options": {"search_step": value}}}}
    with pytest.raises(ConfigError, match="'search_step' for method 'ifmr' must be a finite number"):
        onnxq_quantize(model, None, config, random_feeds(model, 4, 0))


@pytest.mark.parametrize("text", ["algo_config: [{name: adaround, num_iteration: 5}, {name: adaround, num_iteration: 500}]"])
def test_an_entry_named_twice_in_one_file_is_refused(tmp_path, text):
    """Two entries of one name in a file were merged, the second's options silently
    replacing the first's, where the same list from Python was refused (configuration
    trial); the docs say two of a kind in one source are refused."""
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"c.yaml: algo_config lists adaround twice; give one"):
        compose_config("W4A8", str(path))


def test_an_algorithm_appended_twice_in_python_is_refused_in_plain_words():
    from onnxq.optimize.adaround import AdaRoundConfig
    config = get_preset("W4A8")
    config.algo_config.append(AdaRoundConfig(num_iteration=50))
    with pytest.raises(ConfigError, match="^algo_config lists adaround twice; give one entry for it"):
        models = Path(__file__).resolve().parents[1] / "models"
        onnxq_quantize(models / "digits_cnn.onnx", None, config, models / "digits_calib.npz", progress=False)


def test_a_json_file_with_a_byte_order_mark_reads(tmp_path):
    """A JSON file saved with a UTF-8 byte-order mark (Windows editors) failed to parse,
    where YAML with one read (configuration trial)."""
    path = tmp_path / "c.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"exclude": ["fc"]}')
    assert load_config(path).exclude == ["fc"]


def test_an_empty_amct_file_is_refused_like_an_empty_yaml(tmp_path):
    """An empty or comment-only .cfg was read as AMCT's defaults (IFMR activations) without a
    word, where an empty YAML file is an error (configuration trial)."""
    path = tmp_path / "e.cfg"
    path.write_text("# nothing here\n\n")
    with pytest.raises(ConfigError, match="the config file is empty"):
        load_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"^config file .*nope\.yaml not found$"):
        load_config(path)


def test_unsupported_suffix(tmp_path):
    path = write(tmp_path, "{}", "config.toml")
    with pytest.raises(
        ConfigError, match=r"unsupported suffix '\.toml'; use \.yaml, \.yml, \.json or an AMCT"
    ):
        load_config(path)


def test_unreadable_file(tmp_path):
    path = tmp_path / "dir.yaml"
    path.mkdir()
    with pytest.raises(ConfigError, match=r"^cannot read config file .*dir\.yaml: "):
        load_config(path)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"exclude: [caf\xe9]\n")
    with pytest.raises(ConfigError, match=r"^cannot read config file .*latin\.yaml: not UTF-8"):
        load_config(path)


def test_yaml_parse_error_is_one_line_with_position(tmp_path):
    path = write(tmp_path, "global_quant_config:\n  weight: [int8\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"cannot parse config file {path}: ")
    assert "(line " in message
    assert "\n" not in message


def test_json_parse_error_is_one_line_with_position(tmp_path):
    path = write(tmp_path, '{"exclude": [}', "c.json")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"cannot parse config file {path}: ")
    assert "(line 1, column 14)" in str(e.value)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.yaml", "exclude: [a]\nexclude: [b]\n"),
        ("c.json", '{"exclude": ["a"], "exclude": ["b"]}'),
    ],
)
def test_duplicate_keys_are_rejected(tmp_path, name, text):
    with pytest.raises(ConfigError, match=r"cannot parse config file .*duplicate key 'exclude'"):
        load_config(write(tmp_path, text, name))


@pytest.mark.parametrize("name", ["c.yaml", "c.json"])
def test_empty_file(tmp_path, name):
    with pytest.raises(ConfigError, match=r"the config file is empty$"):
        load_config(write(tmp_path, "\n", name))


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=r"config must be a mapping, got list"):
        load_config(path)


def test_load_errors_start_with_the_file_name(tmp_path):
    path = write(tmp_path, "global_quant_config:\n  weight:\n    symetric: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: unknown key 'symetric' in global_quant_config.weight; did you mean 'symmetric'?"
    )


# ---------------------------------------------------------------------------------------
# validation at load time

INVALID = {
    "group_size_with_per_tensor": (
        """
        global_quant_config:
          weight: {qscheme: per_tensor, group_size: 32}
        """,
        "group_size 32 with qscheme per_tensor in global_quant_config.weight; "
        "group_size only applies to per_group",
    ),
    "group_size_with_per_channel": (
        """
        layer_quant_config:
          conv1:
            weight: {qscheme: per_channel, group_size: 32}
        """,
        "group_size 32 with qscheme per_channel in layer_quant_config['conv1'].weight;",
    ),
    "group_size_inherits_per_tensor": (
        """
        global_quant_config:
          weight: {qscheme: per_tensor}
        layer_type_quant_config:
          MatMul:
            weight: {group_size: 128}
        """,
        "group_size 128 with qscheme per_tensor in layer_type_quant_config['MatMul'].weight "
        "(merged over global_quant_config)",
    ),
    "group_size_with_preset_qscheme": (
        """
        global_quant_config:
          weight: {group_size: 128}
        """,
        "group_size 128 with qscheme per_channel in global_quant_config.weight",
    ),
    "per_group_without_group_size": (
        """
        global_quant_config:
          weight: {qscheme: per_group}
        """,
        "qscheme per_group without group_size in global_quant_config.weight; set group_size",
    ),
    "per_group_override_without_group_size": (
        """
        global_quant_config:
          weight: {qscheme: per_channel}
        layer_quant_config:
          fc:
            weight: {qscheme: per_group}
        """,
        "qscheme per_group without group_size in layer_quant_config['fc'].weight "
        "(merged over global_quant_config)",
    ),
    "group_size_zero": (
        """
        global_quant_config:
          weight: {qscheme: per_group, group_size: 0}
        """,
        "invalid group_size 0 in global_quant_config.weight; use a positive integer",
    ),
    "group_size_negative_at_node": (
        """
        global_quant_config:
          weight: {qscheme: per_group, group_size: 64}
        layer_quant_config:
          fc:
            weight: {group_size: -8}
        """,
        "invalid group_size -8 in layer_quant_config['fc'].weight;",
    ),
    "input_per_channel_without_axis": (
        """
        global_quant_config:
          input_tensors: {qscheme: per_channel}
        """,
        "qscheme per_channel for input_tensors in global_quant_config.input_tensors; activations are calibrated "
        "per tensor",
    ),
    "output_per_channel_without_axis_at_op_type": (
        """
        layer_type_quant_config:
          Conv:
            output_tensors: {dtype: uint8, qscheme: per_channel}
        """,
        "qscheme per_channel for output_tensors in layer_type_quant_config['Conv'].output_tensors",
    ),
    "activation_per_channel_with_axis": (
        """
        global_quant_config:
          input_tensors: {qscheme: per_channel, ch_axis: 1}
        """,
        "qscheme per_channel for input_tensors in global_quant_config.input_tensors; activations are",
    ),
    "activation_per_group": (
        """
        global_quant_config:
          output_tensors: {qscheme: per_group, group_size: 4}
        """,
        "qscheme per_group for output_tensors in global_quant_config.output_tensors; activations are",
    ),
    "bias_per_group": (
        """
        global_quant_config:
          bias: {qscheme: per_group, group_size: 4}
        """,
        "bias qscheme per_group in global_quant_config.bias; a bias takes its input's and weight's scales",
    ),
    "input_round_half_up": (
        """
        global_quant_config:
          input_tensors: {round_method: half_up}
        """,
        "round_method half_up in global_quant_config.input_tensors; "
        "QuantizeLinear rounds activations half to even",
    ),
    "output_round_floor_at_node": (
        """
        layer_quant_config:
          relu3:
            output_tensors: {round_method: floor}
        """,
        "round_method floor in layer_quant_config['relu3'].output_tensors;",
    ),
    "input_int32": (
        """
        global_quant_config:
          input_tensors: {dtype: int32}
        """,
        "dtype int32 in global_quant_config.input_tensors; 32-bit integers are only for bias",
    ),
    "output_int32": (
        """
        layer_type_quant_config:
          Add:
            output_tensors: {dtype: int32}
        """,
        "dtype int32 in layer_type_quant_config['Add'].output_tensors;",
    ),
    "weight_int32": (
        """
        layer_quant_config:
          conv1:
            weight: {dtype: int32}
        """,
        "dtype int32 in layer_quant_config['conv1'].weight; 32-bit integers are only for bias",
    ),
    "bias_int8": (
        """
        global_quant_config:
          bias: {dtype: int8}
        """,
        "bias dtype int8 in global_quant_config.bias; set dtype: int32",
    ),
    "bias_uint8_at_op_type": (
        """
        global_quant_config:
          bias: {dtype: int32}
        layer_type_quant_config:
          Gemm:
            bias: {dtype: uint8}
        """,
        "bias dtype uint8 in layer_type_quant_config['Gemm'].bias;",
    ),
    "percentile_zero": (
        """
        global_quant_config:
          input_tensors: {calib_method: percentile, percentile: 0}
        """,
        "invalid percentile 0.0 in global_quant_config.input_tensors; use a percent in [50, 100]",
    ),
    "percentile_above_100": (
        """
        layer_quant_config:
          conv1:
            output_tensors: {calib_method: percentile, percentile: 100.5}
        """,
        "invalid percentile 100.5 in layer_quant_config['conv1'].output_tensors;",
    ),
    "num_bins_one": (
        """
        global_quant_config:
          input_tensors: {calib_method: entropy, num_bins: 1}
        """,
        "invalid num_bins 1 in global_quant_config.input_tensors; use 2 or more",
    ),
    "batch_size_zero": (
        """
        calibration: {batch_size: 0}
        """,
        "invalid batch_size 0 in calibration; use 1 or more",
    ),
    "max_samples_zero": (
        """
        calibration: {max_samples: 0}
        """,
        "invalid max_samples 0 in calibration; use 1 or more",
    ),
    "dynamic_weight": (
        """
        global_quant_config:
          weight: {dtype: int8, is_dynamic: true}
        """,
        "is_dynamic true in global_quant_config.weight; weights are always quantized statically",
    ),
    "dynamic_weight_at_node": (
        """
        layer_quant_config:
          fc:
            weight: {is_dynamic: true}
        """,
        "is_dynamic true in layer_quant_config['fc'].weight;",
    ),
    "quant_format_unknown": (
        """
        quant_format: qlinear
        """,
        "invalid quant_format 'qlinear' in config; valid values: qdq, qoperator",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_combination_fails_at_load_time(tmp_path, case):
    text, expected = INVALID[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert message.startswith(f"{path}: {expected}"), message
    assert "\n" not in message


VALID = {
    "weight_per_channel_without_axis": """
        global_quant_config:
          weight: {qscheme: per_channel}
        """,
    "per_group_with_group_size": """
        global_quant_config:
          weight: {qscheme: per_group, group_size: 128}
        """,
    "node_per_group_inherits_group_size": """
        global_quant_config:
          weight: {qscheme: per_group, group_size: 128}
        layer_quant_config:
          fc:
            weight: {qscheme: per_group, dtype: uint8}
        """,
    "weight_round_half_up": """
        global_quant_config:
          weight: {round_method: half_up}
        """,
    "activation_round_half_even": """
        global_quant_config:
          output_tensors: {round_method: half_even}
        """,
    "bias_float32": """
        global_quant_config:
          bias: {dtype: float32}
        """,
    "percentile_100": """
        global_quant_config:
          input_tensors: {calib_method: percentile, percentile: 100}
        """,
    "num_bins_2_and_max_samples_1": """
        global_quant_config:
          input_tensors: {calib_method: entropy, num_bins: 2}
        calibration: {max_samples: 1, batch_size: 1}
        """,
    "dynamic_activations": """
        global_quant_config:
          input_tensors: {is_dynamic: true}
        """,
}


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_combination_loads(tmp_path, case):
    assert isinstance(load_text(tmp_path, VALID[case]), Config)


def test_validate_config_checks_configs_built_in_code():
    config = get_preset("U8S8")
    validate_config(config)
    config.layer_quant_config["conv1"] = QuantizationConfig(
        input_tensors=QuantizationSpec(round_method=RoundMethod.CEIL)
    )
    with pytest.raises(ConfigError, match=r"^round_method ceil in layer_quant_config\['conv1'\]"):
        validate_config(config)


def test_validate_config_catches_wrong_types_built_in_code():
    config = get_preset("U8S8")
    config.global_quant_config.weight.dtype = "int9"
    with pytest.raises(ConfigError, match=r"^invalid dtype 'int9' in global_quant_config\.weight"):
        validate_config(config)


def test_validate_node_configs_catches_node_over_op_type_conflicts():
    config = Config(
        global_quant_config=QuantizationConfig(weight=QuantizationSpec(dtype=DType.INT8)),
        layer_type_quant_config={
            "MatMul": QuantizationConfig(
                weight=QuantizationSpec(qscheme=QScheme.PER_GROUP, group_size=32)
            )
        },
        layer_quant_config={
            "fc": QuantizationConfig(weight=QuantizationSpec(qscheme=QScheme.PER_CHANNEL))
        },
    )
    validate_config(config)  # fc might be any op type: only the model can tell
    validate_node_configs(config, [("fc", "Gemm"), ("mm", "MatMul")])
    with pytest.raises(ConfigError) as e:
        validate_node_configs(config, [("fc", "MatMul")])
    assert str(e.value).startswith(
        "group_size 32 with qscheme per_channel in node 'fc' (MatMul).weight as resolved;"
    )


# ---------------------------------------------------------------------------------------
# presets


def test_preset_table():
    assert {"U8S8", "S8S8", "A8W8"} <= set(PRESETS)
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert preset.description and "\n" not in preset.description
        assert isinstance(preset.build(), Config)
        validate_config(preset.build())


def test_u8s8_numerics():
    g = get_preset("U8S8").global_quant_config
    for spec in (g.input_tensors, g.output_tensors):
        assert (spec.dtype, spec.symmetric, spec.calib_method) == (
            DType.UINT8,
            False,
            CalibMethod.MINMAX,
        )
    assert (g.weight.dtype, g.weight.symmetric, g.weight.qscheme) == (
        DType.INT8,
        True,
        QScheme.PER_CHANNEL,
    )
    assert g.weight.ch_axis is None  # inferred from the op type
    assert g.bias.dtype is DType.INT32


@pytest.mark.parametrize("name", ["S8S8", "A8W8"])
def test_symmetric_int8_presets(name):
    g = get_preset(name).global_quant_config
    for spec in (g.input_tensors, g.output_tensors):
        assert (spec.dtype, spec.symmetric, spec.calib_method) == (
            DType.INT8,
            True,
            CalibMethod.MINMAX,
        )
    assert (g.weight.dtype, g.weight.symmetric, g.weight.qscheme) == (
        DType.INT8,
        True,
        QScheme.PER_CHANNEL,
    )
    assert g.bias.dtype is DType.INT32


def test_a8w8_matches_s8s8_and_names_its_target():
    assert get_preset("A8W8") == get_preset("S8S8")
    assert "accelerator" in PRESETS["A8W8"].description


def test_get_preset_returns_a_fresh_config():
    first = get_preset("U8S8")
    first.global_quant_config.weight.dtype = DType.UINT8
    first.exclude.append("x")
    again = get_preset("U8S8")
    assert again.global_quant_config.weight.dtype is DType.INT8
    assert again.exclude == []


def test_get_preset_is_case_insensitive():
    assert get_preset("u8s8") == get_preset("U8S8")


def test_unknown_preset_suggests_and_lists():
    with pytest.raises(ConfigError) as e:
        get_preset("U8S9")
    assert str(e.value) == (
        "unknown preset 'U8S9'; did you mean 'U8S8'? available: " + ", ".join(PRESETS)
    )


def test_unknown_preset_without_close_match_lists_presets():
    with pytest.raises(ConfigError) as e:
        get_preset("fp8")
    assert str(e.value) == "unknown preset 'fp8'; available: " + ", ".join(PRESETS)


def test_bias_without_dtype_resolves_to_int32():
    config = config_from_dict({"global_quant_config": {"bias": {"symmetric": True}}})
    resolved = resolve_node_config(config, "conv1", "Conv")
    assert resolved.bias is not None and resolved.bias.dtype.value == "int32"


def test_brevitas_float_description_maps_to_a_standard_type():
    config = config_from_dict({"global_quant_config": {"weight": {"exponent_bits": 4, "mantissa_bits": 3}}})
    assert resolve_node_config(config, "conv1", "Conv").weight.dtype.value == "float8_e4m3fn"
    config = config_from_dict({"global_quant_config": {"weight": {"exponent_bits": 5, "mantissa_bits": 10}}})
    assert resolve_node_config(config, "conv1", "Conv").weight.dtype.value == "float16"
    with pytest.raises(ConfigError, match=r"no standard float type has exponent_bits=3, mantissa_bits=3"):
        config_from_dict({"global_quant_config": {"weight": {"exponent_bits": 3, "mantissa_bits": 3}}})


def test_an_activation_after_an_excluded_op_says_why_it_stays_float():
    """A Relu is quantized only with the op before it: after an excluded Conv the summary
    says that, not that Relu has no quantized kernel (18 other Relus were quantized)."""
    import numpy as np
    from helpers import conv_relu_chain

    import onnxq

    model = conv_relu_chain()
    first = next(n for n in model.graph.node if n.op_type == "Conv").name
    config = get_preset("U8S8")
    config.exclude = [first]
    data = {"x": np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)}
    result = onnxq.quantize(model, None, config, data)
    reasons = {op: why for op, why in result.summary.float_nodes.values()}
    assert "the Conv before it stays float" in reasons["Relu"]
    assert result.summary.quantized_by_op.get("Relu", 0) >= 1  # the other Relu is quantized


def test_a_misspelt_op_type_override_is_refused():
    """An op-type override naming no ONNX op type would silently do nothing; one of a real
    op type the model lacks is fine (a config reused across models)."""
    import numpy as np
    import pytest
    from helpers import conv_relu_chain

    import onnxq
    from onnxq.errors import ConfigError

    data = {"x": np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)}
    int4 = {"weight": {"dtype": "int4"}}
    for typo in ("conv", "Convv"):
        with pytest.raises(ConfigError, match=f"op type '{typo}'.*did you mean 'Conv'"):
            onnxq.quantize(conv_relu_chain(), None, {"layer_type_quant_config": {typo: int4}}, data)
    onnxq.quantize(conv_relu_chain(), None, {"layer_type_quant_config": {"MatMul": int4}}, data)
    # an op type of onnx's other domains (ai.onnx.ml) is an op type too
    onnxq.quantize(conv_relu_chain(), None, {"float_op_types": ["LinearClassifier", "Softmax"]}, data)
    with pytest.raises(ConfigError, match="float_op_types names op type 'Softmaxx'.*did you mean 'Softmax'"):
        onnxq.quantize(conv_relu_chain(), None, {"float_op_types": ["Softmaxx"]}, data)


def test_config_helpers_for_python_users(tmp_path):
    """save_config is exported beside load_config; a config path that does not exist says so."""
    import pytest

    import onnxq
    from onnxq.errors import ConfigError

    path = tmp_path / "recipe.yaml"
    onnxq.save_config(onnxq.get_preset("S8S8"), path)
    assert onnxq.load_config(path) == onnxq.get_preset("S8S8")
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        onnxq.as_config(str(tmp_path / "missing.yaml"))


def test_a_misspelt_keyword_of_a_config_class_names_the_field():
    """Python's TypeError says only 'unexpected keyword argument'; onnxq's names the nearest
    field, and is both an OnnxqError and a TypeError."""
    import pytest

    import onnxq
    from onnxq.errors import OnnxqError

    cases = [(lambda: onnxq.QuantizationSpec(dtyp="int8"), "QuantizationSpec has no field 'dtyp'; did you mean 'dtype'"),
             (lambda: onnxq.Config(global_quant_confg=None), "did you mean 'global_quant_config'"),
             (lambda: onnxq.GPTQConfig(damp=0.1), "GPTQConfig has no field 'damp'; did you mean 'damp_percent'"),
             (lambda: onnxq.AdaRoundConfig(num_iterations=3), "did you mean 'num_iteration'")]
    for make, words in cases:
        with pytest.raises(OnnxqError, match=words) as caught:
            make()
        assert isinstance(caught.value, TypeError)
    assert onnxq.AdaRoundConfig(num_iteration=3).num_iteration == 3


@pytest.mark.parametrize("alias,dtype", [("fp16", "float16"), ("BF16", "bfloat16"), ("fp32", "float32"),
                                         ("e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_other_tools_dtype_names_are_taken(alias, dtype):
    config = compose_config("FP16", None, {"global_quant_config": {"weight": {"dtype": alias}}})
    assert config.global_quant_config.weight.dtype == dtype


def test_a_dtype_name_of_two_formats_lists_both():
    with pytest.raises(ConfigError, match="'fp8'.*did you mean 'float8_e4m3fn' or 'float8_e5m2'"):
        compose_config("U8S8", None, {"global_quant_config": {"weight": {"dtype": "fp8"}}})


def test_an_alias_keeps_its_meaning_through_the_merge_and_in_code(tmp_path):
    """`dtype: fp32` on an override keeps its tensors float under a flag as `float32` does,
    and a spec built in code with an alias is written with onnxq's own name."""
    path = tmp_path / "c.yaml"
    path.write_text("layer_type_quant_config:\n  Conv:\n    weight: {dtype: fp32}\n")
    config = compose_config(None, path, {"global_quant_config": {"weight": {"dtype": "int8"}}})
    assert config.layer_type_quant_config["Conv"].weight.dtype == "float32"
    assert resolve_node_config(config, "conv1", "Conv").weight is None
    built = get_preset("FP16")
    built.global_quant_config.weight = QuantizationSpec(dtype="fp16")
    validate_config(built)
    assert "fp16" not in config_to_yaml(built) and built.global_quant_config.weight.dtype is DType.FLOAT16
