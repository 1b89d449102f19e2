"""What the first execution provider does with a plan's formats, where that is not what
a user expects of int8: notes for the summary."""

from __future__ import annotations

from onnxq.config.spec import DType
from onnxq.plan.plan import Kind, QuantPlan

# Activation types the CUDA provider runs through DequantizeLinear + float kernels.
QUANTIZED = frozenset({DType.INT8, DType.UINT8, DType.INT16, DType.UINT16, DType.FLOAT8_E4M3FN,
                       DType.FLOAT8_E5M2})
MATRIX_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


def provider_notes(providers: list[str], plan: QuantPlan) -> list[str]:
    """What the first execution provider does with this plan's formats, where that is
    not what a user expects of int8. Measured on an H200 with onnxruntime-gpu 1.31.1
    (docs/kernels.md, section 10): CUDA has no fused int8 or float8 Conv/MatMul/Gemm, so
    a QDQ model runs as DequantizeLinear + float kernels (int8 1.2-1.8x float's latency,
    float8 1.4-1.9x), and dynamic int8's integer ops have no CUDA kernel."""
    if not providers or providers[0] != "CUDAExecutionProvider":
        return []
    notes = []
    static = {n for t in plan.tensors.values() if t.kind is Kind.ACTIVATION and t.spec.dtype in QUANTIZED
              for n, _ in t.consumers if plan.quantized_nodes.get(n) in MATRIX_OPS}
    if static:
        notes.append(f"CUDAExecutionProvider runs the {len(static)} quantized Conv/MatMul/Gemm as "
                     "DequantizeLinear + float kernels, no faster than float: int8 and float8 speed on "
                     "NVIDIA GPUs comes through TensorrtExecutionProvider; FP16 is the CUDA provider's "
                     "fast format")
    if plan.nodes_for("dynamic"):
        notes.append("CUDAExecutionProvider has no kernel for dynamic int8's DynamicQuantizeLinear and "
                     "MatMulInteger: they run on the CPU (a CPU format)")
    return notes
