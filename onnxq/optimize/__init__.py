"""Stage 3, optimise: rewrite initializers before or during quantization.

- `registry.py`: the pass and algorithm tables and their contracts; entries parsed once.
- `context.py`: what a pass or algorithm reads (frozen) and what it hands back.
- `runner.py`: runs them in order and returns what they left.
- one module per pass (`fold_batchnorm`, `cle`, `smoothquant`) and per algorithm
  (`bias_correction`, `adaround`, `adaquant`, `gptq`, `awq`, `hqq`); `layerwise/` is what
  AdaRound and AdaQuant share.

Passes run before calibration (`Config.pre_quant_opt_config`, in order; those in
`DEFAULT_PASSES` first unless the list names them). Algorithms run after it
(`Config.algo_config`); they see what will be quantized and how, and one that changes a
decision (a bias it adds) returns the new plan. Nothing here imports `emit/`: an algorithm
that must see the model as emitted calls the trial emitter its context carries.
"""

from onnxq.optimize import (  # noqa: F401  (imported to register)
    adaquant,
    adaround,
    awq,
    bias_correction,
    cle,
    fold_batchnorm,
    gptq,
    hqq,
    smoothquant,
)
from onnxq.optimize.context import (
    AlgorithmContext,
    AlgorithmResult,
    Deferred,
    PassContext,
    PassResult,
    Rescale,
    RunSettings,
)
from onnxq.optimize.registry import (
    ALGORITHMS,
    CONTRACTS,
    DEFAULT_PASSES,
    PASSES,
    REQUESTS,
    Contract,
    Entry,
    check_config_entries,
    parse_algorithms,
    parse_passes,
    register_algorithm,
    register_pass,
    statistics_of,
)
from onnxq.optimize.runner import finish_deferred, run_algorithms, run_passes

__all__ = [
    "ALGORITHMS",
    "CONTRACTS",
    "DEFAULT_PASSES",
    "PASSES",
    "REQUESTS",
    "AlgorithmContext",
    "AlgorithmResult",
    "Contract",
    "Deferred",
    "Entry",
    "PassContext",
    "PassResult",
    "Rescale",
    "RunSettings",
    "check_config_entries",
    "finish_deferred",
    "parse_algorithms",
    "parse_passes",
    "register_algorithm",
    "register_pass",
    "run_algorithms",
    "run_passes",
    "statistics_of",
]
