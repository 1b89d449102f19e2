"""Quantization arithmetic on arrays: integer and float8 types, scales and zero points,
rounding, weight quantization (per tensor, channel or block, pair-safe). Pure numpy: no
graph, no plan, so every stage (calibration, passes, emission) can share it."""
