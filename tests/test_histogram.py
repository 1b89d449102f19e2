"""StreamingHistogram: exact widening, batching-independence, exact merge, percentiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxq.calibrate.observers.histogram import StreamingHistogram

N_BINS = 2048


def _streams() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {
        "normal": rng.normal(size=60_000),
        "student_t": rng.standard_t(2.5, size=60_000),
        "relu": np.maximum(rng.normal(size=60_000), 0.0),
        "shifted": 1000.0 + rng.normal(size=60_000),
        "negative": -np.abs(rng.laplace(size=60_000)) - 5.0,
        "outliers": np.concatenate([rng.normal(size=60_000), [300.0, -2000.0]]),
        "growing": np.concatenate([rng.uniform(0, 1e-3, 1000), rng.normal(0, 50.0, 59_000)]),
    }


STREAMS = _streams()


def _fill(values: np.ndarray, symmetric: bool, batches: int = 50) -> StreamingHistogram:
    hist = StreamingHistogram(N_BINS, symmetric=symmetric)
    for batch in np.array_split(values, batches):
        hist.update(batch)
    return hist


def _same(a: StreamingHistogram, b: StreamingHistogram) -> None:
    np.testing.assert_array_equal(a.edges(), b.edges())
    np.testing.assert_array_equal(a.counts, b.counts)
    assert (a.min, a.max, a.total) == (b.min, b.max, b.total)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_streamed_counts_equal_numpy_histogram_of_all_data(name: str, symmetric: bool) -> None:
    data = STREAMS[name]
    hist = _fill(data, symmetric)
    ref = np.abs(data) if symmetric else data
    edges = hist.edges()
    # Every value falls inside the window, half-open bins, exactly numpy's assignment.
    assert edges[0] <= ref.min() and ref.max() < edges[-1]
    np.testing.assert_array_equal(hist.counts, np.histogram(ref, bins=edges)[0])
    assert hist.counts.dtype == np.int64
    assert hist.total == data.size
    assert (hist.min, hist.max) == ((0.0, ref.max()) if symmetric else (ref.min(), ref.max()))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_grid_is_power_of_two_and_fine(name: str, symmetric: bool) -> None:
    data = np.abs(STREAMS[name]) if symmetric else STREAMS[name]
    hist = _fill(data, symmetric)
    w = hist.bin_width
    assert w == 2.0 ** round(math.log2(w))
    edges = hist.edges()
    np.testing.assert_array_equal(edges / w, np.round(edges / w))
    np.testing.assert_array_equal(np.diff(edges), w)
    lo = 0.0 if symmetric else data.min()
    # Minimal exponent: half the width would not fit the data into N_BINS bins.
    assert w < 2 * (data.max() - lo) / (N_BINS - 1)
    if symmetric:
        assert edges[0] == 0.0


@pytest.mark.parametrize("symmetric", [False, True])
def test_batching_does_not_change_the_histogram(symmetric: bool) -> None:
    data = STREAMS["growing"]
    whole = _fill(data, symmetric, batches=1)
    _same(whole, _fill(data, symmetric, batches=50))
    _same(whole, _fill(data, symmetric, batches=997))
    _same(whole, _fill(data[::-1], symmetric, batches=7))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_merge_of_two_parts_equals_histogram_of_the_union(name: str, symmetric: bool) -> None:
    data = STREAMS[name]
    whole = _fill(data, symmetric)
    for cut in (1, 777, data.size // 2, data.size - 3):
        first = _fill(data[:cut], symmetric, batches=min(cut, 20))
        second = _fill(data[cut:], symmetric, batches=20)
        first.merge(second)
        _same(first, whole)


def test_merge_with_empty_and_incompatible() -> None:
    data = STREAMS["normal"]
    whole = _fill(data, False)
    empty = StreamingHistogram(N_BINS)
    empty.merge(whole)
    _same(empty, whole)
    copy = whole.copy()
    copy.merge(StreamingHistogram(N_BINS))
    _same(copy, whole)
    with pytest.raises(ValueError):
        whole.merge(StreamingHistogram(1024))
    with pytest.raises(ValueError):
        whole.merge(StreamingHistogram(N_BINS, symmetric=True))


def test_widening_keeps_total_and_is_exact() -> None:
    rng = np.random.default_rng(7)
    narrow = rng.uniform(0.25, 0.5, 10_000)
    hist = StreamingHistogram(N_BINS)
    hist.update(narrow)
    w0 = hist.bin_width
    before = hist.counts.copy()
    wide = np.array([-3.0, 1e4])
    hist.update(wide)
    assert hist.total == narrow.size + wide.size
    ratio = hist.bin_width / w0
    assert ratio == 2 ** round(math.log2(ratio)) and ratio > 1
    # The narrow batch's counts are sums of whole old bins: re-histogramming it alone on
    # the new grid must give the same counts (nothing was spread across bins).
    narrow_on_new = np.histogram(narrow, bins=hist.edges())[0]
    wide_on_new = np.histogram(wide, bins=hist.edges())[0]
    np.testing.assert_array_equal(hist.counts, narrow_on_new + wide_on_new)
    assert narrow_on_new.sum() == before.sum()


@pytest.mark.parametrize("first", [np.zeros(100), np.full(50, 3.5), np.full(10, -2e-7)])
def test_constant_first_batch_gets_tiny_width_then_widens(first: np.ndarray) -> None:
    rng = np.random.default_rng(3)
    later = rng.normal(size=5000)
    hist = StreamingHistogram(N_BINS)
    hist.update(first)
    assert hist.bin_width > 0 and hist.total == first.size
    assert hist.bin_width <= max(abs(first[0]), 1e-300) * 2.0**-30 or first[0] == 0
    edges = hist.edges()
    assert edges[0] <= first[0] < edges[-1]
    hist.update(later)
    assert hist.total == first.size + later.size
    both = np.concatenate([first, later])
    np.testing.assert_array_equal(hist.counts, np.histogram(both, bins=hist.edges())[0])
    _same(hist, _fill(both, False, batches=1))


def test_non_finite_values_are_ignored() -> None:
    hist = StreamingHistogram(N_BINS)
    hist.update(np.array([np.nan, np.inf, -np.inf]))
    assert hist.is_empty and hist.total == 0 and hist.percentile(50) == 0.0
    hist.update(np.array([[1.0, np.nan], [-np.inf, 2.0]], dtype=np.float32))
    assert hist.total == 2 and (hist.min, hist.max) == (1.0, 2.0)


def test_state_size_is_independent_of_samples() -> None:
    hist = StreamingHistogram(512, symmetric=True)
    rng = np.random.default_rng(0)
    for scale in (1.0, 10.0, 100.0, 1e4):
        hist.update(rng.normal(0, scale, size=(8, 3, 50)))
        assert hist.counts.shape == (512,)
    assert hist.total == 4 * 8 * 3 * 50


def test_extreme_magnitudes_stay_exact() -> None:
    data = np.array([1e-300, -5e-310, 1e300, -1e299, 0.0, 1.0])
    hist = StreamingHistogram(N_BINS)
    for value in data:
        hist.update(np.array([value]))
    np.testing.assert_array_equal(hist.counts, np.histogram(data, bins=hist.edges())[0])
    assert hist.total == data.size


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("name", ["normal", "student_t", "relu", "outliers", "shifted"])
def test_percentile_within_one_bin_of_numpy(name: str, symmetric: bool) -> None:
    data = STREAMS[name]
    ref = np.abs(data) if symmetric else data
    hist = _fill(data, symmetric)
    w = hist.bin_width
    for p in (0.1, 1.0, 25.0, 50.0, 90.0, 99.0, 99.9, 99.999):
        got = hist.percentile(p)
        # Same bin as the inverted-CDF order statistic: within one bin width.
        assert abs(got - np.percentile(ref, p, method="inverted_cdf")) <= w * (1 + 1e-9)
        if 1.0 <= p <= 99.0:  # dense region: also close to numpy's default (linear)
            assert abs(got - np.percentile(ref, p)) <= w * (1 + 1e-9)
    assert hist.percentile(100.0) == ref.max()
    assert hist.percentile(0.0) == ref.min() or symmetric
