"""Measure how fast the quantized model runs against the float one, and say why when it is not faster.

The question a user deploys on: is the int8 model faster here? Both models run in default
onnxruntime sessions (what deploys: fused int8 kernels, every core) on the first
calibration sample repeated to each batch size, taking turns in short blocks so that a
machine's drift hits both alike (`rounds_ms`); each figure is the median of the runs.
Where the quantized model is not faster at some batch size, both run once more under
onnxruntime's profiler and the kernel time per op type says where the time went, read
through a table of causes
(`CAUSES`): Q/DQ boundaries, int8 kernels slower than the float ones they replace, a CPU
without VNNI; each with what would be faster.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from onnxq.calibrate.access import Access, data_access, refusal
from onnxq.calibrate.data import CalibrationSource, InputSpec, axes_of, iter_batches
from onnxq.calibrate.decoder import PAST
from onnxq.calibrate.inputs import take_rows, whole_feed
from onnxq.sessions import deployed_options, imports_extended, open_any
from onnxq.target.profile import GPU_PROVIDERS, cpu_isa, gpu_first

BATCHES = (1, 8)
# Runs per model and batch size, and the wall time that stops them sooner on a slow
# model: a median of 10 to 30 runs moves by a few percent between calls.
RUNS, BUDGET_S = 30, 4.0
# onnxruntime's idle intra-op threads spin for a while after a run, so a session run
# right after another one's runs beside that one's spinning threads: ResNet-20 at batch
# 8 on 2 threads of 2 cores took 6.8 ms with float and int8 interleaved run by run, 1.8 ms
# alone. So the sessions take turns in rounds: a pause that lets the last session's
# threads go to sleep, one warm-up run, then BLOCK timed runs (2.1 ms in that case). The
# threads spin 20-30 ms on a 2-core AMD EPYC (onnxruntime 1.32): after a 20 ms pause its
# float ResNet-20 at batch 8 read 7.1 ms against 3.1 alone, after 30-70 ms 3.1-3.2; 50 ms
# leaves a margin both ways.
BLOCK, PAUSE_S, MIN_ROUNDS = 5, 0.05, 2
PROFILE_RUNS = 5
# Speed-up under which the summary explains: within 3% is the runs' own spread.
FASTER = 1.03
# Share of the quantized model's kernel time in Q/DQ above which boundaries are named.
BOUNDARY_SHARE = 0.10
# Float kernel ms per run under which a model is too small for kernels to matter.
TINY_MS = 0.1

# Float op kinds and the int8 kernels that replace them (onnxruntime's CPU op names; the
# float side includes the NCHWc layout's reorders, which exist only for float Conv).
KERNELS = {
    "Conv": (("Conv", "FusedConv", "ReorderInput", "ReorderOutput"), ("QLinearConv", "ConvInteger")),
    "MatMul/Gemm": (("MatMul", "FusedMatMul", "Gemm", "FusedGemm"),
               ("QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm",
                "MatMulNBits", "QAttention")),
}
BOUNDARIES = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearAdd", "QLinearMul")
# Kernels onnxruntime's optimiser makes from a float MatMul and its weight's DequantizeLinear:
# weight-only, so in a static model the activations' Q/DQ pairs around them go unused
# (encoder trial: A16W8's MatMuls ran as MatMulNBits and were explained as int8 kernels no
# faster than float).
FUSED_WEIGHT_ONLY = ("MatMulNBits",)


@dataclass(frozen=True)
class Timing:
    batch: int
    float_ms: float
    quantized_ms: float
    label: str = ""  # what was timed where it is not a batch of samples (an LLM's prefill, a decode step)

    @property
    def speedup(self) -> float:
        return self.float_ms / self.quantized_ms if self.quantized_ms else float("nan")


def timed_on(providers: Collection[str]) -> str:
    """Where a default session of `providers` runs the model: the GPU provider listed first,
    else this CPU by its instruction set (`cpu_isa`)."""
    return gpu_first(providers) or cpu_isa()


@dataclass
class Latency:
    """Batch-by-batch medians, and the causes where the quantized model is not faster.
    `where`: a GPU provider's name, or this CPU's instruction set (`timed_on`)."""

    timings: list[Timing]
    where: str
    causes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        cells = ", ".join(f"{t.label or f'batch {t.batch}'} {t.float_ms:.3g} -> {t.quantized_ms:.3g} ms "
                          f"({t.speedup:.2f}x)"
                          for t in self.timings)
        on = self.where if self.where in GPU_PROVIDERS else f"this CPU ({self.where})"
        out = [f"latency, default onnxruntime session on {on}, float -> quantized: {cells}"]
        out += [f"latency: {s}" for s in self.skipped]
        out += [f"not faster: {c}" for c in self.causes]
        return out


def fixed_batches(inputs: list[InputSpec]) -> dict[str, int]:
    """The inputs of a fixed batch (a number on their batch axis), and it."""
    return {s.name: s.batch_dim for s in inputs if s.batch_dim is not None}


def decoder_steps(sample: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]] | None:
    """For a KV-cache decoder's prefill `sample` (token ids and an empty cache), what
    deploys: the prefill, and one decode step of a token on a cache of the prefill's length
    (LLM trial: the prefill alone, said as "batch 1", read 1.19x where decoding ran 4.5x);
    None for any other sample."""
    past = {k: np.asarray(v) for k, v in sample.items() if PAST.match(k)}
    ids = np.asarray(sample.get("input_ids", np.zeros((0, 0))))
    if not past or ids.ndim != 2 or ids.shape[0] != 1 or any(v.ndim != 4 for v in past.values()):
        return None
    tokens = ids.shape[1]
    step = {"input_ids": ids[:, -1:]}
    for name, value in past.items():  # a sliding cache keeps its window's length, the others the prefill's
        length = value.shape[2] or tokens
        step[name] = np.zeros((*value.shape[:2], length, value.shape[3]), value.dtype)
    if "attention_mask" in sample:
        step["attention_mask"] = np.ones((1, tokens + 1), np.asarray(sample["attention_mask"]).dtype)
    if "position_ids" in sample:
        step["position_ids"] = np.full((1, 1), tokens, np.asarray(sample["position_ids"]).dtype)
    unknown = set(sample) - set(step)
    if unknown:
        return None
    return {f"prefill of {tokens} tokens": sample, f"decode step after {tokens} tokens": step}


def latency_feeds(inputs: list[InputSpec], data: CalibrationSource, session: ort.InferenceSession,
                  ) -> tuple[dict[int | str, dict[str, np.ndarray]], list[str]]:
    """The first sample repeated to each batch size the model's inputs allow; an input of
    a fixed batch is timed at that batch alone (a sample is then its rows); a decoder's
    prefill and a decode step, by what they are (`decoder_steps`)."""
    sample = next(iter(iter_batches(data, inputs, 1, 1, purpose="the latency check")))
    steps = decoder_steps(sample)
    if steps is not None:
        return dict(steps), []
    if whole_feed(sample, inputs):  # inputs of no shared batch axis: the sample is what one run takes
        return {1: sample}, [f"batch {b} not measured: the inputs share no batch axis" for b in BATCHES if b != 1]
    fixed, axes = fixed_batches(inputs), axes_of(inputs)
    if fixed:
        name, batch = next(iter(fixed.items()))
        skipped = [f"batch {b} not measured: input {name!r} has a fixed batch of {batch}" for b in BATCHES
                   if b != batch]
        return {batch: {k: take_rows(np.asarray(v), axes.get(k, 0), 0, fixed.get(k, batch))
                        for k, v in sample.items()}}, skipped
    return {batch: {k: np.repeat(take_rows(np.asarray(v), axes.get(k, 0), 0, 1), batch, axis=axes.get(k, 0))
                    if np.ndim(v) else v for k, v in sample.items()} for batch in BATCHES}, []


def block_ms(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> list[float]:
    """Ms of each of `BLOCK` runs, after a pause and one warm-up run (module constants)."""
    time.sleep(PAUSE_S)
    session.run(None, feed)
    spent = []
    for _ in range(BLOCK):
        start = time.perf_counter()
        session.run(None, feed)
        spent.append(1e3 * (time.perf_counter() - start))
    return spent


def rounds_ms(sessions: list[ort.InferenceSession], feed: dict[str, np.ndarray], runs: int = RUNS,
              budget_s: float = BUDGET_S) -> list[list[float]]:
    """Per session, the median ms of each round: the sessions take turns in blocks (`BLOCK`,
    `PAUSE_S`) for about `runs` runs each, fewer where they outlast `budget_s` (at least
    `MIN_ROUNDS` rounds)."""
    out: list[list[float]] = [[] for _ in sessions]
    began = time.perf_counter()
    while len(out[0]) * BLOCK < runs and (len(out[0]) < MIN_ROUNDS or time.perf_counter() - began < budget_s):
        for session, rounds in zip(sessions, out):
            rounds.append(float(np.median(block_ms(session, feed))))
    return out


def median_ms(sessions: list[ort.InferenceSession], feed: dict[str, np.ndarray], runs: int = RUNS,
              budget_s: float = BUDGET_S) -> list[float]:
    """Median wall ms per run of each session, over its rounds (`rounds_ms`)."""
    return [float(np.median(r)) for r in rounds_ms(sessions, feed, runs, budget_s)]


def kernel_ms(model: str | os.PathLike | bytes | ir.Model, feed: dict[str, np.ndarray],
              providers: list[str], threads: int = 0) -> dict[str, float]:
    """Kernel ms per run by op type, from onnxruntime's profiler in a default session
    (`threads`: its intra-op threads, 0: every core): each node's median over the runs,
    summed by op type, so that a run the scheduler interrupted does not decide the cause
    (a mean over the runs once put 94% of a model's time in Q/DQ, 16-19% on reruns)."""
    options = deployed_options(extended=imports_extended(model))
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"onnxq-latency-{os.getpid()}")
    session = open_any(model, options, providers)
    try:
        for _ in range(PROFILE_RUNS + 1):
            session.run(None, feed)
    finally:
        trace = Path(session.end_profiling())
    runs: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    try:
        for event in json.loads(trace.read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                runs[event["args"]["op_name"], event["name"]].append(event["dur"] / 1e3)
    finally:
        trace.unlink(missing_ok=True)
    spent: collections.Counter[str] = collections.Counter()
    for (op, _), durations in runs.items():  # a node in a loop's body runs more than once a run
        spent[op] += float(np.median(durations)) * len(durations) / (PROFILE_RUNS + 1)
    return dict(spent)


# GPU providers that compile the graph into their own kernels, int8 ones from Q/DQ pairs.
COMPILING_PROVIDERS = ("TensorrtExecutionProvider", "MIGraphXExecutionProvider")


def model_format(model: ir.Model) -> str:
    """`qdq` (QuantizeLinear/DequantizeLinear nodes), `float16` (float16 weights), else
    `other` (weight-only blocks, dynamic int8, bfloat16): what a GPU cause is about."""
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph):
        return "qdq"
    if any(v.const_value is not None and v.const_value.dtype == ir.DataType.FLOAT16
           for v in model.graph.initializers.values()):
        return "float16"
    return "other"


def gpu_causes(provider: str, form: str) -> list[str]:
    """Why a model of format `form` (`model_format`) is not faster on a GPU provider, as
    measured on an H200 with onnxruntime-gpu 1.31.1 (docs/kernels.md section 10)."""
    if provider in COMPILING_PROVIDERS:
        return [f"{provider} compiles the model into its own kernels (int8 ones where Q/DQ pairs allow): at this "
                "size kernel launches and layout changes outweigh the arithmetic saved; deploy the float model "
                "where this one is slower"]
    if form == "qdq":
        return [f"{provider} has no fused int8 Conv/MatMul kernels: a QDQ model runs QuantizeLinear, "
                "DequantizeLinear and the float kernels (1.1-2.6x float's time on an H200); TensorRT "
                "(TensorrtExecutionProvider) fuses them into int8 kernels, and float16 (--preset FP16, or "
                "--optimize-for latency, which tries it) is this provider's fast format"]
    if form == "float16":
        return [f"on {provider} float16 pays on wide layers only: small ones are bound by kernel launches and "
                "layout changes (on an H200, float16 ran MobileNet-v1 in 0.74-0.86x float's time, ResNet-20 and "
                "MiniLM in 1.0-1.8x); deploy the float model where this one is slower"]
    return [f"on {provider} this format saves memory, not time: weight-only blocks are unpacked to float, "
            "dynamic int8's ops run on the CPU, and bfloat16 has few fast kernels; float16 (--preset FP16) is "
            "this provider's fast format"]


def slower_on_gpu(latency: Latency, model: ir.Model) -> list[str]:
    """The causes where `latency` was timed on a GPU provider and `model` is not faster
    there (`gpu_causes`); none otherwise."""
    if latency.where not in GPU_PROVIDERS or all(t.speedup >= FASTER for t in latency.timings):
        return []
    return gpu_causes(latency.where, model_format(model))


# A float16 or bfloat16 model timed on the CPU (FP16 had read "no single op type explains it").
HALF_ON_CPU = ("{type} saves memory on the CPU, not time: onnxruntime's CPU has few {type} kernels and computes "
               "most ops in float32 around Casts; float16 is a GPU format (CUDA, ROCm: --preset FP16 there)")


def slower_on_cpu(float_ms: dict[str, float], quantized_ms: dict[str, float], isa: str,
                  quantized: ir.Model) -> list[str]:
    """`causes` of a slow CPU timing, a float16 or bfloat16 model's first (its kernel-level
    figures cannot say it)."""
    fused = not any(n.op_type in FUSED_WEIGHT_ONLY for n in quantized.graph)  # any there: onnxruntime made them
    found = causes(float_ms, quantized_ms, isa, wrapped_kinds(quantized), fused_weight_only=fused)
    half = {v.const_value.dtype for v in quantized.graph.initializers.values() if v.const_value is not None} & {
        ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    if not half or any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in quantized.graph):
        return found
    return [HALF_ON_CPU.format(type="float16" if ir.DataType.FLOAT16 in half else "bfloat16"), *found]


def causes(float_ms: dict[str, float], quantized_ms: dict[str, float], isa: str,
           wrapped: Collection[str] = tuple(KERNELS), fused_weight_only: bool = False) -> list[str]:
    """Why the quantized model is not faster, from the kernel time per op type of both
    (`kernel_ms`) on the CPU, each cause with what would be faster (a GPU provider's are
    `slower_on_gpu`'s). `isa`: this CPU's (`cpu_isa`). `wrapped`: the op kinds of
    `KERNELS` that read a DequantizeLinear output in the quantized graph (a kind left out
    of the plan runs in float for that reason, not for want of a kernel). `fused_weight_only`:
    the quantized graph holds no `FUSED_WEIGHT_ONLY` kernel, so those timed are onnxruntime's
    own fusion of a float MatMul with its weight's DequantizeLinear."""
    found = []
    if sum(float_ms.values()) < TINY_MS:
        found.append(f"the float model's kernels take {sum(float_ms.values()):.3f} ms: at this size each run's "
                     "fixed cost (session.run, allocations) outweighs any kernel's gain; batch more samples per run")
    total = sum(quantized_ms.values()) or 1.0
    boundary = sum(quantized_ms.get(op, 0.0) for op in BOUNDARIES)
    fused = FUSED_WEIGHT_ONLY if fused_weight_only and boundary else ()  # weight-only kernels between Q/DQ pairs
    integer = sum(quantized_ms.get(op, 0.0) for _, ints in KERNELS.values() for op in ints if op not in fused)
    if boundary / total >= BOUNDARY_SHARE:
        why = ("int8 regions are short, broken by ops kept float; fewer float ops between quantized ones (or "
               "keeping a short int8 stretch float) removes them" if integer else "no integer kernel runs (below)")
        found.append(f"Q/DQ take {boundary / total:.0%} of the quantized model's kernel time ({boundary:.2f} ms): "
                     + why)
    for kind, (floats, ints) in KERNELS.items():
        made = sum(quantized_ms.get(op, 0.0) for op in fused) if kind == "MatMul/Gemm" else 0.0
        if made:  # a MatMul onnxruntime made weight-only: the activations' Q/DQ pairs around it are unused
            found.append(f"onnxruntime runs the MatMuls as weight-only {'/'.join(fused)} made from each weight's "
                         f"DequantizeLinear ({made:.2f} ms against {sum(float_ms.get(op, 0.0) for op in floats):.2f} "
                         "ms in float): the activations' types have no integer kernel (int16 or float8), so their "
                         "Q/DQ pairs are overhead around it; U8S8 int8 runs fused integer kernels (or fp16 on a GPU)")
            continue
        before = sum(float_ms.get(op, 0.0) for op in floats)
        after = sum(quantized_ms.get(op, 0.0) for op in ints)
        still_float = sum(quantized_ms.get(op, 0.0) for op in floats)
        if not after and still_float and boundary and kind in wrapped:
            found.append(f"every {kind} still runs in float ({still_float:.2f} ms against {before:.2f} ms) between "
                         "its DequantizeLinear and QuantizeLinear: onnxruntime's CPU has no integer kernel for "
                         "these types (int16 or float8 activations, int4 or block weights), so the Q/DQ pairs are pure "
                         "overhead; U8S8 int8 runs fused kernels (or fp16 on a GPU)")
            continue
        if after and still_float > after and boundary and kind in wrapped:  # W4A8: int8 edges, int4 body
            found.append(f"most {kind} time is still float ({still_float:.2f} ms, against {after:.2f} ms in integer "
                         "kernels) between DequantizeLinear and QuantizeLinear: layers whose types have no integer "
                         "kernel on onnxruntime's CPU (int4 or block weights, int16 or float8 activations), or that "
                         "the config or the accuracy search kept float")
            continue
        if after and after + still_float >= before > 0:
            used = "/".join(op for op in ints if quantized_ms.get(op))
            left = f" and float {kind} left {still_float:.2f} ms" if still_float else ""
            found.append(f"{used} {after:.2f} ms{left}, where float {kind} took {before:.2f} ms: onnxruntime's "
                         "float kernels (NCHWc Conv, AVX-512/AMX GEMM) are as fast as its int8 ones on these "
                         "shapes; int8 pays on wider layers, or on a CPU whose int8 rate is higher")
    if isa == "x86-avx2":
        found.append("this CPU has no VNNI: int8 products run at half the rate they do with AVX-VNNI or "
                     "AVX512-VNNI; a CPU with VNNI (or AMX) runs the same model faster")
    if not found:
        found.append("no single op type explains it (kernel times by op: "
                     + ", ".join(f"{op} {ms:.2f}" for op, ms in sorted(quantized_ms.items(), key=lambda i: -i[1])[:5])
                     + " ms)")
    return found


def measure_latency(source: str | os.PathLike | bytes | ir.Model, quantized: ir.Model, inputs: list[InputSpec],
                    data: CalibrationSource, providers: list[str]) -> Latency | str:
    """Float `source` against `quantized`, batch 1 and 8 (module doc); a one-line reason
    instead where it cannot be measured (no data, a model that does not run)."""
    if isinstance(source, onnx.ModelProto):  # a model the Python API was given in memory
        source = source.SerializeToString()
    access = data_access(data)
    if access is Access.NONE:
        return "latency not measured: it runs both models on the first calibration sample; pass calibration_data"
    if not access.rereadable:
        return f"latency not measured: {refusal(access)}"
    try:
        float_session = open_any(source, deployed_options(extended=imports_extended(source)), providers)
        quantized_session = open_any(quantized, deployed_options(extended=imports_extended(quantized)), providers)
        feeds, skipped = latency_feeds(inputs, data, quantized_session)
        feeds, skipped = _runnable(feeds, [float_session, quantized_session], skipped)
        timings = [Timing(batch if isinstance(batch, int) else 1, *median_ms([float_session, quantized_session], feed),
                          label="" if isinstance(batch, int) else batch) for batch, feed in feeds.items()]
        result = Latency(timings, timed_on(providers), skipped=skipped)
        slow = [t for t in timings if t.speedup < FASTER]
        if result.where in GPU_PROVIDERS:  # the CPU's kernel classes do not apply
            result.causes = slower_on_gpu(result, quantized)
        elif slow:
            feed = feeds[slow[-1].label or slow[-1].batch]
            result.causes = slower_on_cpu(kernel_ms(source, feed, providers), kernel_ms(quantized, feed, providers),
                                          result.where, quantized)
    except StopIteration:
        return "latency not measured: the calibration data is empty"
    except Exception as error:  # noqa: BLE001  a check never stops a run; onnxruntime raises several types
        return f"latency not measured: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return result


def _runnable(feeds: dict[int | str, dict[str, np.ndarray]], sessions: list[ort.InferenceSession],
              skipped: list[str]) -> tuple[dict[int | str, dict[str, np.ndarray]], list[str]]:
    """`feeds` less a decoder's decode step that a session refuses (a cache layout the step
    does not build), said, so the prefill is still timed (review)."""
    for label in [k for k in feeds if isinstance(k, str) and k.startswith("decode step")]:
        try:
            for session in sessions:
                session.run(None, feeds[label])
        except Exception as error:  # noqa: BLE001  onnxruntime raises several types
            del feeds[label]
            skipped = [*skipped, f"{label} not measured: {str(error).splitlines()[0][:160]}"]
    return feeds, skipped


def wrapped_kinds(model: ir.Model) -> set[str]:
    """The kinds of `KERNELS` with some node reading a DequantizeLinear output."""
    kinds = {op: kind for kind, (floats, _) in KERNELS.items() for op in floats}
    return {kinds[node.op_type] for node in model.graph if node.op_type in kinds
            and any(v is not None and v.producer() is not None and v.producer().op_type == "DequantizeLinear"
                    for v in node.inputs)}
