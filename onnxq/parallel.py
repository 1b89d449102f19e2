"""Run independent numpy work on the machine's cores, in order and in bounded memory.

numpy releases the GIL inside its array operations, so threads are enough for per-weight
work (block quantization, the HQQ solver): no pickling, no second copy of the model.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TypeVar

from threadpoolctl import threadpool_limits

T = TypeVar("T")
R = TypeVar("R")


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None) -> Iterator[R]:
    """`map(fn, items)` on `workers` threads (default: the cores), results in the order of
    `items`, with at most `workers` + 1 results computed ahead of the consumer, so memory
    stays that of a few items. Each result is the same as a serial run's (results do not
    depend on which thread computes them). With several workers BLAS runs on one thread
    each (`serial_blas`): the workers are the parallelism."""
    workers = cpu_count() if workers is None else max(1, workers)
    if workers == 1:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    with serial_blas(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="onnxq") as pool:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def serial_blas() -> AbstractContextManager:
    """BLAS (and LAPACK) on one thread inside the block: for work that brings its own
    threads (`ordered_map` takes it) or runs beside onnxruntime's. OpenBLAS's threads spin for a
    core; when another thread or process holds one, a 2048-wide Cholesky factor took
    2.8 s on 2 threads against 0.34 s on one (2 cores, one busy)."""
    return threadpool_limits(1, user_api="blas")
