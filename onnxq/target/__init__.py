"""Deployment targets: what the int8 kernels of the runtime can hold, and the
quantization that keeps accuracy there (see docs/kernels.md).

`resolve_target` turns the configured target (and, for `auto`, the execution providers
and a probe of this onnxruntime's kernels) into a `TargetProfile` the planner consults;
`narrowing` gives each weight the spec the target's kernel can run.
"""

from onnxq.target.profile import TargetProfile, resolve_target

__all__ = ["TargetProfile", "resolve_target"]
