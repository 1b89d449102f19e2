"""`onnxq.parallel.ordered_map`: serial results in order, on a pool that lives as long as the
process, safe to nest, to stop early and to fork."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from onnxq.parallel import in_background, ordered_map


def test_results_in_order_and_nested_calls_run():
    assert list(ordered_map(lambda x: x * x, range(20), workers=2)) == [x * x for x in range(20)]
    nested = list(ordered_map(lambda x: sum(ordered_map(lambda y: x * y, range(4), workers=2)), range(6), workers=2))
    assert nested == [6 * x for x in range(6)]


def test_no_task_outlives_an_error_or_an_early_close():
    running = []
    lock = threading.Lock()

    def work(x: int) -> int:
        with lock:
            running.append(x)
        time.sleep(0.05)
        with lock:
            running.remove(x)
        if x == 1:
            raise ValueError("boom")
        return x

    with pytest.raises(ValueError, match="boom"):
        list(ordered_map(work, range(8), workers=2))
    assert running == []
    results = ordered_map(work, [0, 2, 3, 4, 5], workers=2)
    assert next(results) == 0
    results.close()
    assert running == []


def _child(queue) -> None:
    queue.put(list(ordered_map(lambda x: x + 1, range(5), workers=2)))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_a_forked_child_gets_its_own_pool():
    list(ordered_map(lambda x: x, range(4), workers=2))  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=30)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and queue.get(timeout=5) == [1, 2, 3, 4, 5]


def test_a_background_task_runs_beside_ordered_map_and_raises_its_own_error():

    def slow_square(x: int) -> int:
        time.sleep(0.05)
        return x * x

    future = in_background(slow_square, 7)
    assert list(ordered_map(lambda x: x + 1, range(6), workers=2)) == [1, 2, 3, 4, 5, 6]
    assert future.result(timeout=10) == 49
    assert list(in_background(lambda: list(ordered_map(lambda x: -x, range(3), workers=2))).result(timeout=10)) == [0, -1, -2]

    def fail() -> None:
        raise ValueError("bad factor")

    with pytest.raises(ValueError, match="bad factor"):
        in_background(fail).result(timeout=10)


def test_blas_threads_are_restored_after_gptq_and_nested_serial_blocks():
    """GPTQ runs its factor in the background beside its static groups' search, both under
    serial_blas: afterwards the process's BLAS threads are what they were (blocks restoring
    what each saw on entry, closing out of order, left numpy on one thread)."""
    import numpy as np
    from threadpoolctl import threadpool_info

    from onnxq.config.resolve import ResolvedSpec
    from onnxq.config.spec import DType
    from onnxq.optimize.gptq import GPTQConfig, gptq_quantize
    from onnxq.parallel import serial_blas

    def blas_threads() -> list[int]:
        return sorted({info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"})

    before = blas_threads()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1600, 768))
    spec = ResolvedSpec(DType.INT4, False, "per_group", None, 128, "minmax", 99.99, 2048, (), None, None,
                        "float32", "half_even", False)
    for _ in range(4):
        gptq_quantize(rng.standard_normal((64, 768)).astype(np.float32), x.T @ x / len(x), spec, GPTQConfig())
        assert blas_threads() == before
    with serial_blas():
        with serial_blas():
            assert blas_threads() in ([], [1])
        assert blas_threads() in ([], [1])  # the inner block leaves the outer's limit in place
    assert blas_threads() == before


def test_a_background_task_started_from_the_background_thread_runs_inline():

    assert in_background(lambda: in_background(lambda: 5).result(timeout=10)).result(timeout=10) == 5
