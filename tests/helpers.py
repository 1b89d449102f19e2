"""Builders for small float test models, and helpers to run and compare them.

Every builder returns an `onnx.ModelProto` (opset 17 unless told otherwise) with seeded,
well-conditioned weights: He-normal for Conv/Gemm/MatMul weights, small biases, so the
float model's activations stay O(1) and 8-bit quantization is meaningful. Inputs have a
dynamic batch dimension named "N" unless `batch` is given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


# ---------------------------------------------------------------------------------------
# numeric helpers


def sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB: 10*log10(sum(ref^2) / sum((ref-test)^2))."""
    ref = np.asarray(ref, dtype=np.float64)
    test = np.asarray(test, dtype=np.float64)
    assert ref.shape == test.shape, (ref.shape, test.shape)
    noise = float(np.sum((ref - test) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0.0:
        return float("inf")
    return 10.0 * np.log10(signal / noise)


def uneven_weights(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 1.5) -> np.ndarray:
    """Random weights whose output channels' magnitudes differ by up to e^(2 spread), as
    batch-norm-folded layers' do: per-tensor scales and rounding then matter."""
    w = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
    return (w * np.exp(rng.uniform(-spread, spread, shape[0])).reshape([-1] + [1] * (len(shape) - 1))).astype(
        np.float32)


def image_classifier(nodes: Sequence[onnx.NodeProto], inits: Mapping[str, np.ndarray], name: str) -> onnx.ModelProto:
    """A model of `nodes` from input x [N, 3, 16, 16] to logits y [N, 10], opset 17."""
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---------------------------------------------------------------------------------------
# running models


def session(model_or_path: onnx.ModelProto | str | os.PathLike, threads: int = 2,
            **options: Any) -> ort.InferenceSession:
    """A CPU onnxruntime session; `options` set attributes of SessionOptions."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    for key, value in options.items():
        setattr(so, key, value)
    if isinstance(model_or_path, onnx.ModelProto):
        source: Any = model_or_path.SerializeToString()
    else:
        source = str(model_or_path)
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def run(model_or_path: Any, feeds: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
        output: int | None = 0) -> Any:
    """Run with onnxruntime on CPU.

    `feeds` is one feed dict or a list of them (results are concatenated on axis 0).
    Returns output number `output` (default the first), or the list of all outputs when
    `output` is None.
    """
    sess = model_or_path if isinstance(model_or_path, ort.InferenceSession) else session(model_or_path)
    if isinstance(feeds, Mapping):
        outs = sess.run(None, dict(feeds))
    else:
        per_feed = [sess.run(None, dict(f)) for f in feeds]
        outs = [np.concatenate([o[i] for o in per_feed]) for i in range(len(per_feed[0]))]
    return outs if output is None else outs[output]


# Reference arithmetic: what a quantized model computes by the ONNX definitions of its ops,
# without this CPU's fused int8 kernels (docs/kernels.md: on x86 AVX2/AVX512BW without VNNI
# the u8 x s8 kernels add pairs of products in int16 and saturate).
# * Q/DQ plus float ops: onnxruntime with every graph optimisation off runs Quantize/
#   DequantizeLinear exactly as specified and the compute ops in float.
# * Standard integer-arithmetic ops (MatMulInteger, ConvInteger, QLinear*, with their
#   DynamicQuantizeLinear chains): onnx's numpy ReferenceEvaluator, exact in int32;
#   onnxruntime runs these through the same saturating kernels even unoptimised.
# * com.microsoft integer ops neither covers (DynamicQuantizeLSTM, ...): no independent
#   evaluator exists, so onnxruntime runs them with `session.x64quantprecision=1`, under
#   which its Avx2WeightS8ToU8Transformer turns their int8 weights into uint8 (zero point
#   +128) whenever some |w| > 64, so the exact U8U8 kernels run. The option acts on every
#   AVX2 or AVX512 x86 CPU (VNNI included) and is ignored elsewhere (ARM), where the
#   kernels are exact anyway. It needs graph optimisations on.
# Error floors are stated against the reference, so they are properties of the
# quantization arithmetic and hold on every CPU; `check_deployed` then asks the default
# session (what users run) to lose nothing material beyond it.
KERNEL_MARGIN_DB = 1.0
INTEGER_ARITHMETIC_OPS = {"MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear"}
CONTRIB_INTEGER_OPS = {"DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm",
                       "QAttention"}


def reference_run(model_or_path: Any, feeds: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
                  output: int | None = 0) -> Any:
    """Outputs of a quantized model computed with its reference arithmetic (see above),
    with `run`'s conventions for `feeds` and `output`."""
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(str(model_or_path))
    ops = {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
    if any(domain == "com.microsoft" and op in CONTRIB_INTEGER_OPS for domain, op in ops):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        options.log_severity_level = 3
        options.add_session_config_entry("session.x64quantprecision", "1")
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return run(sess, feeds, output)
    if any(domain == "ai.onnx" and op in INTEGER_ARITHMETIC_OPS for domain, op in ops):
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        feed_list = [feeds] if isinstance(feeds, Mapping) else list(feeds)
        per_feed = [evaluator.run(None, dict(f)) for f in feed_list]
        outs = [np.concatenate([o[i] for o in per_feed]) for i in range(len(per_feed[0]))]
        return outs if output is None else outs[output]
    sess = session(model, graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return run(sess, feeds, output)


def check_deployed(float_out: np.ndarray, quant: Any, feeds: Any, floor: float,
                   output: int | None = 0) -> tuple[float, float]:
    """Assert (1) the quantization arithmetic (`reference_run`) reaches `floor` dB of SQNR
    against the float output, and (2) the default session (this CPU's fused kernels) is
    within KERNEL_MARGIN_DB of it. Returns (reference dB, deployed dB).

    Floors are what the reference gives on the machine that set them minus about 2 dB;
    they hold for the weights `target: auto` picks on any CPU (floors set with 7-bit
    weights where the int8 kernels saturate; the pair-safe weights used there now are never
    coarser, and 8-bit where kernels are exact only raises the SQNR)."""
    ref_db = sqnr_db(float_out, reference_run(quant, feeds, output))
    dep_db = sqnr_db(float_out, run(quant, feeds, output))
    assert ref_db >= floor, f"reference arithmetic {ref_db:.1f} dB < {floor} dB"
    assert dep_db >= ref_db - KERNEL_MARGIN_DB, (
        f"default session {dep_db:.1f} dB loses more than {KERNEL_MARGIN_DB} dB to its "
        f"reference arithmetic {ref_db:.1f} dB: this CPU's int8 kernels lose accuracy")
    return ref_db, dep_db


_NP_OF_ONNX = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
}


PAIR_LIMIT = 128  # docs/kernels.md section 2: safe for every uint8 activation iff |w0 + w1| <= 128


def kernel_pair_sums(node: onnx.NodeProto, codes: np.ndarray) -> np.ndarray:
    """|w[2j] + w[2j+1]| of raw int8 weight codes for every pair that an x86 u8 x s8 kernel
    adds in int16, per output channel ([channels, pairs]); written from docs/kernels.md,
    independently of onnxq.target.pairs. Conv: K is (tap, input channel) tap-major for the
    GEMM path, and input channels within a tap for ConvSym; MatMul/Gemm: the reduction axis."""
    w = codes.astype(np.int64)
    if node.op_type == "Conv":
        taps_last = np.moveaxis(w, 1, -1)  # [M, kh, kw, C]
        rows = [taps_last.reshape(w.shape[0], -1), taps_last.reshape(-1, w.shape[1])]
    elif node.op_type == "Gemm" and attr(node, "transB", 0):
        rows = [w]  # [N, K]
    else:
        rows = [w.T]  # [K, N] -> [N, K]
    sums = []
    for r in rows:
        if r.shape[1] % 2:
            r = np.concatenate([r, np.zeros((r.shape[0], 1), np.int64)], axis=1)
        sums.append(np.abs(r[:, 0::2] + r[:, 1::2]).max(axis=1))
    return np.concatenate(sums)


def assert_pair_safe(model: onnx.ModelProto, names: set[str]) -> None:
    """The int8 weights of `names` never saturate the pairwise-int16 kernels, yet are finer
    than 7 bits: the tightest pair of some channel reaches the limit, and codes go past 64."""
    inits, prods = initializers(model), producers(model)
    for node in model.graph.node:
        if node.name not in names:
            continue
        codes = inits[prods[node.input[1]].input[0]]
        assert codes.dtype == np.int8, node.name
        sums = kernel_pair_sums(node, codes)
        assert sums.max() <= PAIR_LIMIT, f"{node.name}: a weight pair sums to {sums.max()} > {PAIR_LIMIT}"
        assert sums.max() >= PAIR_LIMIT - 1, f"{node.name}: pairs reach only {sums.max()}: scale not tight"
        assert np.abs(codes.astype(np.int32)).max() > 64, f"{node.name}: codes within 7 bits"


def input_specs(model: onnx.ModelProto | str | os.PathLike) -> list[tuple[str, type, list[int | None]]]:
    """(name, numpy dtype, dims with None for symbolic) of each real graph input."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tt = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        specs.append((value.name, _NP_OF_ONNX[tt.elem_type], dims))
    return specs


def random_feeds(model: onnx.ModelProto | str | os.PathLike, n: int, seed: int,
                 batch: int = 1, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    """`n` seeded standard-normal feed dicts (dynamic dims become `batch`)."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        feed = {}
        for name, dtype, dims in input_specs(model):
            shape = [batch if d is None else d for d in dims]
            feed[name] = (rng.standard_normal(shape) * scale).astype(dtype)
        feeds.append(feed)
    return feeds


def stack_feeds(feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Feed dicts with samples on axis 0, concatenated into one dict of arrays."""
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


# ---------------------------------------------------------------------------------------
# graph inspection


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output if o}


def consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            if i:
                out.setdefault(i, []).append(n)
    return out


def op_count(model: onnx.ModelProto, op_type: str, domain: str | None = None) -> int:
    return sum(
        1 for n in model.graph.node
        if n.op_type == op_type and (domain is None or n.domain == domain)
    )


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ---------------------------------------------------------------------------------------
# building models


class GraphBuilder:
    """Accumulates nodes and seeded initializers; each op method returns its output name."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.counter = 0

    def name(self, base: str) -> str:
        self.counter += 1
        return f"{base}_{self.counter}"

    def input(self, name: str, shape: Sequence[int | str], dtype: int = TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def const(self, base: str, array: np.ndarray) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def he(self, shape: Sequence[int], fan_in: int) -> np.ndarray:
        return (self.rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    def small(self, shape: Sequence[int], std: float = 0.05) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def node(self, op: str, inputs: Sequence[str], n_out: int = 1, domain: str = "",
             **attrs: Any) -> Any:
        name = self.name(op.lower())
        outs = [f"{name}_out{i}" if n_out > 1 else f"{name}_out" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, domain=domain, **attrs))
        return outs if n_out > 1 else outs[0]

    # -- layers ----------------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int = 3, stride: int = 1, group: int = 1,
             bias: bool = True, pad: int | None = None) -> str:
        pad = k // 2 if pad is None else pad
        w = self.const("conv_w", self.he((cout, cin // group, k, k), (cin // group) * k * k))
        inputs = [x, w] + ([self.const("conv_b", self.small((cout,)))] if bias else [])
        return self.node("Conv", inputs, kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, group=group)

    def conv_transpose(self, x: str, cin: int, cout: int, k: int = 2, stride: int = 2,
                       group: int = 1, bias: bool = True) -> str:
        w = self.const("convt_w", self.he((cin, cout // group, k, k), cin // group * k * k // (stride * stride)))
        inputs = [x, w] + ([self.const("convt_b", self.small((cout,)))] if bias else [])
        return self.node("ConvTranspose", inputs, kernel_shape=[k, k], strides=[stride, stride],
                         group=group)

    def gemm(self, x: str, k: int, n: int, trans_b: int = 1, bias: bool = True) -> str:
        w = self.he((n, k) if trans_b else (k, n), k)
        inputs = [x, self.const("gemm_w", w)] + ([self.const("gemm_b", self.small((n,)))] if bias else [])
        return self.node("Gemm", inputs, transB=trans_b)

    def matmul(self, x: str, k: int, n: int) -> str:
        return self.node("MatMul", [x, self.const("matmul_w", self.he((k, n), k))])

    def batchnorm(self, x: str, c: int) -> str:
        scale = self.rng.uniform(0.5, 1.5, c).astype(np.float32)
        bias = self.small((c,), 0.1)
        mean = self.small((c,), 0.1)
        var = self.rng.uniform(0.5, 1.5, c).astype(np.float32)
        names = [self.const(n, a) for n, a in
                 (("bn_scale", scale), ("bn_bias", bias), ("bn_mean", mean), ("bn_var", var))]
        return self.node("BatchNormalization", [x, *names], epsilon=1e-5)

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def build(self, outputs: Sequence[str], opset: int = OPSET, name: str = "test") -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, name, self.inputs,
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
            initializer=self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  ir_version=IR_VERSION, producer_name="onnxq-tests")
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        onnx.checker.check_model(model, full_check=True)
        return model


def every_kernel(seed: int = 11) -> onnx.ModelProto:
    """3x3 Conv (GEMM path), depthwise Conv, 1x1 Conv, then Flatten + Gemm."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 4, 8, 8])
    x = b.relu(b.conv(x, 4, 8))
    x = b.relu(b.conv(x, 8, 8, group=8))
    x = b.relu(b.conv(x, 8, 8, k=1))
    x = b.node("Flatten", [x])
    return b.build([b.gemm(x, 8 * 8 * 8, 10)], name="every_kernel")


def conv_relu_chain(seed: int = 0) -> onnx.ModelProto:
    """Conv+Relu x2 then a plain Conv: [N,3,16,16] -> [N,8,16,16]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 16, 16])
    x = b.relu(b.conv(x, 3, 8))
    x = b.relu(b.conv(x, 8, 16))
    return b.build([b.conv(x, 16, 8)], name="conv_relu_chain")


def fixed_batch_conv(batch: int = 1, seed: int = 10) -> onnx.ModelProto:
    """conv_relu_chain-like model whose input has a static batch dimension."""
    b = GraphBuilder(seed)
    x = b.input("x", [batch, 3, 10, 10])
    x = b.relu(b.conv(x, 3, 8))
    return b.build([b.conv(x, 8, 4)], name=f"fixed_batch_{batch}")


def fully_convolutional(seed: int = 11) -> onnx.ModelProto:
    """Conv+Relu, Conv on [N,3,H,W] with symbolic spatial dims."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, "H", "W"])
    x = b.relu(b.conv(x, 3, 8))
    return b.build([b.conv(x, 8, 4)], name="fully_convolutional")


def two_inputs(seed: int = 12) -> onnx.ModelProto:
    """Conv(a)+Relu and Conv(b)+Relu added, then a Conv: inputs a [N,3,8,8], b [N,2,8,8]."""
    b = GraphBuilder(seed)
    x = b.relu(b.conv(b.input("a", ["N", 3, 8, 8]), 3, 6))
    y = b.relu(b.conv(b.input("b", ["N", 2, 8, 8]), 2, 6))
    return b.build([b.conv(b.node("Add", [x, y]), 6, 4)], name="two_inputs")


def residual(seed: int = 1) -> onnx.ModelProto:
    """Conv+Relu, Conv, residual Add with the first activation, Relu, Conv."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 12, 12])
    a = b.relu(b.conv(x, 3, 8))
    y = b.conv(b.relu(b.conv(a, 8, 8)), 8, 8)
    s = b.relu(b.node("Add", [a, y]))
    return b.build([b.conv(s, 8, 4, k=1)], name="residual")


def concat(seed: int = 2) -> onnx.ModelProto:
    """Two Conv+Relu branches concatenated on channels, then a 1x1 Conv."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 4, 10, 10])
    left = b.relu(b.conv(x, 4, 6, k=1))
    right = b.relu(b.conv(x, 4, 10, k=3))
    cat = b.node("Concat", [left, right], axis=1)
    return b.build([b.conv(cat, 16, 8, k=1)], name="concat")


def gemm(trans_b: int = 1, seed: int = 3) -> onnx.ModelProto:
    """Gemm+Relu then Gemm: [N,32] -> [N,10]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 32])
    h = b.relu(b.gemm(x, 32, 48, trans_b=trans_b))
    return b.build([b.gemm(h, 48, 10, trans_b=trans_b)], name=f"gemm_transB{trans_b}")


def matmul(seed: int = 4) -> onnx.ModelProto:
    """Transpose on the input, MatMul with a constant weight, Relu, MatMul: [N,24,6] -> [N,6,16]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 24, 6])
    t = b.node("Transpose", [x], perm=[0, 2, 1])
    h = b.relu(b.matmul(t, 24, 32))
    return b.build([b.matmul(h, 32, 16)], name="matmul")


def depthwise(seed: int = 5) -> onnx.ModelProto:
    """Conv+Relu, depthwise Conv (group = channels)+Relu, 1x1 Conv."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 12, 12])
    x = b.relu(b.conv(x, 3, 8))
    x = b.relu(b.conv(x, 8, 8, group=8))
    return b.build([b.conv(x, 8, 6, k=1)], name="depthwise")


def conv_transpose(seed: int = 6, group: int = 1) -> onnx.ModelProto:
    """Conv+Relu, ConvTranspose (stride 2)+Relu, Conv: [N,4,8,8] -> [N,4,16,16]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 4, 8, 8])
    x = b.relu(b.conv(x, 4, 8))
    x = b.relu(b.conv_transpose(x, 8, 6, group=group))
    return b.build([b.conv(x, 6, 4)], name="conv_transpose")


def conv_bn_relu(seed: int = 7) -> onnx.ModelProto:
    """Conv->BatchNormalization->Relu twice, then a Conv."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 12, 12])
    x = b.relu(b.batchnorm(b.conv(x, 3, 8), 8))
    x = b.relu(b.batchnorm(b.conv(x, 8, 8, bias=False), 8))
    return b.build([b.conv(x, 8, 4, k=1)], name="conv_bn_relu")


def pooling(seed: int = 8) -> onnx.ModelProto:
    """Conv+Relu, MaxPool, Conv+Relu, AveragePool, Resize x2, Conv+Relu, GlobalAveragePool,
    Reshape, Flatten, Gemm: [N,3,16,16] -> [N,10]."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 16, 16])
    x = b.relu(b.conv(x, 3, 8))
    x = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = b.relu(b.conv(x, 8, 8))
    x = b.node("AveragePool", [x], kernel_shape=[2, 2], strides=[2, 2])
    scales = b.const("resize_scales", np.array([1, 1, 2, 2], np.float32))
    x = b.node("Resize", [x, "", scales], mode="nearest")
    x = b.relu(b.conv(x, 8, 12))
    x = b.node("GlobalAveragePool", [x])
    x = b.node("Reshape", [x, b.const("shape", np.array([0, 12, 1], np.int64))])
    x = b.node("Flatten", [x], axis=1)
    return b.build([b.gemm(x, 12, 10)], name="pooling")


def softmax_head(seed: int = 9) -> onnx.ModelProto:
    """Conv+Relu, GlobalAveragePool, Flatten, Gemm, Softmax: [N,3,8,8] -> [N,10] probabilities."""
    b = GraphBuilder(seed)
    x = b.input("x", ["N", 3, 8, 8])
    x = b.relu(b.conv(x, 3, 16))
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    logits = b.gemm(x, 16, 10)
    # Scale the logits up so the softmax is not flat and its output carries signal.
    logits = b.node("Mul", [logits, b.const("temp", np.array(3.0, np.float32))])
    return b.build([b.node("Softmax", [logits], axis=-1)], name="softmax_head")


MODEL_BUILDERS: dict[str, Callable[[], onnx.ModelProto]] = {
    "conv_relu_chain": conv_relu_chain,
    "residual": residual,
    "concat": concat,
    "gemm_transB0": lambda: gemm(trans_b=0),
    "gemm_transB1": lambda: gemm(trans_b=1),
    "matmul": matmul,
    "depthwise": depthwise,
    "conv_transpose": conv_transpose,
    "conv_bn_relu": conv_bn_relu,
    "pooling": pooling,
    "softmax_head": softmax_head,
}


def save(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    path = Path(path)
    onnx.save(model, str(path))
    return path
