"""The nine "light" architectures shipped with onnx's backend test data.

They are opset 9, IR 3 models whose weights come from ConstantOfShape nodes (every weight
0.02), so onnxq must upgrade the opset, fold the weight producers and quantize the result.

Accuracy cannot be judged on constant weights (every output is the uniform softmax), so a
copy of each model gets seeded random weights (He-normal Conv/Gemm weights, BN scale and
variance ~U(0.5, 1.5), BN mean/bias and other tensors ~N(0, 0.1), Caffe2-style Mul scales
~U(0.5, 1.5)) and exposes its logits (the Softmax input) as an extra output.

Metric, chosen from measurement: random-weight deep nets map every random input to almost
the same logits (the input-dependent part is ~30 dB below the common part), so top-1
agreement is trivially 8/8 and the cosine of raw logits is ~1 even across inputs. We use
instead (a) the per-sample Pearson correlation of quantized vs float logits across the
1000 classes, >= 0.99 (measured >= 0.9992), against <= 0.1 for the same logits with the
classes shuffled (a model that knows nothing; measured <= 0.05), and (b) the SQNR of the
logits, with a per-model floor 2 dB under the measured value. (b) is the sensitive one:
reversing the per-channel weight scales of one Conv (what a channel-order bug does)
drops it by 8 to 25 dB, see `test_metric_catches_a_scale_order_bug`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import cosine, initializers, input_specs, op_count, producers, run, sqnr_db
from onnx import numpy_helper

import onnxq
from onnxq.graph.load import load_model

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
MODELS = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
          "shufflenet", "squeezenet", "vgg19", "zfnet512"]
BIG = {"bvlc_alexnet", "vgg19", "zfnet512"}  # 240-575 MB of float weights: 1 calibration sample, 2 eval

# Logits SQNR floor per model, dB (measured minus about 2 dB; seeds below are fixed).
MIN_LOGITS_SQNR_DB = {
    "bvlc_alexnet": 30.0,  # measured 32.5
    "densenet121": 28.0,  # 30.2
    "inception_v1": 31.0,  # 33.1
    "inception_v2": 27.5,  # 29.7
    "resnet50": 31.0,  # 33.2
    "shufflenet": 29.5,  # 31.7
    "squeezenet": 28.0,  # 30.0
    "vgg19": 27.0,  # 29.4
    "zfnet512": 29.5,  # 31.9
}
MIN_PEARSON = 0.99
MAX_SHUFFLED_PEARSON = 0.1

pytestmark = pytest.mark.skipif(not LIGHT_DIR.is_dir(), reason=f"{LIGHT_DIR} not installed")


def light_path(name: str) -> Path:
    path = LIGHT_DIR / f"light_{name}.onnx"
    if not path.is_file():
        pytest.skip(f"{path.name} not in this onnx install")
    return path


def normal_feeds(path: Path | str, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """`n` random normal inputs of the model's (static) input shape."""
    (name, dtype, dims), *rest = input_specs(path)
    assert rest == [], f"{path}: more than one real input"
    assert all(d is not None for d in dims)
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(dims).astype(dtype)} for _ in range(n)]


def counts(name: str) -> tuple[int, int]:
    """(calibration samples, evaluation inputs)."""
    return (1, 2) if name in BIG else (3, 8)


# ---------------------------------------------------------------------------------------
# the original models


@pytest.mark.parametrize("name", MODELS)
def test_quantizes_checks_and_runs(name, tmp_path):
    src = light_path(name)
    before = src.read_bytes()
    out = tmp_path / f"{name}.int8.onnx"
    n_calib, _ = counts(name)
    result = onnxq.quantize(src, out, "U8S8", normal_feeds(src, n_calib, seed=1))
    assert src.read_bytes() == before
    onnx.checker.check_model(str(out), full_check=True)

    q = onnx.load(str(out))
    original = onnx.load(str(src))
    assert op_count(q, "ConstantOfShape") == 0
    assert result.summary.opset == (9, 13)
    assert result.summary.calibration_samples == n_calib
    for op in ("Conv", "Gemm"):
        assert result.summary.quantized_by_op.get(op, 0) == op_count(original, op), op
    # Every weight is an int8 initializer behind DequantizeLinear. The weights are constant
    # per output channel (0.02, times the folded BN scale where there is one), so every
    # element sits at the symmetric maximum (with the sign of its BN scale).
    has_bn = op_count(original, "BatchNormalization") > 0
    inits, prods = initializers(q), producers(q)
    for node in q.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            dq = prods[node.input[1]]
            assert dq.op_type == "DequantizeLinear"
            w = inits[dq.input[0]]
            assert w.dtype == np.int8 and np.all(np.abs(w) == 127)
            if not has_bn:
                np.testing.assert_allclose(inits[dq.input[1]], 0.02 / 127, rtol=1e-6)
    assert result.summary.float_biases == []

    feed = normal_feeds(src, 1, seed=2)[0]
    ref = run(src, feed)
    got = run(out, feed)
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got))
    assert sqnr_db(ref, got) >= 25.0


# ---------------------------------------------------------------------------------------
# random-weight copies


def _fan_in(node: ir.Node, w: np.ndarray) -> int:
    if node.op_type == "Conv":
        return int(np.prod(w.shape[1:]))
    trans_b = node.attributes.get("transB")
    return int(w.shape[1] if trans_b is not None and trans_b.as_int() else w.shape[0])


def randomize(src: Path, dst: Path, seed: int) -> Path:
    """Copy `src` with seeded random weights and its logits exposed as a second output."""
    model, _ = load_model(src)  # ConstantOfShape weights are folded into initializers
    graph = model.graph
    rng = np.random.default_rng(seed)
    role: dict[str, tuple[ir.Node, int]] = {}
    for node in graph:
        for i, value in enumerate(node.inputs):
            if value is not None and value.name in graph.initializers:
                role.setdefault(value.name, (node, i))
    for name in sorted(graph.initializers):
        value = graph.initializers[name]
        array = value.const_value.numpy()
        if array.dtype != np.float32 or array.ndim < 1:
            continue
        node, index = role.get(name, (None, -1))
        op = node.op_type if node is not None else ""
        if op in ("Conv", "Gemm") and index == 1:
            new = rng.standard_normal(array.shape, dtype=np.float32)
            new *= np.float32(np.sqrt(2.0 / _fan_in(node, array)))
        elif (op == "BatchNormalization" and index in (1, 4)) or op == "Mul":
            new = rng.uniform(0.5, 1.5, array.shape).astype(np.float32)
        else:
            new = (rng.standard_normal(array.shape, dtype=np.float32) * np.float32(0.1))
        value.const_value = ir.tensor(new, name=name)
    softmax = [n for n in graph if n.op_type == "Softmax"]
    if softmax:
        graph.outputs.append(softmax[0].inputs[0])
    ir.save(model, dst)
    return dst


@pytest.fixture(scope="module", params=MODELS)
def randomized(request, tmp_path_factory):
    """(name, float path, quantized path, eval feeds) of a random-weight copy."""
    name = request.param
    src = light_path(name)
    folder = tmp_path_factory.mktemp(name)
    float_path = randomize(src, folder / "float.onnx", seed=0)
    q_path = folder / "int8.onnx"
    n_calib, n_eval = counts(name)
    onnxq.quantize(float_path, q_path, "U8S8", normal_feeds(float_path, n_calib, seed=5))
    return name, float_path, q_path, normal_feeds(float_path, n_eval, seed=6)


def logits(path: Path, feeds) -> np.ndarray:
    """The last graph output (the logits) of each feed, one row per input."""
    out = run(path, feeds, output=-1)
    return out.reshape(len(feeds), -1).astype(np.float64)


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return cosine(a - a.mean(), b - b.mean())


def test_random_weight_copy_tracks_float_logits(randomized):
    name, float_path, q_path, feeds = randomized
    onnx.checker.check_model(str(q_path), full_check=True)
    ref, got = logits(float_path, feeds), logits(q_path, feeds)
    assert ref.shape == got.shape and ref.shape[1] == 1000
    # The random copy really is random (not constant like the original).
    assert np.std(ref) > 1e-3
    r = [pearson(ref[i], got[i]) for i in range(len(feeds))]
    assert min(r) >= MIN_PEARSON, f"{name}: Pearson {r}"
    perm = np.random.default_rng(0).permutation(ref.shape[1])
    shuffled = [abs(pearson(ref[i][perm], got[i])) for i in range(len(feeds))]
    assert max(shuffled) <= MAX_SHUFFLED_PEARSON, f"{name}: shuffled {shuffled}"
    db = sqnr_db(ref, got)
    assert db >= MIN_LOGITS_SQNR_DB[name], f"{name}: logits SQNR {db:.1f} dB"


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_metric_catches_a_scale_order_bug(name, tmp_path):
    """Reverse the per-channel scales of the last Conv weight: the SQNR floor must fail."""
    src = light_path(name)
    float_path = randomize(src, tmp_path / "float.onnx", seed=0)
    q_path = tmp_path / "int8.onnx"
    onnxq.quantize(float_path, q_path, "U8S8", normal_feeds(float_path, 3, seed=5))
    q = onnx.load(str(q_path))
    conv = [n for n in q.graph.node if n.op_type == "Conv"][-1]
    dq = producers(q)[conv.input[1]]
    scale = next(i for i in q.graph.initializer if i.name == dq.input[1])
    array = numpy_helper.to_array(scale)
    assert array.ndim == 1 and array.size > 1
    scale.CopyFrom(numpy_helper.from_array(array[::-1].copy(), scale.name))
    broken = tmp_path / "broken.onnx"
    onnx.save(q, str(broken))
    feeds = normal_feeds(float_path, 8, seed=6)
    ref = logits(float_path, feeds)
    assert sqnr_db(ref, logits(q_path, feeds)) >= MIN_LOGITS_SQNR_DB[name]
    assert sqnr_db(ref, logits(broken, feeds)) < MIN_LOGITS_SQNR_DB[name] - 5
