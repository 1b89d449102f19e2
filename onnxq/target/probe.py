"""Measure, on the onnxruntime at hand, which int8 kernels saturate.

Each probe is a tiny QDQ graph whose exact integer result is known and which
onnxruntime's default optimiser fuses into the int8 kernel under test (QLinearMatMul,
QLinearConv via the GEMM path, depthwise QLinearConv, MatMulInteger). Inputs hold the
largest codes, so a kernel that adds u8 x s8 products pairwise in int16 (x86 AVX2 without
VNNI: `vpmaddubsw`) returns a clearly smaller number. Asking the kernel beats guessing
from CPU flags: it stays right for new ISAs, builds and execution providers.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state

from onnxq import cache

# (activation kind, kernel class) pairs a probe checks.
KERNELS = ("gemm", "depthwise")
ACTIVATIONS = ("uint8", "int8")
CHANNELS = 32  # K of the dot products: 16 pairs, saturation halves the result
OUT_SCALE = 8192.0


def _qdq_input(x_type: int, code: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """x -> Q -> DQ with scale 1, zero point 0: the float input `code` becomes that code."""
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             helper.make_tensor("x_zp", x_type, [], [0])]
    nodes = [helper.make_node("QuantizeLinear", ["x", "one", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "one", "x_zp"], ["xdq"])]
    return nodes, inits


def _qdq_output(x_type: int, scale: float) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "y_scale"),
             helper.make_tensor("y_zp", x_type, [], [0])]
    nodes = [helper.make_node("QuantizeLinear", ["yf", "y_scale", "y_zp"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zp"], ["y"])]
    return nodes, inits


def _conv_probe(name: str, x_type: int, code: int, w: np.ndarray, w_zp: np.ndarray, group: int = 1,
                out_scale: float = OUT_SCALE) -> tuple[onnx.ModelProto, np.ndarray]:
    """A QDQ Conv of the constant input `code` (type `x_type`) and the weight codes `w`
    with zero point `w_zp` (scalar, or one per output channel at scale 1), quantized out
    at `out_scale` to `x_type`: the graph onnxruntime fuses into the QLinearConv under
    test, and its input."""
    per_channel = w_zp.ndim > 0
    x_shape = [1, w.shape[1] * group, *w.shape[2:]]
    inits = [numpy_helper.from_array(w, "wq"), numpy_helper.from_array(w_zp, "w_zp")]
    if per_channel:
        inits.append(numpy_helper.from_array(np.ones(w.shape[0], np.float32), "w_scale"))
    in_nodes, in_inits = _qdq_input(x_type, code)
    out_nodes, out_inits = _qdq_output(x_type, out_scale)
    nodes = [*in_nodes,
             helper.make_node("DequantizeLinear", ["wq", "w_scale" if per_channel else "one", "w_zp"], ["w"],
                              **({"axis": 0} if per_channel else {})),
             helper.make_node("Conv", ["xdq", "w"], ["yf"], group=group),
             *out_nodes]
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits + in_inits + out_inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model, np.full(x_shape, code, np.float32)


def _probe_model(kernel: str, activation: str) -> tuple[onnx.ModelProto, np.ndarray, float]:
    """The probe graph, its input, and the exact output every element should have."""
    x_type = TensorProto.UINT8 if activation == "uint8" else TensorProto.INT8
    code = 255 if activation == "uint8" else 127
    c = CHANNELS
    if kernel == "gemm":
        w, group, taps = np.full((c, c, 1, 1), 127, np.int8), 1, c
    else:
        w, group, taps = np.full((c, 1, 3, 3), 127, np.int8), c, 9
    model, x = _conv_probe(f"onnxq_probe_{kernel}_{activation}", x_type, code, w, np.array(0, np.int8), group)
    exact = np.clip(np.rint(code * 127 * taps / OUT_SCALE), *_range(activation)) * OUT_SCALE
    return model, x, float(exact)


def _range(activation: str) -> tuple[int, int]:
    return (0, 255) if activation == "uint8" else (-128, 127)


def _dynamic_model() -> tuple[onnx.ModelProto, np.ndarray, float]:
    """MatMulInteger u8 x s8: the kernel behind dynamic quantization."""
    c = CHANNELS
    inits = [numpy_helper.from_array(np.full((c, 8), 127, np.int8), "w")]
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w"], ["y"])], "onnxq_probe_dynamic",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, c])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model, np.full((1, c), 255, np.uint8), float(255 * 127 * c)


def _depthwise_zero_point_model() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """A depthwise Conv whose channels have different weight zero points, and the exact
    output: onnxruntime 1.32's depthwise int8 kernel gets this wrong on x86."""
    c = 8
    rng = np.random.default_rng(0)
    w = rng.integers(-100, 100, (c, 1, 3, 3)).astype(np.int8)
    zp = np.arange(-c // 2, c - c // 2, dtype=np.int8) * 3
    model, x = _conv_probe("onnxq_probe_depthwise_zp", TensorProto.UINT8, 255, w, zp, group=c)
    acc = 255.0 * (w.astype(np.float64) - zp[:, None, None, None]).reshape(c, -1).sum(1)
    exact = np.clip(np.rint(acc / OUT_SCALE), 0, 255) * OUT_SCALE
    return model, x, exact.reshape(1, c, 1, 1)


def _u8u8_model() -> tuple[onnx.ModelProto, np.ndarray, float]:
    """A pointwise Conv of uint8 activations at code 255 and uint8 weights with zero point
    128 (as symmetric uint8 weights are stored), codes 255 and 0: the U8U8 GEMM that
    per-tensor weights use where u8 x s8 saturates. Raw products of 255 x 255 overflow an
    int16 pair, and a kernel that drops the zero point sums other values."""
    c = CHANNELS
    scale = 4096.0
    w = np.full((c, c, 1, 1), 255, np.uint8)
    w[:, c - c // 4:] = 0
    model, x = _conv_probe("onnxq_probe_u8u8", TensorProto.UINT8, 255, w, np.array(128, np.uint8), out_scale=scale)
    exact = np.clip(np.rint(255.0 * (w[0].astype(np.float64) - 128).sum() / scale), 0, 255) * scale
    return model, x, float(exact)


def _saturates(model: onnx.ModelProto, x: np.ndarray, exact: float | np.ndarray, providers: tuple[str, ...]) -> bool:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=list(providers))
    y = session.run(None, {"x": x})[0]
    return not np.allclose(np.asarray(y, np.float64), np.asarray(exact, np.float64))


CACHE_KIND = "probe"
CPU = ("CPUExecutionProvider",)


@functools.cache
def _machine_key() -> str | None:
    """This CPU and onnxruntime build, and this file, hashed once per process (module doc);
    None where the CPU cannot be told apart from another (no feature flags to read) or the
    files cannot be read."""
    cpu = cache.cpu_fingerprint()
    if not any(line.split(":")[0].strip() in ("flags", "Features") for line in cpu.splitlines()):
        return None
    library = Path(onnxruntime_pybind11_state.__file__)
    try:
        info = library.stat()
        code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except OSError:
        return None
    parts = [ort.__version__, f"{library} {info.st_size} {info.st_mtime_ns}", cpu, code]
    return hashlib.sha256("\n--\n".join(parts).encode()).hexdigest()[:32]


def _remembered(kind: str, providers: tuple[str, ...], probe: Callable[[], frozenset], known: frozenset) -> frozenset:
    """`probe()`, read from the cache where this CPU answered it before (module doc): an
    entry naming anything outside `known` is probed again. Other providers are probed
    in every process (a GPU is not in the key)."""
    key = _machine_key() if providers == CPU else None
    if key is None:
        return probe()
    name = f"{kind}_{key}"
    doc = cache.read(CACHE_KIND, name)
    if isinstance(doc, dict) and doc.get("kind") == kind and isinstance(doc.get("found"), list):
        try:
            found = frozenset(tuple(x) if isinstance(x, list) else x for x in doc["found"])
        except TypeError:  # an unhashable entry
            found = None
        if found is not None and found <= known:
            return found
    answer = probe()
    cache.write(CACHE_KIND, name, {"kind": kind, "found": sorted(answer)})
    return answer


@functools.lru_cache(maxsize=8)
def saturating_kernels(providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> frozenset[tuple[str, str]]:
    """(activation dtype, kernel class) pairs whose default-session kernels saturate.

    Kernel classes: `gemm` (Conv, MatMul, Gemm through the quantized GEMM), `depthwise`
    (grouped Conv with one channel per group), `dynamic` (MatMulInteger, activation uint8).
    """
    def probe() -> frozenset[tuple[str, str]]:
        found = {(activation, kernel) for kernel in KERNELS for activation in ACTIVATIONS
                 if _saturates(*_probe_model(kernel, activation), providers)}
        if _saturates(*_dynamic_model(), providers):
            found.add(("uint8", "dynamic"))
        return frozenset(found)

    known = frozenset({(a, k) for a in ACTIVATIONS for k in KERNELS} | {("uint8", "dynamic")})
    return _remembered("saturating", providers, probe, known)


@functools.lru_cache(maxsize=8)
def wrong_kernels(providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> frozenset[str]:
    """Kernel features that give wrong results (not saturation): `depthwise_zero_points`
    when a depthwise Conv with per-channel weight zero points is miscomputed, `u8u8_gemm`
    when the U8U8 GEMM (uint8 weights) is not exact."""
    def probe() -> frozenset[str]:
        wrong = {"depthwise_zero_points"} if _saturates(*_depthwise_zero_point_model(), providers) else set()
        if _saturates(*_u8u8_model(), providers):
            wrong.add("u8u8_gemm")
        return frozenset(wrong)

    return _remembered("wrong", providers, probe, frozenset({"depthwise_zero_points", "u8u8_gemm"}))
