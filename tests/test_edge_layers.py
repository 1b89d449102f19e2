"""`edge_weight`: the first and last weighted layers take their own weight spec (W4A8
keeps them int8, the protocol of AdaRound's and BRECQ's int4 results); `depthwise_weight`:
the depthwise convolutions take theirs (W4A8 keeps them int8 too). The model's weighted
layers: a 3x3 Conv, a depthwise Conv, a 1x1 Conv and a Gemm."""

from __future__ import annotations

import onnx
import pytest
from helpers import every_kernel, random_feeds, run, sqnr_db

import onnxq
from onnxq.config.io import config_from_dict
from onnxq.errors import ConfigError
from onnxq.notes import Topic, of

INT4, INT8 = onnx.TensorProto.INT4, onnx.TensorProto.INT8


MODEL = every_kernel(21)
CALIB = random_feeds(MODEL, 32, seed=3)


def weight_types(model: onnx.ModelProto) -> list[int]:
    """The stored type of each weighted layer's weight, in graph order."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    types = []
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            dq = producer.get(node.input[1])
            types.append(inits.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None)
    return types


def test_w4a8_keeps_the_first_and_last_layer_and_the_depthwise_one_int8():
    result = onnxq.quantize(MODEL, None, "W4A8", CALIB)
    assert weight_types(result.model) == [INT8, INT8, INT4, INT8]
    onnx.checker.check_model(result.model, full_check=True)
    edges, depthwise = of(result.summary.notes, Topic.CONFIG)
    assert "edge_weight" in edges.text and len(edges.nodes) == 2  # the first and the last weighted layer
    assert "depthwise_weight: the depthwise convolution takes int8" in depthwise.text and len(depthwise.nodes) == 1
    feed = random_feeds(MODEL, 1, seed=9)[0]
    assert sqnr_db(run(MODEL, feed), run(result.model, feed)) > 15


def test_without_edge_weight_every_layer_is_alike():
    config = onnxq.get_preset("W4A8")
    config.edge_weight = None
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == [INT4, INT8, INT4, INT4]
    config.depthwise_weight = None
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == [INT4] * 4


def test_a_global_weight_width_leaves_the_edge_layers_alone():
    """`--weight-bits 3` narrows the global int4 weights; W4A8's int8 edge and depthwise
    layers had come out 3-bit too (their codes in -4..3), where the docs promise a global
    flag leaves them alone (configuration trial). bits belongs to the dtype it narrows; a
    level with the same dtype still inherits it."""
    from onnxq.config.resolve import resolve_node_config
    config = onnxq.compose_config("W4A8", None, {"global_quant_config": {"weight": {"bits": 3}},
                                                 "algo_config": []})
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert weight_types(result.model) == [INT8, INT8, INT4, INT8]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in result.model.graph.initializer}
    producer = {o: n for n in result.model.graph.node for o in n.output}
    spans = [int(inits[producer[n.input[1]].input[0]].max()) - int(inits[producer[n.input[1]].input[0]].min())
             for n in result.model.graph.node if n.op_type in ("Conv", "Gemm")]
    assert spans[2] <= 7 and min(spans[0], spans[1], spans[3]) > 7, spans  # 3-bit int4, full int8 edges
    same = onnxq.compose_config(None, None, {"global_quant_config": {"weight": {"dtype": "int8", "bits": 7}},
                                             "layer_type_quant_config": {"Conv": {"weight": {"dtype": "int8"}}}})
    assert resolve_node_config(same, "any", "Conv").weight.bits == 7


def test_a_node_override_wins_over_the_edge_spec():
    """The user's own node-level weight field is kept; edge_weight fills what it leaves unset."""
    config = onnxq.get_preset("W4A8")
    first = next(n.name for n in MODEL.graph.node if n.op_type == "Conv")
    config.layer_quant_config = {first: onnxq.QuantizationConfig(weight=onnxq.QuantizationSpec(dtype="int4"))}
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert weight_types(result.model) == [INT4, INT8, INT4, INT8]
    assert config.layer_quant_config[first].weight.symmetric is None  # the user's config is left alone


INT4_CONFIG = {"global_quant_config": {"weight": {"dtype": "int4", "qscheme": "per_channel"},
                                       "input_tensors": {"dtype": "uint8"}, "output_tensors": {"dtype": "uint8"}}}


@pytest.mark.parametrize("edge,expected", [({"dtype": "int8"}, [INT8, INT4, INT4, INT8]), (None, [INT4] * 4)])
def test_edge_weight_from_a_config_file(edge, expected):
    config = config_from_dict({**INT4_CONFIG, **({"edge_weight": edge} if edge else {})})
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == expected


def test_cli_flag_sets_or_clears_it(tmp_path):
    import numpy as np
    from helpers import save, stack_feeds
    from test_newcomer import onnxq as cli

    path = save(MODEL, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", **stack_feeds(CALIB))
    u8 = onnx.TensorProto.UINT8
    for flags, expected in ((["--edge-weight-type", "none"], [INT4, INT8, INT4, INT4]),
                            (["--edge-weight-type", "uint8"], [u8, INT8, INT4, u8]),
                            (["--edge-weight-type", "none", "--depthwise-weight-type", "none"], [INT4] * 4),
                            (["--depthwise-weight-type", "uint8"], [INT8, u8, INT4, INT8])):
        out = tmp_path / f"{'_'.join(flags)}.onnx"
        proc = cli("quantize", str(path), str(out), "--calib-data", str(tmp_path / "calib.npz"), "--preset", "W4A8",
                   *flags, "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert weight_types(onnx.load(str(out))) == expected


def test_re_emission_from_the_pipeline_state_keeps_the_edge_layers():
    """The accuracy-target search re-emits with the user's config plus promotions
    (`PipelineState.emit`): the edge layers resolve there as in the run itself."""
    import onnx_ir as ir

    from onnxq.quantize import run_pipeline

    config = onnxq.get_preset("W4A8")
    config.algo_config = []
    result = run_pipeline(MODEL, None, config, CALIB, keep_state=True)
    assert weight_types(ir.to_proto(result.state.emit(config))) == [INT8, INT8, INT4, INT8]


def test_search_trials_keep_the_runs_edge_layers():
    """A trial that promotes the first layer to float keeps the run's edge layers (the
    second layer does not become an edge): the search measures each layer as deployed."""
    import onnx_ir as ir

    from onnxq.quantize import run_pipeline
    from onnxq.search.driver import with_promotions

    config = onnxq.get_preset("W4A8")
    config.algo_config = []
    result = run_pipeline(MODEL, None, config, CALIB, keep_state=True)
    first = next(n.name for n in MODEL.graph.node if n.op_type == "Conv")
    trial = ir.to_proto(result.state.emit(with_promotions(config, {first: "float"})))
    assert weight_types(trial) == [None, INT8, INT4, INT8]


def test_an_edge_type_that_needs_a_newer_opset_upgrades_the_model():
    config = onnxq.get_preset("U8S8")
    config.edge_weight = onnxq.QuantizationSpec(dtype="int4")
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert weight_types(result.model) == [INT4, INT8, INT8, INT4]
    assert max(o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx")) >= 21


def test_an_invalid_edge_spec_is_refused_under_its_own_key():
    config = onnxq.get_preset("U8S8")
    config.edge_weight = onnxq.QuantizationSpec(dtype="int32")
    with pytest.raises(ConfigError, match="dtype int32 in edge_weight; 32-bit"):
        onnxq.quantize(MODEL, None, config, CALIB)


def test_an_excluded_first_layer_is_not_replaced_by_the_next():
    config = onnxq.get_preset("W4A8")
    config.exclude = [next(n.name for n in MODEL.graph.node if n.op_type == "Conv")]
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == [None, INT8, INT4, INT8]


def input_quantized(model: onnx.ModelProto) -> list[bool]:
    """Whether each weighted layer reads its data input through a DequantizeLinear."""
    producer = {o: n for n in model.graph.node for o in n.output}
    return [producer.get(n.input[0]) is not None and producer[n.input[0]].op_type == "DequantizeLinear"
            for n in model.graph.node if n.op_type in ("Conv", "Gemm")]


@pytest.mark.parametrize("edge,expected", [({"dtype": "float32"}, [False, True, True, False]),
                                           (None, [True] * 4)])
def test_edge_input_from_a_config_file(edge, expected):
    config = config_from_dict({**INT4_CONFIG, **({"edge_input": edge} if edge else {})})
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert input_quantized(result.model) == expected
    assert weight_types(result.model) == [INT4] * 4  # the weights are edge_weight's business
    onnx.checker.check_model(result.model, full_check=True)


def test_cli_edge_input_flag(tmp_path):
    import numpy as np
    from helpers import save, stack_feeds
    from test_newcomer import onnxq as cli

    path = save(MODEL, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", **stack_feeds(CALIB))
    for flag, expected in (("none", [True] * 4), ("float32", [False, True, True, False])):
        out = tmp_path / f"{flag}.onnx"
        proc = cli("quantize", str(path), str(out), "--calib-data", str(tmp_path / "calib.npz"),
                   "--edge-input-type", flag, "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert input_quantized(onnx.load(str(out))) == expected


def test_edge_input_round_trips_a_yaml_file_and_yields_to_the_users_node_field(tmp_path):
    """edge_input from YAML survives config_to_dict/config_from_dict; on the first layer
    the user's own input dtype (uint8 there) wins, the last layer takes edge_input's."""
    from onnxq.config.io import config_to_dict, read_config_dict

    first = next(n.name for n in MODEL.graph.node if n.op_type == "Conv")
    path = tmp_path / "c.yaml"
    path.write_text("preset: U8S8\nedge_input: {dtype: float32}\n"
                    f"layer_quant_config:\n  {first}:\n    input_tensors: {{dtype: uint8}}\n")
    config = onnxq.config.compose.compose_config(None, str(path), {})
    assert config_from_dict(config_to_dict(config)).edge_input == config.edge_input
    assert read_config_dict(str(path))["edge_input"] == {"dtype": "float32"}
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert input_quantized(result.model) == [True, True, True, False]


def test_a_bad_edge_input_is_refused_under_its_own_key():
    config = onnxq.get_preset("U8S8")
    config.edge_weight = onnxq.QuantizationSpec(dtype="int8")
    config.edge_input = onnxq.QuantizationSpec(dtype="int32")
    with pytest.raises(ConfigError, match=" in edge_input; "):
        onnxq.quantize(MODEL, None, config, CALIB)


@pytest.mark.parametrize("text,expected", [("float32", [False, True, True, False]), ("none", [True] * 4)])
def test_a_bare_dtype_in_a_config_file_is_the_edge_spec(tmp_path, text, expected):
    """`edge_input: float32` (and `none`) in YAML mean what --edge-input-type takes."""
    path = tmp_path / "c.yaml"
    path.write_text(f"preset: U8S8\nedge_input: {text}\n")
    config = onnxq.config.compose.compose_config(None, str(path), {})
    assert input_quantized(onnxq.quantize(MODEL, None, config, CALIB).model) == expected


def test_a_bare_edge_dtype_merges_like_the_flag():
    """`edge_weight: uint8` over W4A8 changes its dtype only, as --edge-weight-type does:
    the preset's symmetric per-channel spec stays."""
    config = onnxq.config.compose.compose_config("W4A8", None, {"edge_weight": "uint8"})
    assert config.edge_weight == onnxq.QuantizationSpec(dtype="uint8", symmetric=True, qscheme="per_channel")


def test_depthwise_weight_from_a_config_file_on_an_int8_recipe():
    """On any recipe: int4 depthwise weights where everything else is int8, as a bare dtype."""
    from onnxq.config.compose import compose_config

    config = compose_config("U8S8", None, {"depthwise_weight": "int4"})
    result = onnxq.quantize(MODEL, None, config, CALIB)
    assert weight_types(result.model) == [INT8, INT4, INT8, INT8]
    onnx.checker.check_model(result.model, full_check=True)
    feed = random_feeds(MODEL, 1, seed=9)[0]
    assert sqnr_db(run(MODEL, feed), run(result.model, feed)) > 15


def _depthwise_first():
    """A depthwise Conv first (an edge layer), a 1x1 Conv, a Gemm."""
    from helpers import GraphBuilder

    b = GraphBuilder(5)
    x = b.relu(b.conv(b.input("x", ["N", 8, 8, 8]), 8, 8, group=8))
    x = b.node("Flatten", [b.relu(b.conv(x, 8, 8, k=1))])
    return b.build([b.gemm(x, 8 * 8 * 8, 10)], name="depthwise_first")


def test_the_users_node_field_wins_over_the_depthwise_spec():
    config = onnxq.get_preset("U8S8")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="int4", symmetric=False)
    depthwise = [n.name for n in MODEL.graph.node if n.op_type == "Conv"][1]
    config.layer_quant_config = {depthwise: onnxq.QuantizationConfig(weight=onnxq.QuantizationSpec(dtype="uint8"))}
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == [INT8, onnx.TensorProto.UINT8, INT8,
                                                                             INT8]


def test_a_depthwise_edge_layer_takes_the_edge_weight_spec_whole():
    """Not the depthwise spec, and not a mix: the depthwise spec's fields the edge spec
    leaves unset (bits, granularity) do not reach the edge layer."""
    model = _depthwise_first()
    config = onnxq.get_preset("U8S8")
    config.edge_weight = onnxq.QuantizationSpec(dtype="uint8")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="int4", bits=3, qscheme="per_tensor", symmetric=False)
    result = onnxq.quantize(model, None, config, random_feeds(model, 8, seed=1))
    u8 = onnx.TensorProto.UINT8
    assert weight_types(result.model) == [u8, INT8, u8]
    first = next(n for n in result.model.graph.node if n.op_type == "Conv")
    scale = next(t for t in result.model.graph.initializer
                 if t.name == next(n for n in result.model.graph.node if n.output[0] == first.input[1]).input[1])
    assert list(scale.dims) == [8]  # per-channel, as the preset's weights: not the depthwise spec's per-tensor
    (edges,) = of(result.summary.notes, Topic.CONFIG)  # no depthwise layer left for a note of its own
    assert "edge_weight" in edges.text
    # with only edge_input set, the depthwise edge layer takes depthwise_weight, and its note says so
    config = onnxq.get_preset("U8S8")
    config.edge_input = onnxq.QuantizationSpec(dtype="float32")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="int4")
    result = onnxq.quantize(model, None, config, random_feeds(model, 8, seed=1))
    assert weight_types(result.model)[0] == INT4
    assert any("depthwise_weight: the depthwise convolution" in n.text for n in of(result.summary.notes, Topic.CONFIG))


def test_a_grouped_conv_that_is_not_depthwise_keeps_the_global_spec():
    from helpers import GraphBuilder

    b = GraphBuilder(7)
    x = b.relu(b.conv(b.input("x", ["N", 8, 8, 8]), 8, 8, group=2))  # 4 input channels a group
    x = b.relu(b.conv(x, 8, 8, k=1))
    model = b.build([b.conv(x, 8, 4, group=4)], name="grouped")  # 2 input channels a group
    config = onnxq.get_preset("U8S8")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="int4")
    result = onnxq.quantize(model, None, config, random_feeds(model, 8, seed=1))
    assert weight_types(result.model) == [INT8, INT8, INT8]
    assert not of(result.summary.notes, Topic.CONFIG)


def test_an_invalid_depthwise_spec_is_refused_under_its_own_key():
    config = onnxq.get_preset("U8S8")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="int32")
    with pytest.raises(ConfigError, match="dtype int32 in depthwise_weight; 32-bit"):
        onnxq.quantize(MODEL, None, config, CALIB)


@pytest.mark.parametrize("value", ["int8", {"dtype": "int8", "symmetric": True}])
def test_code_may_set_a_layer_class_key_as_a_file_writes_it(value):
    """A dtype name or a mapping, as in YAML, means the same as a spec."""
    config = onnxq.get_preset("W4A8")
    config.depthwise_weight = value
    config.edge_weight = "none"
    assert weight_types(onnxq.quantize(MODEL, None, config, CALIB).model) == [INT4, INT8, INT4, INT4]


def test_a_float16_layer_class_weight_beside_integer_inputs_is_refused():
    config = onnxq.get_preset("W4A8")
    config.depthwise_weight = onnxq.QuantizationSpec(dtype="bfloat16")
    with pytest.raises(ConfigError, match="^depthwise_weight: weight dtype bfloat16 with uint8 input_tensors in node"):
        onnxq.quantize(MODEL, None, config, CALIB)
