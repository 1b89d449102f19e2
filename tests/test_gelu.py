"""A GELU written out as elementwise nodes (torch's nn.GELU exported) stays float inside
(`graph/gelu.py`, `plan/planner.py`): its inner tensors are not rounded, and onnxruntime
fuses it into one float kernel in the deployed model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import GraphBuilder, sqnr_db

import onnxq
from onnxq.graph.gelu import decomposed_gelus
from onnxq.graph.load import load_model
from onnxq.plan.planner import INSIDE_GELU

HIDDEN = 32


def _gelu(b: GraphBuilder, x: str, half_first: bool, scale_op: str = "Div") -> str:
    """torch's erf GELU, in either order of the 0.5."""
    c = np.float32(np.sqrt(2.0)) if scale_op == "Div" else np.float32(1 / np.sqrt(2.0))
    erf = b.node("Erf", [b.node(scale_op, [x, b.const("c", np.array(c))])])
    one_plus = b.node("Add", [erf, b.const("one", np.array(1.0, np.float32))])
    if half_first:
        return b.node("Mul", [b.node("Mul", [x, b.const("half", np.array(0.5, np.float32))]), one_plus])
    return b.node("Mul", [b.node("Mul", [x, one_plus]), b.const("half", np.array(0.5, np.float32))])


def _mlp(half_first: bool = False, scale_op: str = "Div", seed: int = 0) -> onnx.ModelProto:
    """MatMul + bias -> GELU -> MatMul, as a transformer's feed-forward block."""
    b = GraphBuilder(seed)
    x = b.input("x", ["batch", 8, HIDDEN])
    h = b.node("Add", [b.matmul(x, HIDDEN, 4 * HIDDEN), b.const("bias", b.small((4 * HIDDEN,), 0.5))])
    return b.build([b.matmul(_gelu(b, h, half_first, scale_op), 4 * HIDDEN, HIDDEN)], name="gelu_mlp")


def _data(n: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((n, 8, HIDDEN)).astype(np.float32)}


@pytest.mark.parametrize(("half_first", "scale_op"), [(False, "Div"), (True, "Div"), (False, "Mul")])
def test_both_orders_are_found_and_nothing_else(tmp_path, half_first, scale_op):
    path = tmp_path / "m.onnx"
    onnx.save(_mlp(half_first, scale_op), path)
    found = decomposed_gelus(load_model(str(path))[0].graph)
    assert [sorted(n.op_type for n in gelu) for gelu in found] == [sorted([scale_op, "Erf", "Add", "Mul", "Mul"])]
    # the same nodes with another constant (not 1 + erf) are no GELU
    model = _mlp(half_first, scale_op)
    for init in model.graph.initializer:
        if init.name.startswith("one"):
            init.CopyFrom(onnx.numpy_helper.from_array(np.array(2.0, np.float32), init.name))
    onnx.save(model, path)
    assert decomposed_gelus(load_model(str(path))[0].graph) == []


def test_a_quantized_gelu_stays_float_inside_and_fuses_in_the_deployed_session(tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_mlp(), src)
    result = onnxq.quantize(str(src), str(out), None, _data(64, 1), progress=False)
    inside = {name for name, (_, why) in result.plan.float_nodes.items() if why == INSIDE_GELU}
    assert len(inside) == 5 and not inside & set(result.plan.quantized_nodes)
    assert {"MatMul"} <= set(result.plan.quantized_nodes.values())
    onnx.checker.check_model(str(out), full_check=True)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(tmp_path / "opt.onnx").graph.node}
    assert ops & {"Gelu", "BiasGelu", "FastGelu"} and "Erf" not in ops, ops  # one fused float kernel
    held_out = _data(32, 2)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, held_out)[0]
    assert sqnr_db(ref, session.run(None, held_out)[0]) > 30.0


def test_an_override_on_an_inner_node_and_a_float_cast_keep_their_say(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_mlp(), src)
    gelu = decomposed_gelus(load_model(str(src))[0].graph)[0]
    last = gelu[-1].name
    config = {"layer_quant_config": {last: {"input_tensors": {"dtype": "uint8"}, "output_tensors": {"dtype": "uint8"}}}}
    result = onnxq.quantize(str(src), None, config, _data(32, 1), progress=False)
    # the user's node override is weighed by the usual rules (here: a float head), not this one
    assert result.plan.float_nodes.get(last, ("", ""))[1] != INSIDE_GELU
    assert sum(why == INSIDE_GELU for _, why in result.plan.float_nodes.values()) == 4
    half = onnxq.quantize(str(src), None, "FP16", None, progress=False)
    assert not any(why == INSIDE_GELU for _, why in half.plan.float_nodes.values())


def test_dynamic_and_power_of_two_recipes_and_op_type_overrides_keep_the_usual_rules(tmp_path):
    """No Q/DQ to stop a fusion in a dynamic recipe, integer-only hardware under XINT8, and
    an op-type override the user wrote: none of them gets the GELU's reason (review)."""
    src = tmp_path / "m.onnx"
    onnx.save(_mlp(), src)
    data = _data(32, 1)
    for config in ("W8_DYNAMIC", "XINT8", {"layer_type_quant_config": {"Mul": {
            "input_tensors": {"dtype": "uint8"}, "output_tensors": {"dtype": "uint8"}}}}):
        result = onnxq.quantize(str(src), None, config, data, progress=False)
        ruled = {op for op, why in result.plan.float_nodes.values() if why == INSIDE_GELU}
        assert not ruled if isinstance(config, str) else "Mul" not in ruled and "Erf" in ruled, (config, ruled)


def _bf16(value: float) -> float:
    """`value` rounded to bfloat16, as a bfloat16 export's constants are (kept float32 here)."""
    bits = np.array(value, np.float32).view(np.uint32)
    return float(((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32))


def _tanh_gelu(b: GraphBuilder, x: str, cube: str = "pow", cubic: float = 0.044715,
               root: float = float(np.sqrt(2 / np.pi))) -> str:
    """The tanh approximation as HF's gelu_new exports it (0.5 x first); `cube` "factored" /
    "factored_inner": the argument as Megatron's and BLOOM's bias_gelu write it,
    (0.79788456 * x) * (1 + (0.044715 * x) * x) as torch exports it / 0.79788456 * (x * (1 +
    0.044715 * (x * x)))."""
    if cube.startswith("factored"):
        c, k, one = (b.const(n, np.array(v, np.float32)) for n, v in (("c", cubic), ("k", root), ("one1", 1.0)))
        if cube == "factored":
            bracket = b.node("Add", [b.node("Mul", [b.node("Mul", [x, c]), x]), one])
            argument = b.node("Mul", [b.node("Mul", [x, k]), bracket])
        else:
            bracket = b.node("Add", [one, b.node("Mul", [c, b.node("Mul", [x, x])])])
            argument = b.node("Mul", [k, b.node("Mul", [x, bracket])])
        t = b.node("Tanh", [argument])
        return b.node("Mul", [b.node("Mul", [x, b.const("half", np.array(0.5, np.float32))]),
                              b.node("Add", [t, b.const("one", np.array(1.0, np.float32))])])
    three = np.array(3, np.int64) if cube == "pow_int" else np.array(3.0, np.float32)
    cubed = b.node("Pow", [x, b.const("three", three)]) if cube.startswith("pow") else \
        b.node("Mul", [b.node("Mul", [x, x]), x])
    inner = b.node("Add", [x, b.node("Mul", [b.const("c", np.array(cubic, np.float32)), cubed])])
    t = b.node("Tanh", [b.node("Mul", [b.const("k", np.array(root, np.float32)), inner])])
    one = b.node("Add", [b.const("one", np.array(1.0, np.float32)), t])
    return b.node("Mul", [b.node("Mul", [x, b.const("half", np.array(0.5, np.float32))]), one])


def _tanh_mlp(cube: str = "pow", cubic: float = 0.044715, root: float = float(np.sqrt(2 / np.pi))) -> onnx.ModelProto:
    b = GraphBuilder(0)
    x = b.input("x", ["batch", 8, HIDDEN])
    h = b.node("Add", [b.matmul(x, HIDDEN, 4 * HIDDEN), b.const("bias", b.small((4 * HIDDEN,), 0.5))])
    return b.build([b.matmul(_tanh_gelu(b, h, cube, cubic, root), 4 * HIDDEN, HIDDEN)], name="tanh_mlp")


@pytest.mark.parametrize("cube", ["pow", "pow_int", "mul", "factored", "factored_inner"])
def test_the_tanh_approximation_is_found_and_stays_float_inside(tmp_path, cube):
    """GPT-2's and HF's gelu_new: x * 0.5 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with
    x^3 as Pow or as x * x * x, and Megatron's / BLOOM's factored argument. On a 4-layer MLP
    of width 256 (random weights, 64 held-out samples) keeping it float gave 29.1 dB against
    27.0 dB with its links quantized, and onnxruntime fused the Pow and factored forms into
    FastGelu."""
    src = tmp_path / "m.onnx"
    onnx.save(_tanh_mlp(cube), src)
    (gelu,) = decomposed_gelus(load_model(str(src))[0].graph)
    assert len(gelu) == (8 if cube.startswith("pow") else 9)
    onnx.save(_tanh_mlp(cube, cubic=0.05), src)  # another polynomial: no GELU
    assert decomposed_gelus(load_model(str(src))[0].graph) == []
    onnx.save(_tanh_mlp(cube), src)
    out = tmp_path / "q.onnx"
    result = onnxq.quantize(str(src), str(out), None, _data(64, 1), progress=False)
    assert sum(why == INSIDE_GELU for _, why in result.plan.float_nodes.values()) == len(gelu)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(tmp_path / "opt.onnx").graph.node}
    fused = cube in ("pow", "factored")  # Pow(x, int 3) and x * x * x: not fused
    assert "QLinearMul" not in ops and (not fused or "FastGelu" in ops), ops
    held_out = _data(32, 2)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, held_out)[0]
    assert sqnr_db(ref, session.run(None, held_out)[0]) > 30.0


def test_constants_rounded_as_a_bfloat16_export_rounds_them_still_match(tmp_path):
    """bfloat16 rounds sqrt(2/pi) to 0.796875, 0.13% off (review): within the tolerance,
    which still tells the formula's constants from others (0.05 for 0.044715 is refused)."""
    src = tmp_path / "m.onnx"
    onnx.save(_tanh_mlp(cubic=_bf16(0.044715), root=_bf16(float(np.sqrt(2 / np.pi)))), src)
    assert len(decomposed_gelus(load_model(str(src))[0].graph)) == 1
    onnx.save(_tanh_mlp(cubic=0.05), src)
    assert decomposed_gelus(load_model(str(src))[0].graph) == []
