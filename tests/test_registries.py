"""A new strategy with its lowering, or a new pass, is one file and one registration line.

The toy strategy claims the Relu nodes that read a graph input and its lowering rewrites
each as Max(x, 0); the toy pass removes multiplications by a constant 1. Both are
registered here alone (no package edit) and the tests check the quantizer really used
them: the emitted graph has the rewrite, passes onnx.checker, runs in a default
onnxruntime session and matches the float model by the stated metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import GraphBuilder, cosine, random_feeds, run

import onnxq
from onnxq.config.compose import compose_config
from onnxq.emit.lowering import LOWERINGS, LoweringReport, register_lowering
from onnxq.errors import ConfigError
from onnxq.notes import Topic, of
from onnxq.optimize import CONTRACTS, PASSES, register_pass
from onnxq.plan.strategies import STRATEGIES, Lower, register_strategy


@pytest.fixture
def toy_strategy():
    @register_strategy("relu_as_max_toy", order=5)
    def claim(node, cfg, planner):
        if node.op_type == "Relu" and node.inputs[0].is_graph_input():
            return Lower(cfg.input_tensors)
        return None

    @register_lowering("relu_as_max_toy", order=50)
    def lower(model: ir.Model, nodes: Mapping, config) -> LoweringReport:
        graph = model.graph
        zero = ir.Value(name="toy_zero", const_value=ir.tensor(np.zeros((), np.float32)))
        graph.register_initializer(zero)
        for node in [n for n in graph if n.name in nodes]:
            new = ir.node("Max", [node.inputs[0], zero], name=f"{node.name}_as_max")
            ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
        return LoweringReport(notes=[f"toy: {len(nodes)} Relu as Max"])

    yield "relu_as_max_toy"
    STRATEGIES.pop("relu_as_max_toy", None)
    LOWERINGS.pop("relu_as_max_toy", None)


@dataclass(frozen=True)
class DropOptions:
    keep: tuple[str, ...] = ()  # Mul nodes left alone


@pytest.fixture
def toy_pass():
    @register_pass("drop_mul_by_one_toy", options=DropOptions, rewrites=("graph",))
    def drop_mul_by_one(model: ir.Model, opts: DropOptions, ctx) -> str:
        dropped = 0
        for node in [n for n in model.graph if n.name not in opts.keep]:
            one = node.inputs[1] if node.op_type == "Mul" and len(node.inputs) == 2 else None
            if one is None or one.const_value is None or not np.all(one.const_value.numpy() == 1):
                continue
            node.outputs[0].replace_all_uses_with(node.inputs[0])
            model.graph.remove(node, safe=True)
            dropped += 1
        return f"{dropped} Mul by 1 removed"

    yield "drop_mul_by_one_toy"
    PASSES.pop("drop_mul_by_one_toy", None)
    CONTRACTS.pop("drop_mul_by_one_toy", None)


def relu_matmul_model() -> onnx.ModelProto:
    b = GraphBuilder(4)
    x = b.input("x", ["N", 16])
    h = b.node("Mul", [b.node("Relu", [x]), b.const("one", np.ones((), np.float32))])
    y = b.matmul(h, 16, 8)
    return b.build([y], name="toy_registries")


def test_registered_strategy_and_lowering_rewrite_the_nodes_they_claim(toy_strategy):
    model = relu_matmul_model()
    feeds = random_feeds(model, 8, seed=2)
    result = onnxq.quantize(model, None, "U8S8", feeds)
    q = result.model
    onnx.checker.check_model(q, full_check=True)
    ops = [n.op_type for n in q.graph.node]
    assert "Relu" not in ops and "Max" in ops
    assert "toy: 1 Relu as Max" in result.summary.note_texts
    assert result.summary.quantized_by_op.get("Relu") == 1  # counted as handled, not float
    assert result.plan.nodes_for(toy_strategy) and not result.plan.float_nodes.get("Relu")
    assert cosine(run(q, feeds), run(model, feeds)) > 0.999


def test_without_the_toy_strategy_the_relu_stays(toy_strategy):
    STRATEGIES.pop(toy_strategy)
    q = onnxq.quantize(relu_matmul_model(), None, "U8S8", random_feeds(relu_matmul_model(), 4, seed=2)).model
    assert "Relu" in [n.op_type for n in q.graph.node]


def test_registered_pass_runs_from_python_and_dict_configs(toy_pass):
    model = relu_matmul_model()
    feeds = random_feeds(model, 8, seed=2)
    config = onnxq.get_preset("U8S8")
    config.pre_quant_opt_config = [{"name": toy_pass}]
    result = onnxq.quantize(model, None, config, feeds)
    assert "Mul" not in [n.op_type for n in result.model.graph.node]
    (note,) = of(result.summary.notes, Topic.PASS, toy_pass)
    assert note.text == f"{toy_pass}: 1 Mul by 1 removed"
    by_dict = onnxq.quantize(model, None, compose_config("U8S8", None, {"pre_quant_opt_config": [{"name": toy_pass}]}),
                             feeds)
    assert by_dict.model.SerializeToString() == result.model.SerializeToString()
    assert cosine(run(result.model, feeds), run(model, feeds)) > 0.999
    # Its contract types its options: a misspelled one fails before the model is read.
    with pytest.raises(ConfigError, match="did you mean 'keep'"):
        onnxq.quantize("no-such-model.onnx", None,
                       compose_config("U8S8", None, {"pre_quant_opt_config": [{"name": toy_pass, "kepp": []}]}))


def test_a_strategy_name_cannot_be_registered_twice(toy_strategy):
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(toy_strategy, order=1)(lambda node, cfg, planner: None)


def test_a_name_another_module_registered_takes_replace(monkeypatch):
    """A plugin's `adaround` silently ran in place of onnxq's (API trial): refused without
    replace=True, named by where each comes from."""
    from onnxq.errors import ConfigError
    from onnxq.optimize import ALGORITHMS, register_algorithm
    from onnxq.optimize.registry import CONTRACTS

    monkeypatch.setitem(ALGORITHMS, "adaround", ALGORITHMS["adaround"])  # restored after the test
    monkeypatch.setitem(CONTRACTS, "adaround", CONTRACTS["adaround"])

    def fake(model, plan, ranges, options, ctx):
        return "fake"

    with pytest.raises(ConfigError, match="registers 'adaround', which onnxq.optimize.adaround registered already"):
        register_algorithm("adaround", data="none")(fake)
    register_algorithm("adaround", data="none", replace=True)(fake)
    assert ALGORITHMS["adaround"] is fake
