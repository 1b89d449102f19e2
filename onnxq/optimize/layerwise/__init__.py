"""Layer-wise reconstruction: the machinery AdaRound and AdaQuant share.

Each quantized Conv / Gemm / MatMul weight is optimised so that the layer's output with
quantized weights and quantized inputs matches the float layer's output on float
inputs, one layer at a time in graph order:

- `layers.py` finds the layers and views each weight as per-group matrices [g, M, K].
- `replay.py` runs the float model and the quantized model (Q/DQ emitted as the plan
  says, every processed layer holding its final weights) side by side, segment by
  segment: only the nodes between the last layer and the next one run, from tensors
  kept per calibration batch (in memory, or on disk past a budget), so every node runs
  once per sample and the quantized prefix of each layer already has its optimised
  weights (asymmetric reconstruction: errors do not compound).
- `gram.py` turns the two inputs of a layer into the sufficient statistics of its
  squared output error, H = E[x_q x_q^T] and C = E[x_q x_f^T] (inputs extended by a 1
  for the bias), accumulated in float64 while the data streams: memory is bounded by
  the largest layer, not by the number of samples or positions, and each optimisation
  step costs one [M, K] x [K, K] product, independent of the data.
- `problem.py` builds a layer's `Problem` from those statistics; an optimiser returns a
  `Solution`. `emitted.py` knows the layer's weight and bias as emission writes them.
- `driver.py` walks the layers, calls the algorithm's per-layer optimiser, keeps
  nearest rounding where it fails, pins the result for emission and reports.

The error minimised is the layer output before its activation: with it the loss is
exactly quadratic in the weights, which is what makes the statistics above sufficient.
"""
