"""Deployment targets (`onnxq/target/`, docs/kernels.md): the kernel probe, the weight bit
widths each target gives, their flags and errors, `compare` with deployed and reference
kernels, and the load check with float fallback (`onnxq/emit/loadcheck.py`).

Every test here passes on any CPU. Where the answer depends on the machine (does this
onnxruntime's int8 GEMM saturate?), the test asks the probe and checks that everything
else is consistent with its answer: an independent numpy simulation of the saturating
kernel, the CPU flags docs/kernels.md names, and what a default session actually deploys.
"""

from __future__ import annotations

import hashlib
import importlib
import platform
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import (
    KERNEL_MARGIN_DB,
    GraphBuilder,
    assert_pair_safe,
    check_deployed,
    conv_relu_chain,
    initializers,
    producers,
    random_feeds,
    reference_run,
    run,
    save,
    session,
    sqnr_db,
    stack_feeds,
)
from onnx import TensorProto, helper, numpy_helper

import onnxq
from onnxq.cli import main
from onnxq.config import Config
from onnxq.config.compose import compose_config
from onnxq.emit.loadcheck import UNLOADABLE, Trial, find_culprits
from onnxq.errors import ConfigError, OnnxqError
from onnxq.target import resolve_target
from onnxq.target.probe import saturating_kernels
from onnxq.target.profile import AVX2_SATURATING

# `onnxq.quantize` is the function; the module behind it holds `model_loads`.
QUANTIZE_MODULE = importlib.import_module("onnxq.pipeline.emission")  # where the loadable check looks

INT16_MIN, INT16_MAX = -(2**15), 2**15 - 1
SEVEN_BIT = (-64, 63)  # codes of 7-bit weights in an int8 container (onnxruntime's reduce_range)


def gemm_saturates() -> bool:
    """The probe's verdict on this CPU: does the quantized GEMM saturate u8 x s8 pairs?"""
    return ("uint8", "gemm") in saturating_kernels()


# ---------------------------------------------------------------------------------------
# the probe, against an independent simulation of the kernel (docs/kernels.md, section 2)


def simulate_pairwise_int16(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A[M,K] (raw uint8 codes) x W[K,N] (raw int8 codes) as AVX2 without VNNI computes it:
    `vpmaddubsw` adds the products of K pairs (0,1), (2,3), ... into int16 with saturation,
    then `vpmaddwd` sums those exactly in int32."""
    products = a.astype(np.int64)[:, :, None] * w.astype(np.int64)[None, :, :]
    pairs = products[:, 0::2, :] + products[:, 1::2, :]
    return np.clip(pairs, INT16_MIN, INT16_MAX).sum(axis=1)


def exact_product(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) @ w.astype(np.int64)


def kernel_operands(seed: int, w_range: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Seeded activation codes (uint8; the first row all 255) and weight codes in
    `w_range` (the first column all at the range's top, so adjacent pairs of row 0 and
    column 0 hold the worst case). K = 64, a multiple of every MLAS K packing."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (4, 64)).astype(np.uint8)
    a[0] = 255
    w = rng.integers(w_range[0], w_range[1] + 1, (64, 8)).astype(np.int8)
    w[:, 0] = w_range[1]
    return a, w


def qdq_matmul_model(w: np.ndarray, activation: str) -> onnx.ModelProto:
    """Float X -> Q -> DQ (scale 1, zero point 0) -> MatMul with DQ(W) and no output Q:
    onnxruntime fuses it into MatMulIntegerToFloat, whose float output is the integer
    accumulator itself (|acc| < 2^24 is exact in float32)."""
    x_type = TensorProto.UINT8 if activation == "uint8" else TensorProto.INT8
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             helper.make_tensor("x_zp", x_type, [], [0]),
             numpy_helper.from_array(w, "wq"),
             helper.make_tensor("w_zp", TensorProto.INT8, [], [0])]
    nodes = [helper.make_node("QuantizeLinear", ["x", "one", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "one", "x_zp"], ["xdq"]),
             helper.make_node("DequantizeLinear", ["wq", "one", "w_zp"], ["w"]),
             helper.make_node("MatMul", ["xdq", "w"], ["y"])]
    graph = helper.make_graph(nodes, "qdq_matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def matmul_integer_model(w: np.ndarray) -> onnx.ModelProto:
    """MatMulInteger u8 x s8 with a constant B: the kernel behind dynamic quantization."""
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["x", "w"], ["y"])], "matmul_integer",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [None, w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def deployed_product(kernel: str, activation: str, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A x W through a default session: `gemm` as a fused QDQ MatMul, `dynamic` as
    MatMulInteger. int8 activations are given as their int8 values (a - 128)."""
    if kernel == "dynamic":
        return run(matmul_integer_model(w), {"x": a}).astype(np.int64)
    x = a.astype(np.float32) - (128 if activation == "int8" else 0)
    y = run(qdq_matmul_model(w, activation), {"x": x})
    assert np.array_equal(y, np.rint(y)), "MatMulIntegerToFloat output is not an integer"
    return y.astype(np.int64)


def expected_products(activation: str, a: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exact, as AVX2 computes it). x86 runs int8 activations as uint8 codes a = x + 128
    and subtracts 128 * colsum(W) exactly afterwards (docs/kernels.md, sections 2 and 5)."""
    shift = 128 if activation == "int8" else 0
    correction = shift * w.astype(np.int64).sum(axis=0)
    return exact_product(a, w) - correction, simulate_pairwise_int16(a, w) - correction


CASES = [("gemm", "uint8"), ("gemm", "int8"), ("dynamic", "uint8")]


@pytest.mark.parametrize(("kernel", "activation"), CASES)
def test_probe_agrees_with_a_numpy_simulation_of_the_kernel(kernel, activation):
    """Independent of the probe's own models: a default session computes either the exact
    product or exactly what the simulated AVX2 kernel gives, and which one it is matches
    the probe's verdict for that kernel class."""
    a, w = kernel_operands(seed=5, w_range=(-127, 127))  # never -128: ARM NEON's one corner
    exact, simulated = expected_products(activation, a, w)
    assert np.any(exact != simulated), "the operands must tell the two kernels apart"
    got = deployed_product(kernel, activation, a, w)
    is_exact, is_simulated = np.array_equal(got, exact), np.array_equal(got, simulated)
    assert is_exact or is_simulated, (
        f"{kernel}/{activation}: a default session computed neither the exact product nor the "
        f"pairwise-int16 one; worst error {np.abs(got - exact).max()}")
    assert is_simulated == ((activation, kernel) in saturating_kernels())


@pytest.mark.parametrize(("kernel", "activation"), CASES)
def test_seven_bit_weights_are_exact_on_every_kernel(kernel, activation):
    """|w| <= 64 can never saturate (2 x 255 x 64 = 32640): the simulation agrees with
    exact arithmetic, and so does this CPU's default session, whatever it is."""
    a, w = kernel_operands(seed=6, w_range=SEVEN_BIT)
    exact, simulated = expected_products(activation, a, w)
    assert np.array_equal(exact, simulated)
    np.testing.assert_array_equal(deployed_product(kernel, activation, a, w), exact)


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    return set(text.split())


def test_probe_is_consistent_with_docs_and_cpu_flags():
    """What saturates is a subset of what AVX2 saturates, depthwise Conv never does, and on
    x86 the CPU flags predict the answer (docs/kernels.md, section 3)."""
    found = saturating_kernels()
    assert found <= AVX2_SATURATING, found
    assert not any(kernel == "depthwise" for _, kernel in found), found
    flags = _cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or flags is None:
        return
    vnni = bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    if vnni:
        assert found == frozenset(), f"VNNI CPU, yet the probe found {found}"
    elif flags & {"avx2", "avx512bw"}:
        assert found == AVX2_SATURATING, f"AVX2 without VNNI, yet the probe found {found}"
        assert resolve_target(Config()).name == "x86-avx2"


# ---------------------------------------------------------------------------------------
# weight bit widths per target


def mixed_model(seed: int = 21) -> onnx.ModelProto:
    """3x3 Conv, depthwise Conv, pointwise Conv (each + Relu), pool, Gemm + Relu, MatMul."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 8, 8, 8])
    x = b.relu(b.conv(x, 8, 16))
    x = b.relu(b.conv(x, 16, 16, group=16))
    x = b.relu(b.conv(x, 16, 16, k=1))
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    x = b.relu(b.gemm(x, 16, 12))
    return b.build([b.matmul(x, 12, 10)], name="mixed")


MIXED = mixed_model()
# GraphBuilder's node names in mixed_model, by kernel class.
GEMM_NODES = {"conv_3", "conv_11", "gemm_17", "matmul_20"}  # 3x3 Conv, pointwise Conv, Gemm, MatMul
DEPTHWISE_NODES = {"conv_7"}


def quantize_mixed(overrides: dict, preset: str = "U8S8") -> onnxq.QuantizationResult:
    config = compose_config(preset, None, overrides)
    return onnxq.quantize(MIXED, None, config, random_feeds(MIXED, 8, seed=1, batch=2))


def weight_codes(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Node name -> integer weight codes of every Conv/Gemm/MatMul."""
    inits, prods = initializers(model), producers(model)
    codes = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            dq = prods[node.input[1]]
            assert dq.op_type == "DequantizeLinear", node.name
            codes[node.name] = inits[dq.input[0]]
    assert set(codes) == GEMM_NODES | DEPTHWISE_NODES
    return codes


def assert_bits(codes: dict[str, np.ndarray], names: set[str], bits: int) -> None:
    """Codes of `names` are int8 within the `bits`-bit range and use it (symmetric weights
    reach the largest magnitude)."""
    top = 2 ** (bits - 1)
    for name in names:
        w = codes[name]
        assert w.dtype == np.int8, name
        assert -top <= w.min() and w.max() <= top - 1, f"{name}: codes {w.min()}..{w.max()} exceed {bits} bits"
        assert np.abs(w.astype(np.int32)).max() >= top - 1, f"{name}: codes {w.min()}..{w.max()} are below {bits} bits"


@pytest.mark.parametrize("target", ["x86-avx2", "generic"])
def test_avx2_targets_keep_gemm_weights_pair_safe_and_depthwise_at_8_bits(target):
    result = quantize_mixed({"target": target})
    assert_pair_safe(result.model, GEMM_NODES)
    assert_bits(weight_codes(result.model), DEPTHWISE_NODES, 8)


def test_generic_is_x86_avx2():
    a = quantize_mixed({"target": "generic"}).model
    b = quantize_mixed({"target": "x86-avx2"}).model
    assert [i.SerializeToString() for i in a.graph.initializer] == [i.SerializeToString() for i in b.graph.initializer]
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    assert resolve_target(compose_config("U8S8", None, {"target": "generic"})).saturating == \
        resolve_target(compose_config("U8S8", None, {"target": "x86-avx2"})).saturating


@pytest.mark.parametrize("target", ["x86-vnni", "arm64", "gpu"])
def test_exact_targets_keep_8_bit_weights(target):
    codes = weight_codes(quantize_mixed({"target": target}).model)
    assert_bits(codes, GEMM_NODES | DEPTHWISE_NODES, 8)


def test_auto_narrows_exactly_what_the_probe_says_saturates():
    model = quantize_mixed({"target": "auto"}).model
    codes = weight_codes(model)
    if gemm_saturates():
        assert_pair_safe(model, GEMM_NODES)
    else:
        assert_bits(codes, GEMM_NODES, 8)
    assert_bits(codes, DEPTHWISE_NODES, 8)


@pytest.mark.parametrize("target", ["x86-vnni", "x86-avx2"])
def test_reduce_range_true_gives_7_bits_to_every_int8_activation_op(target):
    codes = weight_codes(quantize_mixed({"target": target, "reduce_range": True}).model)
    assert_bits(codes, GEMM_NODES | DEPTHWISE_NODES, 7)


@pytest.mark.parametrize("target", ["x86-avx2", "generic", "auto"])
def test_reduce_range_false_gives_8_bits_even_where_kernels_saturate(target):
    codes = weight_codes(quantize_mixed({"target": target, "reduce_range": False}).model)
    assert_bits(codes, GEMM_NODES | DEPTHWISE_NODES, 8)


@pytest.mark.parametrize("target", ["x86-avx2", "x86-vnni"])
def test_explicit_bits_win_over_the_target(target):
    codes = weight_codes(quantize_mixed({"target": target, "global_quant_config": {"weight": {"bits": 6}}}).model)
    for name, w in codes.items():
        assert np.abs(w.astype(np.int32)).max() <= 32, name
    assert_bits(codes, GEMM_NODES | DEPTHWISE_NODES, 6)
    # An explicit 8 also wins: full-width weights even where AVX2 would saturate.
    codes = weight_codes(quantize_mixed({"target": target, "global_quant_config": {"weight": {"bits": 8}}}).model)
    assert_bits(codes, GEMM_NODES | DEPTHWISE_NODES, 8)


def test_per_tensor_weights_of_saturating_kernels_are_uint8():
    """One per-tensor scale would have to hold every channel's kernel pairs: where u8 x s8
    saturates, per-tensor GEMM weights are uint8 (zero point 128), whose U8U8 kernels are
    exact; depthwise weights keep int8. It deploys within the kernel margin on any CPU."""
    model = quantize_mixed({"target": "x86-avx2",
                            "global_quant_config": {"weight": {"qscheme": "per_tensor"}}}).model
    codes, inits, prods = weight_codes(model), initializers(model), producers(model)
    for name in GEMM_NODES:
        dq = prods[next(n for n in model.graph.node if n.name == name).input[1]]
        assert codes[name].dtype == np.uint8 and inits[dq.input[2]] == 128, name
        assert np.abs(codes[name].astype(np.int32) - 128).max() >= 127, name  # the full 8 bits
    assert_bits(codes, DEPTHWISE_NODES, 8)
    feeds = random_feeds(MIXED, 8, seed=2, batch=2)
    check_deployed(run(MIXED, feeds), model, feeds, MIXED_FLOOR_DB - 4)
    # a reduce_range or bits choice of the user's still wins
    narrowed = quantize_mixed({"target": "x86-avx2", "reduce_range": True,
                               "global_quant_config": {"weight": {"qscheme": "per_tensor"}}}).model
    assert_bits(weight_codes(narrowed), GEMM_NODES, 7)


def test_the_u8u8_probe_finds_this_cpus_kernel_exact():
    """Every onnxruntime CPU build computes U8U8 exactly (it widens before multiplying):
    the probe that guards the uint8 per-tensor choice says so here."""
    from onnxq.target.probe import wrong_kernels

    assert "u8u8_gemm" not in wrong_kernels()


# ---------------------------------------------------------------------------------------
# what deploys on this CPU


# The quantization arithmetic of `mixed_model` against float (reference_run), measured on
# x86 AVX2 without VNNI: 7-bit Conv/Gemm/MatMul weights with the bias correction the target
# adds 34.0 dB (deployed: 34.0), 8-bit weights 34.9 dB. Floor: the 7-bit figure minus 2 dB;
# 8-bit weights (target auto on VNNI/ARM) only raise it.
MIXED_FLOOR_DB = 32.0


@pytest.mark.parametrize("target", ["auto", "x86-avx2"])
def test_target_deploys_within_the_margin_of_its_reference(target):
    """auto on this CPU, whatever it is, and x86-avx2 (7-bit weights run exactly anywhere):
    a default session loses nothing material beyond the QDQ arithmetic."""
    q = quantize_mixed({"target": target}).model
    feeds = random_feeds(MIXED, 8, seed=2, batch=2)
    ref_db, dep_db = check_deployed(run(MIXED, feeds), q, feeds, MIXED_FLOOR_DB)
    assert ref_db < 80, "quantization must be visible"


def positive_matmul(seed: int = 31) -> onnx.ModelProto:
    """One MatMul whose weights are all positive: per-channel int8 codes of about 64..127
    with the same sign in every pair, fed by asymmetric uint8 codes around 128, so nearly
    every pair of products exceeds int16 on a saturating kernel."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 64])
    w = b.rng.uniform(0.5, 1.0, (64, 16)).astype(np.float32) / 8
    return b.build([b.node("MatMul", [x, b.const("w", w)])], name="positive_matmul")


def test_eight_bit_weights_deploy_exactly_iff_the_probe_says_so():
    """The probe's verdict decides what a default session does with 8-bit weights: within
    the margin of the reference where the GEMM is exact, far below it where it saturates."""
    model = positive_matmul()
    q = onnxq.quantize(model, None, compose_config("U8S8", None, {"target": "x86-vnni"}),
                       random_feeds(model, 16, seed=1, batch=4)).model
    feeds = random_feeds(model, 8, seed=2, batch=4)
    float_out = run(model, feeds)
    ref_db, dep_db = sqnr_db(float_out, reference_run(q, feeds)), sqnr_db(float_out, run(q, feeds))
    assert ref_db >= 33.0  # measured 35.5
    if gemm_saturates():
        assert dep_db < ref_db - 10, f"saturating kernel, yet deployed {dep_db:.1f} dB vs reference {ref_db:.1f}"
    else:
        assert dep_db >= ref_db - KERNEL_MARGIN_DB


# ---------------------------------------------------------------------------------------
# configuration errors and CLI flags


@pytest.mark.parametrize(("overrides", "message"), [
    ({"global_quant_config": {"weight": {"bits": 9}}}, "invalid bits 9"),
    ({"global_quant_config": {"weight": {"bits": 1}}}, "invalid bits 1"),
    ({"global_quant_config": {"input_tensors": {"bits": 7}}}, "bits narrows weights only"),
    ({"global_quant_config": {"weight": {"dtype": "int4", "bits": 7}}}, "bits 7 with dtype int4"),
])
def test_bad_bits_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        quantize_mixed(overrides)
    assert "\n" not in str(info.value)


def test_unknown_target_is_a_config_error():
    with pytest.raises(ConfigError, match="x86-avx2"):
        quantize_mixed({"target": "x86-avx3"})


@pytest.fixture
def cli_inputs(tmp_path):
    """(float model path, calibration .npz) of `mixed_model`."""
    model = save(MIXED, tmp_path / "mixed.onnx")
    data = tmp_path / "calib.npz"
    np.savez(data, **stack_feeds(random_feeds(MIXED, 8, seed=1, batch=2)))
    return model, data


def _cli_quantize(cli_inputs, out: Path, *flags: str) -> int:
    model, data = cli_inputs
    return main(["quantize", str(model), str(out), "--calib-data", str(data), *flags])


@pytest.mark.parametrize(("flags", "message"), [
    (["--weight-bits", "9"], "invalid --weight-bits 9"),
    (["--weight-type", "int4", "--weight-bits", "7"], "--weight-bits 7 with --weight-type int4"),
    (["--target", "nowhere"], "target"),
])
def test_cli_bad_bits_exit_2_with_one_line(cli_inputs, tmp_path, capsys, flags, message):
    out = tmp_path / "q.onnx"
    assert _cli_quantize(cli_inputs, out, "--quiet", *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("onnxq: error:") and message in err, err
    assert not out.exists()


def test_cli_bits_on_activations_in_a_config_file_exit_2(cli_inputs, tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    config.write_text("global_quant_config:\n  input_tensors:\n    bits: 7\n")
    out = tmp_path / "q.onnx"
    assert _cli_quantize(cli_inputs, out, "--quiet", "--config", str(config)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bits narrows weights only" in err, err


@pytest.mark.parametrize(("flags", "gemm_bits", "depthwise_bits"), [
    (["--target", "x86-avx2"], "pairs", 8),
    (["--target", "x86-vnni"], 8, 8),
    (["--target", "x86-vnni", "--reduce-range"], 7, 7),
    (["--target", "x86-avx2", "--no-reduce-range"], 8, 8),
    (["--target", "x86-avx2", "--weight-bits", "6"], 6, 6),
])
def test_cli_target_flags(cli_inputs, tmp_path, capsys, flags, gemm_bits, depthwise_bits):
    out = tmp_path / "q.onnx"
    assert _cli_quantize(cli_inputs, out, *flags) == 0
    model = onnx.load(str(out))
    codes = weight_codes(model)
    if gemm_bits == "pairs":
        assert_pair_safe(model, GEMM_NODES)
    else:
        assert_bits(codes, GEMM_NODES, gemm_bits)
    assert_bits(codes, DEPTHWISE_NODES, depthwise_bits)
    # The summary's first lines name the target (and, for a config override, say so).
    head = capsys.readouterr().out.splitlines()[:3]
    target = flags[1]
    assert any(line.strip().startswith(f"target {target}") for line in head), head
    if "--reduce-range" in flags or "--no-reduce-range" in flags:
        assert any("reduce_range" in line for line in head), head


def test_cli_summary_names_the_probed_target(cli_inputs, tmp_path, capsys):
    assert _cli_quantize(cli_inputs, tmp_path / "q.onnx") == 0
    head = capsys.readouterr().out.splitlines()[:3]
    expected = resolve_target(Config()).name
    assert any(line.strip().startswith(f"target {expected}: auto: probed") for line in head), head


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("target", ["auto", "x86-avx2"])
def test_output_is_byte_identical_across_runs(cli_inputs, tmp_path, target):
    """Including the bias correction that narrowing targets add."""
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    assert _cli_quantize(cli_inputs, a, "--quiet", "--target", target) == 0
    assert _cli_quantize(cli_inputs, b, "--quiet", "--target", target) == 0
    assert _digest(a) == _digest(b)


# ---------------------------------------------------------------------------------------
# compare: deployed and reference kernels


@pytest.fixture
def eight_bit_matmul(tmp_path):
    """(float path, 8-bit-weight quantized path, eval .npz) of `positive_matmul`."""
    model = positive_matmul()
    float_path = save(model, tmp_path / "float.onnx")
    q = onnxq.quantize(model, None, compose_config("U8S8", None, {"target": "x86-vnni"}),
                       random_feeds(model, 16, seed=1, batch=4)).model
    q_path = save(q, tmp_path / "q8.onnx")
    data = tmp_path / "eval.npz"
    np.savez(data, **stack_feeds(random_feeds(model, 8, seed=2, batch=4)))
    return float_path, q_path, data


def test_compare_defaults_to_the_deployed_session(eight_bit_matmul, capsys):
    float_path, q_path, data = eight_bit_matmul
    assert main(["compare", str(float_path), str(q_path), "--data", str(data), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "default onnxruntime session" in out.splitlines()[0]
    assert "[reference kernels]" not in out and "warning" not in out


def test_compare_both_kernels_warns_where_8_bit_weights_saturate(eight_bit_matmul, capsys):
    float_path, q_path, data = eight_bit_matmul
    assert main(["compare", str(float_path), str(q_path), "--data", str(data), "--quiet",
                 "--kernels", "both"]) == 0
    lines = capsys.readouterr().out.splitlines()
    deployed = [line for line in lines if "SQNR" in line and "[reference kernels]" not in line]
    reference = [line for line in lines if "SQNR" in line and "[reference kernels]" in line]
    assert len(deployed) == 1 and len(reference) == 1, lines
    warnings = [line for line in lines if line.startswith("warning:")]
    if gemm_saturates():
        assert len(warnings) == 1, lines
        assert "--reduce-range" in warnings[0] or "--target auto" in warnings[0], warnings
    else:
        assert warnings == [], lines


def test_compare_reference_kernels_say_so(eight_bit_matmul, capsys):
    float_path, q_path, data = eight_bit_matmul
    assert main(["compare", str(float_path), str(q_path), "--data", str(data), "--quiet",
                 "--kernels", "reference"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "reference kernels" in first and "not what a default session runs" in first


# ---------------------------------------------------------------------------------------
# load check with float fallback


def _synthetic(culprits: set[str], calls: list[set[str]]):
    """An `emit` whose result loads exactly when every culprit is kept float."""
    def emit(kept: set[str]) -> Trial:
        calls.append(set(kept))
        return Trial(model=None, loads=culprits <= kept, payload=frozenset(kept))
    return emit


def test_find_culprits_finds_exactly_the_culprits():
    candidates = [f"n{i}" for i in range(10)]
    calls: list[set[str]] = []
    trial, found = find_culprits(candidates, _synthetic({"n3", "n7"}, calls))
    assert found == ["n3", "n7"]
    assert trial.loads and trial.payload == frozenset({"n3", "n7"})
    # About log2(10) trials per culprit, plus the all-float and final checks.
    assert len(calls) <= 2 * 5 + 3, len(calls)


@pytest.mark.parametrize("culprits", [set(), {"n0"}, {"n9"}, {f"n{i}" for i in range(10)}])
def test_find_culprits_edges(culprits):
    trial, found = find_culprits([f"n{i}" for i in range(10)], _synthetic(culprits, []))
    assert set(found) == culprits and trial.loads


def test_find_culprits_refuses_when_even_all_float_fails():
    def never(kept: set[str]) -> Trial:
        return Trial(model=None, loads=False)

    with pytest.raises(OnnxqError, match="even with every quantized node kept float"):
        find_culprits([f"n{i}" for i in range(10)], never)


REFUSED = "conv_7"  # the middle Conv of conv_relu_chain (GraphBuilder names)


def _weight_is_quantized(model: ir.Model, node_name: str) -> bool:
    node = next(n for n in model.graph if n.name == node_name)
    producer = node.inputs[1].producer()
    return producer is not None and producer.op_type == "DequantizeLinear"


def test_unloadable_node_is_kept_float(monkeypatch, tmp_path):
    """onnxruntime (simulated) refuses any model whose `conv_7` is quantized: the result
    keeps that Conv float, says so, quantizes the others, and loads for real."""
    real = QUANTIZE_MODULE.open_deployed
    calls = []

    def refuse(model: ir.Model, providers: list[str], prepack: bool = True):
        calls.append(_weight_is_quantized(model, REFUSED))
        return None if calls[-1] else real(model, providers, prepack)

    monkeypatch.setattr(QUANTIZE_MODULE, "open_deployed", refuse)
    monkeypatch.setattr(QUANTIZE_MODULE, "model_loads",
                        lambda model, providers, prepack=True: refuse(model, providers, prepack) is not None)
    model = conv_relu_chain()
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(model, out, "U8S8", random_feeds(model, 8, seed=1))
    assert calls[0] is True and len(calls) > 1  # the first emission was refused
    q = onnx.load(str(out))
    assert result.summary.float_nodes[REFUSED] == ("Conv", UNLOADABLE)
    assert REFUSED not in result.summary.quantized_by_op
    assert result.summary.quantized_by_op.get("Conv") == 2
    assert any("kept float because onnxruntime could not load" in n and REFUSED in n
               for n in result.summary.note_texts), result.summary.note_texts
    assert REFUSED in onnxq.format_summary(result.summary)
    prods, inits = producers(q), initializers(q)
    for node in q.graph.node:
        if node.op_type == "Conv":
            w = node.input[1]
            if node.name == REFUSED:
                assert w in inits and inits[w].dtype == np.float32
            else:
                assert prods[w].op_type == "DequantizeLinear", node.name
    feeds = random_feeds(model, 8, seed=2)
    assert sqnr_db(run(model, feeds), run(session(out), feeds)) >= 25.0
