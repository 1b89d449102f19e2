"""Digests of onnxq's outputs: the bundled example and the `../shared` models under every
preset, so that a refactor can show its outputs are byte-identical.

    python benchmarks/digests.py > before.tsv      # on the old commit
    python benchmarks/digests.py > after.tsv       # on the new one
    diff before.tsv after.tsv                      # no output: byte-identical

One line per (model, preset): the sha256 of the saved model folder (external data
included); times go to stderr. Calibration uses a small fixed subset of each data set
(`--samples`) so that every preset, AdaRound ones included, runs in a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_shared_dir, load_cifar, load_imagenet, load_stsb, stsb_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _models(shared: Path, samples: int) -> list[tuple[str, Path, object]]:
    """(name, model path, calibration data) for the bundled example and each shared model."""
    out: list[tuple[str, Path, object]] = [
        ("digits_cnn", ROOT / "models" / "digits_cnn.onnx", str(ROOT / "models" / "digits_calib.npz"))]
    models, data = shared / "models", shared / "data"
    if (models / "mobilenet_v1_075.onnx").exists():
        images, _ = load_imagenet(data / "imagenet_sample1000", 0, samples)
        out.append(("mobilenet_v1_075", models / "mobilenet_v1_075.onnx", {"input": images}))
    if (models / "resnet20_cifar10.onnx").exists():
        images, _ = load_cifar(data / "cifar10_test2000", 0, samples)
        out.append(("resnet20_cifar10", models / "resnet20_cifar10.onnx", {"input": images}))
    if (models / "all_minilm_l6_v2.onnx").exists():
        feeds = load_stsb(data / "stsb_dev", stsb_rows(list(range(samples // 2))))
        out.append(("all_minilm_l6_v2", models / "all_minilm_l6_v2.onnx", feeds))
    return out


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for part in sorted(path.parent.iterdir()):
        h.update(part.name.encode())
        h.update(part.read_bytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=default_shared_dir())
    parser.add_argument("--samples", type=int, default=32, help="calibration samples per model")
    parser.add_argument("--presets", nargs="*", help="presets to run (default: every preset)")
    parser.add_argument("--models", nargs="*", help="models to run (default: every one present)")
    args = parser.parse_args()

    import onnxq
    from onnxq.config.presets import PRESETS

    presets = args.presets or list(PRESETS)
    for name, path, data in _models(args.shared, args.samples):
        if args.models and name not in args.models:
            continue
        for preset in presets:
            with tempfile.TemporaryDirectory(prefix="onnxq-digest-") as folder:
                out = Path(folder) / "out" / "model.onnx"
                out.parent.mkdir()
                t0 = time.perf_counter()
                try:
                    onnxq.quantize(str(path), str(out), config=preset,
                                   calibration_data={k: np.array(v) for k, v in data.items()}
                                   if isinstance(data, dict) else data, progress=False)
                    digest = _digest(out)
                except onnxq.OnnxqError as e:
                    digest = f"refused: {str(e)[:80]}"
                print(f"{name}\t{preset}\t{digest}", flush=True)
                print(f"{name} {preset}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
