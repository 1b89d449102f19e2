"""Deployment targets: what the int8 kernels of the runtime can hold, and the
quantization that keeps accuracy there (see docs/kernels.md).

`resolve_target` turns the configured target (and, for `auto`, the execution providers
and a probe of this onnxruntime's kernels) into a `TargetProfile` the planner consults.
"""

from onnxq.target.profile import TargetProfile, provider_notes, resolve_target

__all__ = ["TargetProfile", "provider_notes", "resolve_target"]
