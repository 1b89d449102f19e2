"""quantize() keeps the collector off the objects alive before it (`onnxq/heap.py`) and
hands them back after: on success, on error, nested, and never a caller's own freeze."""

from __future__ import annotations

import gc

import pytest

from onnxq.heap import settled_heap


def test_the_freeze_lasts_the_run_and_ends_with_it():
    assert gc.get_freeze_count() == 0
    with settled_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with settled_heap():  # a run inside a run: the outer one's freeze holds (frozen objects may still be freed)
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError), settled_heap():
        raise ValueError("a failing run")
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_is_left_as_it_is():
    gc.freeze()
    try:
        kept = gc.get_freeze_count()
        with settled_heap():
            pass
        # neither undone (0) nor frozen again (more): frozen objects can still be freed when
        # their last reference goes (another test's threads finishing), so the count may drop
        assert 0 < gc.get_freeze_count() <= kept
    finally:
        gc.unfreeze()
