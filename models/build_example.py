#!/usr/bin/env python
"""Build the bundled example model ``digits_cnn.onnx`` and its data files.

Everything is derived from scikit-learn's bundled ``load_digits()`` data set (8x8 grayscale
digits, 10 classes, shipped inside the sklearn package, so no network access is needed). A small
CNN is trained in pure NumPy (float64, hand-written backprop, fixed seeds) and exported to ONNX
with ``onnx.helper``.

Outputs (written to ``--out-dir``, default: this script's folder):

* ``digits_cnn.onnx``   -- opset 17, IR version 8, input ``input`` [batch,1,8,8] float32,
  output ``logits`` [batch,10] float32.
* ``digits_calib.npz``  -- ``input``: float32 [128,1,8,8], drawn from the train split.
* ``digits_eval.npz``   -- ``input``: float32 [500,1,8,8], ``labels``: int64 [500].

The script is deterministic: running it twice yields byte-identical files on the same platform
(same NumPy/BLAS build and CPU type). BLAS threading is pinned to one thread for that reason.

Usage::

    python models/build_example.py [--out-dir DIR] [--epochs N]
"""

from __future__ import annotations

import os

# Pin BLAS/OpenMP threading before NumPy is imported so that floating-point reductions do not
# depend on the number of cores available (keeps training bit-for-bit reproducible).
for _var in (
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

SEED = 20240607
N_EVAL = 500
N_CALIB = 128
OPSET = 17
IR_VERSION = 8

# Architecture sizes.
C1 = 16  # conv1 / conv2 channels (residual add needs them equal)
C3 = 32  # conv3 channels
N_CLASSES = 10


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``x_train, y_train, x_eval, y_eval``; x is float32 NCHW in [0,1], y is int64."""
    digits = load_digits()
    x = (digits.images.astype(np.float64) / 16.0).astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    x_tr, x_ev, y_tr, y_ev = train_test_split(
        x, y, test_size=N_EVAL, stratify=y, random_state=seed, shuffle=True
    )
    return (
        np.ascontiguousarray(x_tr, dtype=np.float32),
        np.ascontiguousarray(y_tr, dtype=np.int64),
        np.ascontiguousarray(x_ev, dtype=np.float32),
        np.ascontiguousarray(y_ev, dtype=np.int64),
    )


# --------------------------------------------------------------------------------------------
# NumPy layers (forward + backward)
# --------------------------------------------------------------------------------------------


def im2col3x3(x: np.ndarray) -> np.ndarray:
    """[N,C,H,W] -> [N*H*W, C*9] patches for a 3x3 kernel, stride 1, padding 1."""
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # N,C,H,W,3,3
    return np.ascontiguousarray(win.transpose(0, 2, 3, 1, 4, 5)).reshape(n * h * w, c * 9)


def col2im3x3(dcols: np.ndarray, shape: tuple[int, int, int, int]) -> np.ndarray:
    """Adjoint of :func:`im2col3x3`."""
    n, c, h, w = shape
    d = dcols.reshape(n, h, w, c, 3, 3)
    dxp = np.zeros((n, c, h + 2, w + 2), dtype=dcols.dtype)
    for i in range(3):
        for j in range(3):
            dxp[:, :, i : i + h, j : j + w] += d[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return dxp[:, :, 1:-1, 1:-1]


def conv3x3_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray):
    n, _, h, wd = x.shape
    co = w.shape[0]
    cols = im2col3x3(x)
    out = cols @ w.reshape(co, -1).T + b
    out = out.reshape(n, h, wd, co).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out), cols


def conv3x3_backward(dout, cols, x_shape, w, need_dx=True):
    co = w.shape[0]
    d = dout.transpose(0, 2, 3, 1).reshape(-1, co)
    dw = (d.T @ cols).reshape(w.shape)
    db = d.sum(axis=0)
    dx = col2im3x3(d @ w.reshape(co, -1), x_shape) if need_dx else None
    return dx, dw, db


def maxpool2x2_forward(x: np.ndarray):
    n, c, h, w = x.shape
    win = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5)
    win = win.reshape(n, c, h // 2, w // 2, 4)
    idx = win.argmax(axis=-1)
    out = np.take_along_axis(win, idx[..., None], axis=-1)[..., 0]
    return out, idx


def maxpool2x2_backward(dout: np.ndarray, idx: np.ndarray, x_shape):
    n, c, h, w = x_shape
    dwin = np.zeros((n, c, h // 2, w // 2, 4), dtype=dout.dtype)
    np.put_along_axis(dwin, idx[..., None], dout[..., None], axis=-1)
    dwin = dwin.reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
    return dwin.reshape(n, c, h, w)


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def he(shape, fan_in):
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)

    return {
        "conv1.weight": he((C1, 1, 3, 3), 1 * 9),
        "conv1.bias": np.zeros(C1),
        "conv2.weight": he((C1, C1, 3, 3), C1 * 9),
        "conv2.bias": np.zeros(C1),
        "conv3.weight": he((C3, C1, 3, 3), C1 * 9),
        "conv3.bias": np.zeros(C3),
        "fc.weight": rng.standard_normal((N_CLASSES, C3)) * np.sqrt(1.0 / C3),
        "fc.bias": np.zeros(N_CLASSES),
    }


def forward(p: dict[str, np.ndarray], x: np.ndarray, cache: dict | None = None) -> np.ndarray:
    """Forward pass; mirrors the exported ONNX graph exactly. Fills ``cache`` for backprop."""
    z1, cols1 = conv3x3_forward(x, p["conv1.weight"], p["conv1.bias"])
    a1 = np.maximum(z1, 0)
    z2, cols2 = conv3x3_forward(a1, p["conv2.weight"], p["conv2.bias"])
    a2 = np.maximum(z2, 0)
    s = a1 + a2
    m, pidx = maxpool2x2_forward(s)
    z3, cols3 = conv3x3_forward(m, p["conv3.weight"], p["conv3.bias"])
    a3 = np.maximum(z3, 0)
    g = a3.mean(axis=(2, 3))
    logits = g @ p["fc.weight"].T + p["fc.bias"]
    if cache is not None:
        cache.update(
            x=x, z1=z1, cols1=cols1, a1=a1, z2=z2, cols2=cols2, s=s, pidx=pidx, m=m,
            z3=z3, cols3=cols3, a3=a3, g=g,
        )  # fmt: skip
    return logits


def backward(p: dict[str, np.ndarray], c: dict, dlogits: np.ndarray) -> dict[str, np.ndarray]:
    grads = {}
    grads["fc.weight"] = dlogits.T @ c["g"]
    grads["fc.bias"] = dlogits.sum(axis=0)
    dg = dlogits @ p["fc.weight"]
    hw = c["a3"].shape[2] * c["a3"].shape[3]
    da3 = np.broadcast_to(dg[:, :, None, None] / hw, c["a3"].shape)
    dz3 = da3 * (c["z3"] > 0)
    dm, grads["conv3.weight"], grads["conv3.bias"] = conv3x3_backward(
        dz3, c["cols3"], c["m"].shape, p["conv3.weight"]
    )
    ds = maxpool2x2_backward(dm, c["pidx"], c["s"].shape)
    dz2 = ds * (c["z2"] > 0)
    da1_res, grads["conv2.weight"], grads["conv2.bias"] = conv3x3_backward(
        dz2, c["cols2"], c["a1"].shape, p["conv2.weight"]
    )
    da1 = ds + da1_res
    dz1 = da1 * (c["z1"] > 0)
    _, grads["conv1.weight"], grads["conv1.bias"] = conv3x3_backward(
        dz1, c["cols1"], c["x"].shape, p["conv1.weight"], need_dx=False
    )
    return grads


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    prob = e / e.sum(axis=1, keepdims=True)
    n = logits.shape[0]
    loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
    dlogits = prob
    dlogits[np.arange(n), y] -= 1.0
    return loss, dlogits / n


def predict(p: dict[str, np.ndarray], x: np.ndarray, batch: int = 256) -> np.ndarray:
    out = [forward(p, x[i : i + batch]) for i in range(0, x.shape[0], batch)]
    return np.concatenate(out, axis=0)


def train(
    x: np.ndarray,
    y: np.ndarray,
    seed: int,
    epochs: int,
    batch: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    verbose: bool = True,
) -> dict[str, np.ndarray]:
    """Adam + cosine LR decay, float64, with light random-shift augmentation."""
    rng = np.random.default_rng(seed)
    p = init_params(rng)
    mom = {k: np.zeros_like(v) for k, v in p.items()}
    vel = {k: np.zeros_like(v) for k, v in p.items()}
    b1, b2, eps = 0.9, 0.999, 1e-8
    x = x.astype(np.float64)
    n = x.shape[0]
    steps_per_epoch = (n + batch - 1) // batch
    total = epochs * steps_per_epoch
    step = 0
    for ep in range(epochs):
        perm = rng.permutation(n)
        ep_loss = 0.0
        for bi in range(steps_per_epoch):
            idx = perm[bi * batch : (bi + 1) * batch]
            xb = x[idx]
            # Random +-1 pixel shift (zero fill) on half of the batch.
            shifts = rng.integers(-1, 2, size=(xb.shape[0], 2))
            use = rng.random(xb.shape[0]) < 0.5
            xpad = np.pad(xb, ((0, 0), (0, 0), (1, 1), (1, 1)))
            for k in np.flatnonzero(use):
                dy, dx = shifts[k]
                xb[k, 0] = xpad[k, 0, 1 + dy : 9 + dy, 1 + dx : 9 + dx]
            cache: dict = {}
            logits = forward(p, xb, cache)
            loss, dlogits = softmax_xent(logits, y[idx])
            ep_loss += loss * idx.size
            grads = backward(p, cache, dlogits)
            step += 1
            lr_t = lr * 0.5 * (1.0 + np.cos(np.pi * (step - 1) / total))
            for k in p:
                g = grads[k]
                if k.endswith("weight"):
                    g = g + weight_decay * p[k]
                mom[k] = b1 * mom[k] + (1 - b1) * g
                vel[k] = b2 * vel[k] + (1 - b2) * g * g
                mhat = mom[k] / (1 - b1**step)
                vhat = vel[k] / (1 - b2**step)
                p[k] = p[k] - lr_t * mhat / (np.sqrt(vhat) + eps)
        if verbose and (ep % 5 == 4 or ep == epochs - 1):
            acc = float((predict(p, x).argmax(1) == y).mean())
            print(f"  epoch {ep + 1:3d}  loss {ep_loss / n:.4f}  train acc {acc:.4f}")
    return p


# --------------------------------------------------------------------------------------------
# ONNX export
# --------------------------------------------------------------------------------------------


def build_onnx(p32: dict[str, np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.ascontiguousarray(v), name=k) for k, v in p32.items()]
    conv_attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}
    nodes = [
        helper.make_node(
            "Conv", ["input", "conv1.weight", "conv1.bias"], ["conv1_out"], name="conv1",
            **conv_attrs,
        ),
        helper.make_node("Relu", ["conv1_out"], ["relu1_out"], name="relu1"),
        helper.make_node(
            "Conv", ["relu1_out", "conv2.weight", "conv2.bias"], ["conv2_out"], name="conv2",
            **conv_attrs,
        ),
        helper.make_node("Relu", ["conv2_out"], ["relu2_out"], name="relu2"),
        helper.make_node("Add", ["relu1_out", "relu2_out"], ["residual_out"], name="residual_add"),
        helper.make_node(
            "MaxPool", ["residual_out"], ["pool_out"], name="maxpool",
            kernel_shape=[2, 2], strides=[2, 2],
        ),
        helper.make_node(
            "Conv", ["pool_out", "conv3.weight", "conv3.bias"], ["conv3_out"], name="conv3",
            **conv_attrs,
        ),
        helper.make_node("Relu", ["conv3_out"], ["relu3_out"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["relu3_out"], ["gap_out"], name="global_avg_pool"),
        helper.make_node("Flatten", ["gap_out"], ["flat_out"], name="flatten", axis=1),
        helper.make_node(
            "Gemm", ["flat_out", "fc.weight", "fc.bias"], ["logits"], name="fc",
            alpha=1.0, beta=1.0, transB=1,
        ),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", N_CLASSES])],
        initializer=inits,
    )
    graph.doc_string = (
        "Small residual CNN for sklearn load_digits (8x8, 10 classes). "
        "Input: pixels/16 in [0,1], NCHW float32."
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="onnxq-build-example",
        producer_version="1.0",
    )
    model.ir_version = IR_VERSION
    model.model_version = 1
    model.doc_string = "onnxq bundled example model; regenerate with models/build_example.py"
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def run_onnx(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"input": x})[0]


# --------------------------------------------------------------------------------------------
# Deterministic file writing
# --------------------------------------------------------------------------------------------


def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like ``np.savez`` but with fixed zip timestamps so the bytes are reproducible."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            arr_buf = io.BytesIO()
            np.lib.format.write_array(arr_buf, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, arr_buf.getvalue())
    path.write_bytes(buf.getvalue())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out-dir", type=Path, default=Path(__file__).resolve().parent,
        help="output folder (default: the folder this script lives in)",
    )  # fmt: skip
    ap.add_argument("--epochs", type=int, default=60, help="training epochs (default: 60)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"random seed (default: {SEED})")
    args = ap.parse_args(argv)
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    x_tr, y_tr, x_ev, y_ev = load_data(args.seed)
    print(f"data: train {x_tr.shape} eval {x_ev.shape}")

    t0 = time.perf_counter()
    p64 = train(x_tr, y_tr, seed=args.seed, epochs=args.epochs)
    train_s = time.perf_counter() - t0
    print(f"training took {train_s:.1f} s")

    p32 = {k: v.astype(np.float32) for k, v in p64.items()}
    model = build_onnx(p32)
    model_bytes = model.SerializeToString()

    # Verify ONNX against the NumPy forward pass (float32 weights + float32 input).
    ref = predict(p32, x_ev).astype(np.float32)
    got = run_onnx(model_bytes, x_ev)
    max_diff = float(np.abs(ref - got).max())
    print(f"onnxruntime vs numpy forward: max abs diff {max_diff:.3e}")
    if not max_diff < 1e-4:
        raise SystemExit(f"ONNX output mismatch: max abs diff {max_diff} >= 1e-4")
    # Dynamic batch sanity check.
    got1 = run_onnx(model_bytes, x_ev[:1])
    assert got1.shape == (1, N_CLASSES) and np.abs(got1 - got[:1]).max() < 1e-4

    acc_np = float((ref.argmax(1) == y_ev).mean())
    acc_ort = float((got.argmax(1) == y_ev).mean())

    calib_idx = np.sort(np.random.default_rng(args.seed + 1).permutation(x_tr.shape[0])[:N_CALIB])
    x_calib = np.ascontiguousarray(x_tr[calib_idx], dtype=np.float32)

    onnx_path = out_dir / "digits_cnn.onnx"
    calib_path = out_dir / "digits_calib.npz"
    eval_path = out_dir / "digits_eval.npz"
    onnx_path.write_bytes(model_bytes)
    save_npz_deterministic(calib_path, {"input": x_calib})
    save_npz_deterministic(eval_path, {"input": x_ev, "labels": y_ev.astype(np.int64)})

    n_params = sum(int(v.size) for v in p32.values())
    print(f"parameters: {n_params}")
    for path in (onnx_path, calib_path, eval_path):
        print(f"wrote {path} ({path.stat().st_size} bytes, sha256 {sha256(path)[:16]}...)")
    print(f"numpy float32 eval accuracy: {acc_np:.4f}")
    n_ok = int((got.argmax(1) == y_ev).sum())
    print(f"float eval accuracy (onnxruntime): {acc_ort:.4f} ({n_ok}/{N_EVAL})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
