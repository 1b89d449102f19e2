"""Run independent numpy work on the machine's cores, in order and in bounded memory.

numpy releases the GIL inside its array operations, so threads are enough for per-weight
work (block quantization, the HQQ solver): no pickling, no second copy of the model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from threadpoolctl import ThreadpoolController

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
    each (`serial_blas`): the workers are the parallelism. The threads live as long as
    the process (`_pool`); a call from one of them runs serially, as a nested pool would
    only queue behind itself."""
    workers = cpu_count() if workers is None else max(1, workers)
    if workers == 1 or getattr(_worker, "busy", False):
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    pool = _pool(workers)
    with serial_blas():
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # an error or an early close: no task of this call outlives it
            for future in pending:
                future.cancel()
            wait(pending)


def in_background(fn: Callable[..., R], *args: object) -> Future[R]:
    """`fn(*args)` on a thread of its own, beside the caller's work: two steps that do not
    read each other's results (GPTQ's factorisation and its static groups' search), each
    with its own `ordered_map` calls, share the pool's cores instead of taking turns. The
    thread is no pool worker, so its `ordered_map` calls use the pool (whose tasks never
    wait on other tasks: no deadlock); called from a pool worker or from that thread, `fn`
    runs inline, as a nested `ordered_map` does. Results are the same as a serial call's.
    Where both sides use BLAS, hold `serial_blas` in the calling thread until the task is
    done: OpenBLAS (0.3.31) ignored the thread count restored from another thread."""
    if getattr(_worker, "busy", False) or getattr(_worker, "background", False):
        done: Future[R] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, as a thread's would be)
            done.set_exception(exc)
        return done
    with _POOLS_LOCK:
        if _BACKGROUND not in _POOLS:
            _POOLS[_BACKGROUND] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onnxq-background",
                                                     initializer=_mark_background)
        pool = _POOLS[_BACKGROUND]
    return pool.submit(fn, *args)


_BACKGROUND = 0  # `_POOLS` key of `in_background`'s thread (pool keys are worker counts, at least 1)


_worker = threading.local()  # busy: this thread is one of a pool's


def _mark_worker() -> None:
    _worker.busy = True


def _mark_background() -> None:
    _worker.background = True  # an `in_background` inside it runs inline: its one thread would wait on itself


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per worker count for the process: a pool per call started threads for
    every call (GPTQ on SmolLM2 calls it 3,662 times: 5 s of thread starts). A forked
    child starts its own (`_forget`): the parent's threads do not exist in it."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="onnxq",
                                                 initializer=_mark_worker)
        return _POOLS[workers]


@functools.cache
def _controller() -> ThreadpoolController:
    """The BLAS libraries numpy loaded, found once (a search per `serial_blas` cost 0.8 ms:
    1 s of GPTQ on SmolLM2)."""
    return ThreadpoolController()


def _forget() -> None:
    """In a forked child: no pool, no controller, fresh locks (the parent's may be held),
    no open `serial_blas` block (the parent's threads that opened it do not exist here)."""
    global _POOLS_LOCK, _SERIAL_LOCK, _SERIAL_DEPTH, _SERIAL_LIMITER
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    _SERIAL_LOCK, _SERIAL_DEPTH, _SERIAL_LIMITER = threading.Lock(), 0, None
    _controller.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


@contextlib.contextmanager
def serial_blas() -> Iterator[None]:
    """BLAS (and LAPACK) on one thread inside the block: for work that brings its own
    threads (`ordered_map` takes it) or runs beside onnxruntime's. OpenBLAS's threads spin for a
    core; when another thread or process holds one, a 2048-wide Cholesky factor took
    2.8 s on 2 threads against 0.34 s on one (2 cores, one busy).

    The limit is the process's, so blocks entered by several threads at once (GPTQ's
    factorisation beside its static groups' search, `in_background`) share one: the first
    entry sets it, the last exit restores what was there before. Each block restoring what
    it saw on entry left numpy on one thread after GPTQ when the blocks closed out of order."""
    global _SERIAL_DEPTH, _SERIAL_LIMITER
    with _SERIAL_LOCK:
        if _SERIAL_DEPTH == 0:
            _SERIAL_LIMITER = _controller().limit(limits=1, user_api="blas")
        _SERIAL_DEPTH += 1
    try:
        yield
    finally:
        with _SERIAL_LOCK:
            _SERIAL_DEPTH -= 1
            if _SERIAL_DEPTH == 0 and _SERIAL_LIMITER is not None:
                _SERIAL_LIMITER.restore_original_limits()
                _SERIAL_LIMITER = None


_SERIAL_LOCK = threading.Lock()
_SERIAL_DEPTH = 0  # `serial_blas` blocks open in this process, any thread
_SERIAL_LIMITER: Any = None  # threadpoolctl's limiter of the outermost one, which restores the limit
