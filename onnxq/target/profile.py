"""Resolve a `Target` into the kernel facts the planner needs.

On x86 CPUs with AVX2 (or AVX512BW) and no VNNI, onnxruntime's quantized GEMM adds
u8 x s8 products pairwise in int16 (`vpmaddubsw`), so two products of 255 x 127 saturate.
Int8 activations are converted to uint8 first on x86, so they saturate too. Depthwise
convolutions use their own kernel, which widens to 32 bits and is safe. A pair of weight
codes can never saturate iff |w0 + w1| <= 128; the planner gives the ops whose kernel
saturates the finest 8-bit scale that holds it (`onnxq.target.pairs`), or 7-bit weights
(|w| <= 64, onnxruntime's reduce_range) where the config asks or the K order is unknown.
"""

from __future__ import annotations

import platform
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from onnxq.config.spec import Config, Target
from onnxq.target.probe import saturating_kernels, wrong_kernels

# Kernel class -> the activation dtypes whose products it saturates with 8-bit weights.
AVX2_SATURATING = frozenset({("uint8", "gemm"), ("int8", "gemm"), ("uint8", "dynamic")})
REDUCED_BITS = 7
# Not probed (a named target): assume onnxruntime's depthwise kernel mishandles
# per-channel weight zero points, as 1.32 does on x86; symmetric weights cost nothing.
WRONG_DEFAULT = frozenset({"depthwise_zero_points"})
GPU_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider", "TensorrtExecutionProvider",
                 "MIGraphXExecutionProvider", "DmlExecutionProvider")


def gpu_first(providers: Collection[str]) -> str | None:
    """The first of `providers` when it is a GPU's (the one a session runs on), else None."""
    first = next(iter(providers), None)
    return first if first in GPU_PROVIDERS else None


@dataclass(frozen=True)
class TargetProfile:
    """A resolved target: its name, the kernels that saturate there, and why."""

    name: str
    saturating: frozenset[tuple[str, str]]
    reason: str
    reduce_range: bool | None = None  # the user's explicit choice, None: follow `saturating`
    # Kernel features that compute wrong results there (see `probe.wrong_kernels`).
    wrong: frozenset[str] = WRONG_DEFAULT

    def symmetric_weights_needed(self, kernel: str, per_channel: bool) -> bool:
        """Whether per-channel weight zero points must all be zero for this kernel."""
        return kernel == "depthwise" and per_channel and "depthwise_zero_points" in self.wrong

    def weight_bits(self, kernel: str, activation: str | None) -> int | None:
        """Bits for 8-bit weights of an op using `kernel` fed `activation` (None: full width).

        `activation` is the activation dtype, or None for weight-only ops (no int8 kernel).
        """
        if self.reduce_range is not None:
            return REDUCED_BITS if self.reduce_range and activation is not None else None
        if activation is not None and (activation, kernel) in self.saturating:
            return REDUCED_BITS
        return None

    def runs_on_cpu(self) -> bool:
        """Whether the model will run on onnxruntime's CPU provider."""
        return self.name != Target.GPU.value

    def describe(self) -> str:
        """One line for the summary."""
        if self.reduce_range is True:
            return f"target {self.name}: 7-bit weights (reduce_range set in the config)"
        if self.reduce_range is False:
            return f"target {self.name}: 8-bit weights (reduce_range false in the config); {self.reason}"
        return f"target {self.name}: {self.reason}"


def cpu_isa() -> str:
    """The target name of this CPU by its instruction set (for naming, not for decisions)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return Target.ARM64.value
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return Target.GENERIC.value
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return Target.GENERIC.value
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        return Target.X86_VNNI.value
    return Target.X86_AVX2.value if "avx2" in flags else Target.GENERIC.value


def _explain(saturating: frozenset[tuple[str, str]], wrong: frozenset[str] = WRONG_DEFAULT) -> str:
    if not saturating:
        return "int8 kernels accumulate exactly: int8 weights use all 8 bits (no reduced range)"
    kinds = sorted({k for _, k in saturating})
    per_tensor = "" if "u8u8_gemm" in wrong else "; per-tensor weights of uint8 inputs uint8 instead, U8U8 being exact"
    return ("int8 " + "/".join(kinds) + " kernels saturate u8 x s8 pairs in int16: "
            "pair-safe int8 weights for Conv/MatMul/Gemm on them (|w0 + w1| <= 128 per kernel "
            f"pair{per_tensor}; depthwise Conv keeps full 8 bits)")


STATIC_PROFILES: dict[Target, frozenset[tuple[str, str]]] = {
    Target.X86_VNNI: frozenset(),
    Target.ARM64: frozenset(),
    Target.GPU: frozenset(),
    Target.X86_AVX2: AVX2_SATURATING,
    # Any CPU: avoid what the weakest supported CPU saturates.
    Target.GENERIC: AVX2_SATURATING,
}


def resolve_target(config: Config) -> TargetProfile:
    """The profile of `config.target`; `auto` asks the first execution provider and, on
    the CPU, probes this onnxruntime's int8 kernels."""
    target = Target(config.target)
    providers = tuple(config.calibration.providers)
    if target is Target.AUTO:
        gpu = gpu_first(providers)
        if gpu is not None:
            name, saturating = Target.GPU.value, frozenset()
            why = f"auto: {gpu}; "
        else:
            cpu = ("CPUExecutionProvider",)
            name, saturating = cpu_isa(), saturating_kernels(cpu)
            why = "auto: probed this CPU's onnxruntime kernels; "
            wrong = wrong_kernels(cpu)
            return TargetProfile(name, saturating, why + _explain(saturating, wrong), config.reduce_range, wrong)
        return TargetProfile(name, saturating, why + _explain(saturating), config.reduce_range)
    saturating = STATIC_PROFILES[target]
    return TargetProfile(target.value, saturating, _explain(saturating), config.reduce_range)

