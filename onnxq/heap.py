"""`settled_heap()`: a run's garbage collections walk the run's own objects, not the
libraries' that were alive before it.

Python's cyclic collector walks every tracked object at each full collection, and a run
allocates enough (onnx-ir nodes and values, protobuf fields, summaries) to set off
several. After `import onnxq` about 82,000 objects are alive (onnx, onnxruntime, numpy,
onnx-ir; `gc.get_objects()`), none of which a run frees. `gc.freeze()` moves them to a
permanent generation the collector neither walks nor frees; `gc.unfreeze()` hands them
back when the run ends. Cycles already unreachable when it starts (an earlier run's
graphs, not yet collected) wait for the run's end too. Measured on ResNet-20, default
int8, the first call in a process (what the CLI does): about 0.34 s -> 0.28 s, five runs
each (2-core AMD EPYC, Python 3.11).

Runs in several threads share one freeze: the first to start takes it, the last to end
gives it back. A freeze the caller made itself (a pre-fork server's) is left as it is; one
another thread makes while a run is under way is undone with the run's at its end.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_runs = 0  # runs under way
_frozen = False  # whether the first of them froze


@contextmanager
def settled_heap() -> Iterator[None]:
    """Freeze what is alive for the length of the block (module doc)."""
    global _runs, _frozen
    with _lock:
        if _runs == 0:
            _frozen = gc.isenabled() and not gc.get_freeze_count()
            if _frozen:
                gc.freeze()
        _runs += 1
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0 and _frozen:
                gc.unfreeze()
                _frozen = False
