"""`onnxq.quantize` keeps the objects that existed before the call out of the garbage
collector's full collections while it runs (`onnxq/gc_freeze.py`), and leaves the
collector as it found it: nothing frozen after the call, a caller's own freeze and a
disabled collector untouched."""

from __future__ import annotations

import gc

from helpers import conv_relu_chain, random_feeds

import onnxq
from onnxq.gc_freeze import older_objects_frozen


def test_quantize_leaves_the_collector_as_it_found_it():
    model = conv_relu_chain()
    feeds = random_feeds(model, 4, seed=1)
    assert gc.get_freeze_count() == 0
    result = onnxq.quantize(model, None, None, feeds, progress=False)
    assert result.summary.quantized_by_op and gc.get_freeze_count() == 0 and gc.isenabled()


def test_objects_made_before_are_frozen_during_the_block_only():
    before = gc.get_freeze_count()
    with older_objects_frozen():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before


def test_a_callers_freeze_and_a_disabled_collector_are_left_alone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
