"""`onnxq.parallel.ordered_map`: serial results in order, on a pool that lives as long as the
process, safe to nest, to stop early and to fork."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from onnxq.parallel import ordered_map


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
    from onnxq.parallel import in_background

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
