"""Shared helpers for the benchmark scripts: data loading, metrics, resource measurement.

Everything here depends only on numpy (plus Pillow for JPEG decoding, imported lazily),
so a quantizer worker can load its calibration data before importing anything heavy.
"""

from __future__ import annotations

import csv
import resource
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

STSB_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
STSB_PAIRS = 1500


def default_shared_dir() -> Path:
    """`../shared` next to the repository root (benchmarks/ -> repo -> parent)."""
    return Path(__file__).resolve().parents[2] / "shared"


# --------------------------------------------------------------------------- resources


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (ru_maxrss: KB on Linux)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024.0 * 1024.0) if sys.platform == "darwin" else rss / 1024.0


def file_mb(path: str | Path) -> float:
    """Size of a model on disk in MB, counting an external-data file next to it if any."""
    path = Path(path)
    total = path.stat().st_size
    data = path.with_name(path.name + ".data")
    if data.exists():
        total += data.stat().st_size
    return total / 1e6


# --------------------------------------------------------------------------- images


def normalize_images_nhwc_u8(images: np.ndarray) -> np.ndarray:
    """uint8 [N,H,W,3] RGB -> float32 [N,3,H,W]: /255, ImageNet mean/std."""
    x = images.astype(np.float32) / 255.0
    x = (x - IMAGENET_MEAN) / IMAGENET_STD
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def imagenet_listing(data_dir: str | Path) -> list[tuple[str, int]]:
    """(file name, label) rows of `imagenet_sample1000/labels.csv`, in file order."""
    with open(Path(data_dir) / "labels.csv", newline="") as f:
        return [(row["file"], int(row["label"])) for row in csv.DictReader(f)]


def load_imagenet(
    data_dir: str | Path, start: int, stop: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode images [start:stop] of the ImageNet sample: float32 NCHW and int64 labels."""
    from PIL import Image

    rows = imagenet_listing(data_dir)[start:stop]
    pixels = np.empty((len(rows), 224, 224, 3), dtype=np.uint8)
    for i, (name, _) in enumerate(rows):
        with Image.open(Path(data_dir) / "images" / name) as img:
            arr = np.asarray(img.convert("RGB"))
        if arr.shape != (224, 224, 3):
            raise ValueError(f"{name}: expected a 224x224 RGB image, got {arr.shape}")
        pixels[i] = arr
    labels = np.array([label for _, label in rows], dtype=np.int64)
    return normalize_images_nhwc_u8(pixels), labels


def load_cifar(data_dir: str | Path, start: int, stop: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Images [start:stop] of the CIFAR-10 sample: float32 NCHW and int64 labels."""
    data_dir = Path(data_dir)
    images = np.load(data_dir / "images_u8_nhwc.npy", mmap_mode="r")[start:stop]
    labels = np.load(data_dir / "labels.npy")[start:stop].astype(np.int64)
    return normalize_images_nhwc_u8(np.asarray(images)), labels


# --------------------------------------------------------------------------- STS-B


def stsb_split(calib_sentences: int, eval_pairs: int | None) -> tuple[list[int], list[int]]:
    """Pair indices used for calibration (both sentences) and for evaluation (the rest).

    The first `calib_sentences // 2` pairs give the calibration sentences; evaluation uses the
    following pairs (capped at `eval_pairs`), so calibration and evaluation never overlap.
    """
    n_calib = min(max(calib_sentences // 2, 1), STSB_PAIRS - 1)
    held_out = list(range(n_calib, STSB_PAIRS))
    if eval_pairs is not None:
        held_out = held_out[:eval_pairs]
    return list(range(n_calib)), held_out


def stsb_rows(pairs: list[int]) -> np.ndarray:
    """Row indices of both sentences of each pair: [first sentences..., second sentences...]."""
    p = np.asarray(pairs, dtype=np.int64)
    return np.concatenate([p, p + STSB_PAIRS])


def load_stsb(data_dir: str | Path, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The three int64 [N,56] encoder inputs, restricted to `rows` when given."""
    data_dir = Path(data_dir)
    feeds = {}
    for name in STSB_INPUTS:
        arr = np.load(data_dir / f"{name}.npy").astype(np.int64)
        feeds[name] = np.ascontiguousarray(arr if rows is None else arr[rows])
    return feeds


def load_stsb_scores(data_dir: str | Path) -> np.ndarray:
    return np.load(Path(data_dir) / "scores.npy").astype(np.float64)


# --------------------------------------------------------------------------- generic files


def load_arrays(
    path: str | Path, input_names: list[str], stop: int | None = None
) -> dict[str, np.ndarray]:
    """Arrays for the model inputs from a .npz (keyed by input name) or a .npy (single input).

    Keys of a .npz that are not model inputs (for example `labels`) are ignored.
    """
    path = Path(path)
    if path.suffix == ".npy":
        if len(input_names) != 1:
            raise ValueError(
                f"{path}: a .npy file can only feed a single-input model, this one has {input_names}"
            )
        return {input_names[0]: np.load(path)[:stop]}
    with np.load(path, allow_pickle=False) as data:
        missing = [n for n in input_names if n not in data.files]
        if missing:
            raise ValueError(
                f"{path}: no array for model input(s) {missing}; it holds {data.files}"
            )
        return {n: np.ascontiguousarray(data[n][:stop]) for n in input_names}


def load_labels(spec: str, eval_path: str | Path | None, stop: int | None = None) -> np.ndarray:
    """Labels from a .npy path, or from the key `spec` of the eval .npz."""
    if Path(spec).is_file():
        return np.load(spec)[:stop].astype(np.int64)
    if eval_path is not None and Path(eval_path).suffix == ".npz":
        with np.load(eval_path, allow_pickle=False) as data:
            if spec in data.files:
                return data[spec][:stop].astype(np.int64)
    raise ValueError(f"--labels {spec!r} is neither a .npy file nor a key of {eval_path}")


def num_samples(arrays: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(arrays.values())))


def batches(arrays: Mapping[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    n = num_samples(arrays)
    for i in range(0, n, batch_size):
        yield {k: v[i : i + batch_size] for k, v in arrays.items()}


class FeedReader:
    """onnxruntime `CalibrationDataReader`: one batch-1 feed dict per `get_next()` call."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)
        self.n = num_samples(self.arrays)
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= self.n:
            return None
        i, self.i = self.i, self.i + 1
        return {k: v[i : i + 1] for k, v in self.arrays.items()}

    def rewind(self) -> None:
        self.i = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.rewind()
        while (item := self.get_next()) is not None:
            yield item


# --------------------------------------------------------------------------- metrics


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (scipy's `rankdata(method="average")`)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Start index of each run of equal values, and its length.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    lengths = np.diff(np.r_[starts, len(x)])
    avg = starts + (lengths + 1) / 2.0  # mean of the 1-based ranks starts+1 .. starts+length
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(avg, lengths)
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks)."""
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of corresponding rows of two [N, D] arrays."""
    a = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
    b = np.asarray(b, dtype=np.float64).reshape(len(b), -1)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-30)


def top1(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits).reshape(len(logits), -1).argmax(axis=1)


def jsonable(obj: Any) -> Any:
    """numpy scalars and arrays -> plain Python, recursively."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return obj
