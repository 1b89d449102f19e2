"""Shared helpers for the benchmark scripts: data loading, metrics, resource measurement.

Everything here depends only on numpy (plus Pillow for JPEG decoding, imported lazily),
so a quantizer worker can load its calibration data before importing anything heavy.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
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


# --------------------------------------------------------------------------- lazy data


class ImagenetReader:
    """Lazy `CalibrationDataReader` over the ImageNet sample: one batch-1 feed per call.

    Each `get_next()` decodes one JPEG, so only the current image is in memory. The file
    list [start:stop] is cycled until `count` feeds have been given (the sample has 1000
    images; `count=1024` repeats the first 24). `rewind()` starts over, so onnxq can read
    it again if it needs another pass; iterating it also rewinds first.
    """

    def __init__(
        self,
        data_dir: str | Path,
        count: int,
        input_name: str = "input",
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.dir = Path(data_dir)
        self.files = [name for name, _ in imagenet_listing(self.dir)[start:stop]]
        if not self.files:
            raise ValueError(f"{self.dir}: no images in [{start}:{stop}]")
        self.count = int(count)
        self.input_name = input_name
        self.i = 0

    def _decode(self, name: str) -> np.ndarray:
        from PIL import Image

        with Image.open(self.dir / "images" / name) as img:
            arr = np.asarray(img.convert("RGB"))
        return normalize_images_nhwc_u8(arr[None])

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= self.count:
            return None
        name = self.files[self.i % len(self.files)]
        self.i += 1
        return {self.input_name: self._decode(name)}

    def rewind(self) -> None:
        self.i = 0

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.rewind()
        while (item := self.get_next()) is not None:
            yield item


# --------------------------------------------------------------------------- workers

# A quantizer (or any measured call) runs in its own `python SCRIPT --worker ROLE --job JOB`
# subprocess: the parent writes the job as JSON, the worker writes its result as JSON.


def current_rss_mb() -> float:
    """Current resident set size of this process in MB (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss / (1024.0 * 1024.0)


def available_mb() -> float:
    """Memory available to new processes, in MB (psutil)."""
    import psutil

    return psutil.virtual_memory().available / (1024.0 * 1024.0)


class RssLimitSampler:
    """Polls the current RSS every `interval` s in a background thread, keeping the peak.

    With `limit_mb`, a process whose RSS passes the limit prints a message to stderr and
    exits at once with status 3 (a guard against a calibrator that holds every activation
    of every sample on a machine without swap).
    """

    def __init__(self, interval: float = 0.01, limit_mb: float | None = None) -> None:
        import threading

        self.interval = interval
        self.limit_mb = limit_mb
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import os

        while not self._stop.is_set():
            rss = current_rss_mb()
            self.peak = max(self.peak, rss)
            if self.limit_mb and rss > self.limit_mb:
                print(
                    f"RSS limit exceeded: {rss:.0f} MB > {self.limit_mb:.0f} MB; worker stopped",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssLimitSampler:
        self.peak = current_rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mb())


def measure_call(fn: Any, limit_mb: float | None = None) -> tuple[Any, dict[str, float]]:
    """Run `fn()` and return (its value, {time_s, peak_rss_mb, rss_before_mb, ...}).

    `peak_rss_mb` is `ru_maxrss` when it rose during the call (exact), otherwise the 10 ms
    sampled peak of the call; `rss_increase_mb` is that peak minus the RSS just before.
    """
    import gc
    import time

    gc.collect()
    rss_before = current_rss_mb()
    maxrss_before = peak_rss_mb()
    with RssLimitSampler(limit_mb=limit_mb) as sampler:
        t0 = time.perf_counter()
        value = fn()
        elapsed = time.perf_counter() - t0
    maxrss_after = peak_rss_mb()
    peak = maxrss_after if maxrss_after > maxrss_before else sampler.peak
    return value, {
        "time_s": elapsed,
        "peak_rss_mb": peak,
        "rss_before_mb": rss_before,
        "rss_increase_mb": peak - rss_before,
        "sampled_peak_rss_mb": sampler.peak,
        "process_maxrss_mb": maxrss_after,
    }


def quantizer_worker(
    quantizer: str, job_path: str, load: Any, quantizers: Mapping[str, Any]
) -> int:
    """The body of a benchmark's worker process: `load(job["data"])` gives (data, samples);
    both libraries are imported so the memory baseline is the same on each side; then
    `quantizers[quantizer](job, data)` runs under `measure_call` and the result (time,
    memory, its own info, or the error of a failing quantizer) goes to `job["result"]`."""
    import json
    import time
    import traceback

    job = json.loads(Path(job_path).read_text())
    t_load = time.perf_counter()
    data, samples = load(job["data"])
    load_s = time.perf_counter() - t_load
    import onnx  # noqa: F401
    import onnxruntime.quantization  # noqa: F401

    import onnxq  # noqa: F401

    def call() -> dict[str, Any]:
        try:
            return quantizers[quantizer](job, data)
        except Exception as exc:  # noqa: BLE001  (reported in the result)
            lines = str(exc).strip().splitlines()
            return {"error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400],
                    "traceback": traceback.format_exc()}

    info, stats = measure_call(call, job.get("rss_limit_mb"))
    result = {"quantizer": quantizer, "method": job.get("method"), **stats, "data_load_s": load_s,
              "calib_samples": samples, **info}
    if "error" not in info:
        result["size_mb"] = file_mb(job["output"])
    Path(job["result"]).write_text(json.dumps(jsonable(result), indent=2))
    return 0


def harness_parser(doc: str, models: Sequence[str] = (), workers: Sequence[str] | None = None,
                   keep: str = "keep quantized models, jobs and logs here") -> argparse.ArgumentParser:
    """The options every benchmark shares: --shared-dir, --models (when `models` are
    given; all by default), --json, --keep, and the hidden --worker/--job by which a
    benchmark runs each quantizer in a fresh process of its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared-dir", type=Path, default=default_shared_dir())
    if models:
        p.add_argument("--models", nargs="+", default=list(models), choices=list(models))
    p.add_argument("--json", type=Path, help="write every number to this JSON file")
    p.add_argument("--keep", type=Path, help=keep)
    if workers is not None:
        p.add_argument("--worker", choices=list(workers) or None, help=argparse.SUPPRESS)
        p.add_argument("--job", help=argparse.SUPPRESS)
    return p


def fmt(v: Any, spec: str) -> str:
    """`v` formatted by `spec`, or "-" when missing."""
    return "-" if v is None else format(v, spec)


def _cell(name: str, row: dict[str, Any], encoder: bool) -> str:
    """One cell of `run_table`, right-aligned to its column's width."""
    load = row.get("load_average")
    cells = {
        "quant s": (row.get("time_s"), "8.2f"),
        "peak RSS MB": (row.get("peak_rss_mb"), "12.0f"),
        "+RSS MB": (row.get("rss_increase_mb"), "8.0f"),
        "size MB": (row.get("size_mb"), "8.2f"),
        "metric": (row.get("metric"), "14.2f"),
        "agree": (row.get("agree"), "10.4f" if encoder else "10.2f"),
        "infer ms": (row.get("infer_ms"), "9.3f"),
        "load": (load[0] if load else None, "5.2f"),
    }
    if name == "Q/DQ":
        return f"{row.get('QuantizeLinear', 0)}/{row.get('DequantizeLinear', 0)}".rjust(9)
    value, spec = cells[name]
    return fmt(value, spec).rjust(int(spec.split(".")[0]))


def run_table(title: str, res: dict[str, Any], columns: tuple[str, ...], width: int, all_pairs: str) -> list[str]:
    """The lines of a quantizer comparison: a header, one line per run in `res["rows"]`
    (FAILED with the error for a failed run), and for sentence encoders the Spearman on
    `all_pairs`. Columns are named as in `_cell`; "metric" is titled `res["metric"]`."""
    encoder = res["metric"].startswith("Spearman")
    headers = {"metric": res["metric"], "agree": "cos vs fp" if encoder else "agree %"}
    widths = {"quant s": 8, "peak RSS MB": 12, "+RSS MB": 8, "size MB": 8, "metric": 14, "agree": 10,
              "infer ms": 9, "Q/DQ": 9, "load": 5}
    lines = [title, " ".join([" " * width] + [headers.get(c, c).rjust(widths[c]) for c in columns])]
    for name, row in res["rows"].items():
        if "error" in row:
            after = (f" (after {row['time_s']:.1f} s, peak RSS {row['peak_rss_mb']:.0f} MB)"
                     if "time_s" in row and "peak_rss_mb" in row else "")
            lines.append(f"{name:{width}} FAILED{after}: {row['error'][:160]}")
            continue
        lines.append(" ".join([f"{name:{width}}"] + [_cell(c, row, encoder) for c in columns]))
    if encoder:
        alls = ", ".join(f"{k} {fmt(r.get('spearman_all_pairs'), '.2f')}"
                         for k, r in res["rows"].items() if "error" not in r)
        lines.append(f"Spearman x100 on {all_pairs} (incl. calibration pairs): {alls}")
    return lines


def spawn_worker(
    script: str | Path,
    role: str,
    job: dict[str, Any],
    workdir: Path,
    tag: str,
    timeout: float | None,
    python: str | None = None,
) -> dict[str, Any]:
    """Run `python SCRIPT --worker ROLE --job WORKDIR/TAG.job.json` (`python`: another
    interpreter, default this one), return its result JSON.

    The job gets `output` (WORKDIR/TAG.onnx) and `result` paths added. On a non-zero exit, a
    timeout or a missing result, returns {"error": "...", "log_tail": ...} instead; the log
    is WORKDIR/TAG.log.
    """
    import json
    import subprocess
    import time

    job_path, log_path = workdir / f"{tag}.job.json", workdir / f"{tag}.log"
    job = {
        **job,
        "output": str(workdir / f"{tag}.onnx"),
        "result": str(workdir / f"{tag}.result.json"),
    }
    Path(job["result"]).unlink(missing_ok=True)
    job_path.write_text(json.dumps(jsonable(job), indent=2))
    cmd = [python or sys.executable, str(Path(script).resolve()), "--worker", role, "--job", str(job_path)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    if rc != 0 or not Path(job["result"]).exists():
        text = log_path.read_text(errors="replace")
        last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
        return {
            "error": f"worker exit {rc}: {last}" if last else f"worker exit {rc}",
            "log_tail": text[-2000:],
            "worker_wall_s": wall,
        }
    result = json.loads(Path(job["result"]).read_text())
    result["output"] = job["output"]
    result["worker_wall_s"] = wall
    return result


def load_average() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


# --------------------------------------------------------------------------- machine


def cpu_flags() -> str:
    """The CPU's int8-relevant flags (AVX2, VNNI, AMX) from /proc/cpuinfo, else the machine name."""
    import platform

    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.machine()
    return ", ".join(f for f in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags) or platform.machine()


def cpu_line() -> str:
    """One line for a benchmark's header: cores, architecture and whether the CPU has VNNI
    (every int8 figure depends on it)."""
    import os
    import platform

    vnni = "with VNNI" if "vnni" in cpu_flags() else "without VNNI"
    return f"CPU: {os.cpu_count()} cores, {platform.machine()} {vnni}"


def answer_job(job_path: str | Path, work: Any) -> int:
    """A worker's side of a JSON job: `work(job)`'s result written to the job's `result` path."""
    import json

    job = json.loads(Path(job_path).read_text())
    Path(job["result"]).write_text(json.dumps(jsonable(work(job))))
    return 0


# --------------------------------------------------------------------------- latency


def median_latency_ms(
    sessions: Mapping[str, Any],
    feeds: Mapping[str, Mapping[str, np.ndarray]],
    runs: int,
    warmup: int = 3,
) -> dict[str, dict[str, float]]:
    """Median (and min, max) ms per `session.run` for several sessions, taking turns.

    Each session is warmed up `warmup` times, then the sessions take turns in blocks of
    `onnxq.emit.latency.BLOCK` runs, each after a pause and one warm-up run, until each
    has about `runs` runs: a change of machine load hits all of them alike, and no session
    runs beside another one's spinning thread pool (`onnxq/emit/latency.py`: run-by-run
    interleaving made a multi-threaded int8 ResNet-20 3x slower). `feeds[name]` is the
    feed of session `name`.
    """
    from onnxq.emit.latency import BLOCK, block_ms

    for name, sess in sessions.items():
        for _ in range(warmup):
            sess.run(None, dict(feeds[name]))
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(max(1, -(-runs // BLOCK))):
        for name, sess in sessions.items():
            times[name].extend(block_ms(sess, dict(feeds[name])))
    return {
        name: {
            "median_ms": float(np.median(t)),
            "min_ms": float(np.min(t)),
            "max_ms": float(np.max(t)),
            "runs": len(t),
        }
        for name, t in times.items()
    }


ORT_LEVELS = ("disable", "basic", "extended", "all")


def make_session(
    path: str | Path,
    threads: int | None = None,
    level: str | None = None,
    config: Mapping[str, str] | None = None,
) -> Any:
    """onnxruntime CPU session. `level`: graph optimization level, one of ORT_LEVELS
    (default: onnxruntime's, "all"); `config` entries go to
    `SessionOptions.add_session_config_entry`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if level is not None:
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[level]
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def git_revision() -> str | None:
    """`git describe --always --dirty` of the repository holding benchmarks/, or None."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def scratch_dir(keep: str | Path | None, prefix: str) -> Iterator[Path]:
    """`keep` (created, left in place) or a fresh temporary folder removed afterwards."""
    path = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def add_result(report: dict[str, Any], name: str, result: Any, table: str) -> None:
    """Record one model's result in the report and print its table."""
    report["models"][name] = result
    print(table, flush=True)
    print(flush=True)


def finish_report(report: dict[str, Any], t0: float, json_path: Path | None) -> int:
    """Stamp the end of a benchmark run, print the machine line, write the JSON; exit code 0."""
    import json
    import time

    report["total_s"] = time.perf_counter() - t0
    report["load_average_at_end"] = load_average()
    m = report["machine"]
    revision = f" ({m['git_revision']})" if m.get("git_revision") else ""
    print(
        f"machine: {m['cpu_count']} CPUs, {m['platform']}; onnxruntime {m['onnxruntime']}, "
        f"onnxq {m['onnxq']}{revision}; load average {m['load_average_at_start'][0]:.2f} at start, "
        f"{report['load_average_at_end'][0]:.2f} at end; total {report['total_s']:.0f} s"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(jsonable(report), indent=2))
        print(f"wrote {json_path}")
    return 0


def start_report(args: Any, machine: dict[str, Any]) -> dict[str, Any]:
    """The JSON report of a benchmark run: machine, settings (the CLI options), results."""
    from pathlib import Path as _Path

    settings = {
        k: (str(v) if isinstance(v, _Path) else v)
        for k, v in vars(args).items()
        if k not in ("worker", "job")
    }
    return {"machine": machine, "settings": settings, "models": {}}
