"""Calibration observers against direct numpy computations on the whole data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from onnxq.calibrate.observers import (
    OBSERVERS,
    Observer,
    make_observer,
    observer_options,
    register_observer,
)
from onnxq.calibrate.observers.entropy import entropy_threshold
from onnxq.calibrate.observers.hfmg import HfmgOptions
from onnxq.calibrate.observers.ifmr import IfmrOptions
from onnxq.config.resolve import ResolvedSpec, merge_specs
from onnxq.config.spec import CalibMethod, DType, QuantizationSpec, ScaleType
from onnxq.errors import ConfigError
from onnxq.numerics import qmath

METHODS = [m.value for m in CalibMethod]
N = 40_000


def spec(method: str, **fields: Any) -> ResolvedSpec:
    """A fully resolved spec, through the real resolver."""
    resolved = merge_specs([QuantizationSpec(calib_method=CalibMethod(method), **fields)])
    assert resolved is not None
    return resolved


def _data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2024)
    return {
        "normal": rng.normal(0.0, 1.5, N),
        "student_t": rng.standard_t(3, N),
        "laplace": rng.laplace(0.0, 1.0, N),
        "relu": np.maximum(rng.normal(0.3, 1.0, N), 0.0),
        "outliers": np.concatenate([rng.normal(0.0, 1.0, N - 4), [60.0, -45.0, 38.0, 51.0]]),
    }


DATA = _data()
HEAVY = ["student_t", "laplace", "outliers"]


def observe(s: ResolvedSpec, x: np.ndarray, batches: int = 50) -> Observer:
    obs = make_observer(s)
    for batch in np.array_split(x, batches):
        obs.update(batch.reshape(-1, 4) if batch.size % 4 == 0 else batch)
    return obs


def quant_mse(x: np.ndarray, rng_: tuple[float, float], s: ResolvedSpec) -> float:
    """Real quantization MSE of x with the qparams the emitter derives from the range."""
    scale, zp = qmath.compute_qparams(rng_[0], rng_[1], s.dtype, s.symmetric, s.scale_type)
    deq = qmath.dequantize(qmath.quantize(x, scale, zp, s.dtype), scale, zp)
    return float(np.mean((deq.astype(np.float64) - x) ** 2))


def best_mse_on_grid(
    x: np.ndarray, s: ResolvedSpec, candidates: list[tuple[float, float]]
) -> float:
    return min(quant_mse(x, c, s) for c in candidates)


def is_pow2(v: float) -> bool:
    return v > 0 and v == 2.0 ** round(math.log2(v))


def bin_width(obs: Observer) -> float:
    return obs.hist.bin_width  # type: ignore[attr-defined]


# --- registry and options -----------------------------------------------------------------


def test_every_calib_method_is_registered() -> None:
    assert sorted(OBSERVERS) == sorted(METHODS)
    for method in METHODS:
        obs = make_observer(spec(method))
        assert isinstance(obs, Observer) and type(obs).name == method


def test_unknown_method_names_the_valid_ones() -> None:
    bad = spec("minmax")
    bad = ResolvedSpec(**{**bad.__dict__, "calib_method": "kl"})
    with pytest.raises(ConfigError, match="unknown calib method 'kl'.*entropy.*minmse"):
        make_observer(bad)
    with pytest.raises(ConfigError, match="valid methods"):
        observer_options("nope")


def test_registering_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_observer("minmax")(type("Other", (Observer,), {}))


def test_options_classes() -> None:
    assert observer_options("ifmr") is IfmrOptions
    assert observer_options("hfmg") is HfmgOptions
    assert observer_options("minmax") is None
    assert observer_options(CalibMethod.ENTROPY) is None


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        (
            "ifmr",
            {"max_percentil": 0.99},
            "unknown calib option 'max_percentil' for method 'ifmr'; did you mean 'max_percentile'",
        ),
        ("ifmr", {"zzz": 1}, "valid options: max_percentile, min_percentile"),
        ("hfmg", {"num_bins": 2048}, "did you mean 'num_of_bins'"),
        ("minmax", {"foo": 1}, "takes no options"),
        ("hfmg", {"num_of_bins": 1000}, "must be one of 1024, 2048, 4096, 8192"),
        ("hfmg", {"asymmetric": "yes"}, "must be true, false or null"),
        ("ifmr", {"max_percentile": 0.3}, r"must be in \(0.5, 1\]"),
        (
            "ifmr",
            {"search_range_start": 1.5, "search_range_end": 1.0},
            "search_range_start <= search_range_end",
        ),
        ("ifmr", {"search_step": 0.0}, "search_step"),
        ("ifmr", {"search_step": "a"}, "must be a number"),
    ],
)
def test_bad_options_raise_config_error(method: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_observer(spec(method, calib_options=options))


def test_bad_percentile_raises_config_error() -> None:
    with pytest.raises(ConfigError, match=r"invalid percentile 20.0; use a percent in \[50, 100\]"):
        make_observer(spec("percentile", percentile=20.0))


# --- behaviour shared by every method -------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_no_finite_data_gives_zero_range(method: str) -> None:
    obs = make_observer(spec(method))
    assert obs.compute_range() == (0.0, 0.0)
    obs.update(np.array([np.nan, np.inf, -np.inf], dtype=np.float32))
    assert obs.num_values == 0
    assert obs.compute_range() == (0.0, 0.0)


@pytest.mark.parametrize("method", METHODS)
def test_non_finite_values_are_ignored(method: str) -> None:
    x = DATA["student_t"][:5000]
    dirty = x.copy()
    dirty[::97] = np.nan
    dirty[5::101] = np.inf
    dirty[7::103] = -np.inf
    clean = dirty[np.isfinite(dirty)]
    s = spec(method, symmetric=False)
    a, b = observe(s, dirty, 5), observe(s, clean, 5)
    assert a.num_values == b.num_values == clean.size
    assert a.compute_range() == b.compute_range()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("method", METHODS)
def test_streaming_and_merging_match_one_shot_exactly(method: str, symmetric: bool) -> None:
    x = DATA["outliers"]
    s = spec(method, symmetric=symmetric)
    whole = observe(s, x, batches=1)
    streamed = observe(s, x, batches=50)
    assert streamed.compute_range() == whole.compute_range()
    first, second = observe(s, x[: N // 3], 20), observe(s, x[N // 3 :], 30)
    first.merge(second)
    assert first.num_values == whole.num_values == x.size
    assert first.compute_range() == whole.compute_range()
    rmin, rmax = whole.compute_range()
    assert rmin <= rmax
    if symmetric:
        assert rmin == -rmax


@pytest.mark.parametrize("method", METHODS)
def test_merge_refuses_other_kinds(method: str) -> None:
    obs = make_observer(spec(method))
    other = "minmax" if method != "minmax" else "percentile"
    with pytest.raises(TypeError):
        obs.merge(make_observer(spec(other)))
    with pytest.raises(TypeError):
        obs.merge(make_observer(spec(method, dtype=DType.UINT8)))


@pytest.mark.parametrize("method", ["percentile", "minmse", "entropy", "ifmr", "hfmg"])
def test_state_does_not_grow_with_data(method: str) -> None:
    obs = observe(spec(method), DATA["normal"], batches=10)
    size = obs.hist.counts.size  # type: ignore[attr-defined]
    for _ in range(5):
        obs.update(DATA["student_t"])
    assert obs.hist.counts.size == size  # type: ignore[attr-defined]


# --- minmax ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATA))
def test_minmax_is_the_exact_min_and_max(name: str) -> None:
    x = DATA[name]
    assert observe(spec("minmax", symmetric=False), x).compute_range() == (x.min(), x.max())
    a = np.abs(x).max()
    assert observe(spec("minmax"), x).compute_range() == (-a, a)


# --- percentile ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATA))
def test_percentile_matches_numpy_within_one_bin(name: str) -> None:
    x = DATA[name]
    for p in (99.0, 99.9, 99.99):
        sym = observe(spec("percentile", percentile=p), x)
        _, a = sym.compute_range()
        ref = np.percentile(np.abs(x), p, method="inverted_cdf")
        assert abs(a - ref) <= bin_width(sym) * (1 + 1e-9)
        asym = observe(spec("percentile", percentile=p, symmetric=False), x)
        lo, hi = asym.compute_range()
        w = bin_width(asym) * (1 + 1e-9)
        assert abs(hi - np.percentile(x, p, method="inverted_cdf")) <= w
        assert abs(lo - np.percentile(x, 100 - p, method="inverted_cdf")) <= w
        if p == 99.0:  # dense region: also numpy's default linear interpolation
            assert abs(a - np.percentile(np.abs(x), p)) <= bin_width(sym)


# --- minmse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATA))
def test_minmse_symmetric_matches_a_brute_force_search_on_the_data(name: str) -> None:
    x = DATA[name]
    s = spec("minmse")
    got = observe(s, x).compute_range()
    amax = np.abs(x).max()
    ref = best_mse_on_grid(x, s, [(-a, a) for a in amax * np.arange(1, 201) / 200])
    assert quant_mse(x, got, s) <= ref * 1.005
    assert quant_mse(x, got, s) <= quant_mse(x, (-amax, amax), s)


@pytest.mark.parametrize("name", HEAVY)
def test_minmse_beats_minmax_on_heavy_tails(name: str) -> None:
    x = DATA[name]
    for symmetric in (True, False):
        dtype = DType.INT8 if symmetric else DType.UINT8
        s = spec("minmse", symmetric=symmetric, dtype=dtype)
        got = observe(s, x).compute_range()
        mm = observe(spec("minmax", symmetric=symmetric, dtype=dtype), x).compute_range()
        assert got[1] - got[0] < 0.95 * (mm[1] - mm[0])
        assert quant_mse(x, got, s) < 0.95 * quant_mse(x, mm, s)


@pytest.mark.parametrize("name", ["student_t", "relu", "outliers"])
def test_minmse_asymmetric_matches_a_brute_force_search(name: str) -> None:
    x = DATA[name]
    s = spec("minmse", symmetric=False, dtype=DType.UINT8)
    got = observe(s, x).compute_range()
    lo, hi = min(x.min(), 0.0), x.max()
    grid = np.arange(1, 41) / 40
    ref = best_mse_on_grid(x, s, [(lo * f, hi * g) for f in grid for g in grid])
    assert quant_mse(x, got, s) <= ref * 1.005
    if name == "relu":
        assert got[0] == 0.0


def test_minmse_uses_the_bit_width_of_the_dtype() -> None:
    x = DATA["student_t"]
    amax = np.abs(x).max()
    _, a8 = observe(spec("minmse", dtype=DType.INT8), x).compute_range()
    wide = observe(spec("minmse", dtype=DType.INT32), x)
    _, a32 = wide.compute_range()
    assert a8 < 0.9 * amax
    assert a32 >= amax - bin_width(wide)  # 32-bit: rounding noise is negligible, no clipping


@pytest.mark.parametrize("name", sorted(DATA))
def test_minmse_power_of_two_ranges(name: str) -> None:
    x = DATA[name]
    s = spec("minmse", scale_type=ScaleType.POWER_OF_TWO)
    lo, hi = observe(s, x).compute_range()
    d = qmath.symmetric_divisor(qmath.int_type(s.dtype))
    assert lo == -hi and is_pow2(hi / d)
    ks = range(-12, 8)
    ref = best_mse_on_grid(x, s, [(-(2.0**k) * d, 2.0**k * d) for k in ks])
    # |x| folding models the extra negative level of signed types as clipping: ~3%.
    assert quant_mse(x, (lo, hi), s) == pytest.approx(ref, rel=0.03)

    sa = spec("minmse", scale_type=ScaleType.POWER_OF_TWO, symmetric=False, dtype=DType.UINT8)
    lo, hi = observe(sa, x).compute_range()
    scale, zp = qmath.compute_qparams(lo, hi, sa.dtype, False, "float32")
    assert is_pow2(float(scale))
    assert (lo, hi) == (float(scale) * (0 - int(zp)), float(scale) * (255 - int(zp)))
    assert quant_mse(x, (lo, hi), sa) <= quant_mse(x, (x.min(), x.max()), sa)


# --- entropy ----------------------------------------------------------------------------------


def _reference_entropy(counts: np.ndarray, edges: np.ndarray, levels: int) -> float:
    """Loop-by-loop TensorRT/MXNet KL threshold search (every candidate, no vectorising)."""
    counts = counts.astype(np.float64).copy()
    counts[0] = counts[1]
    end = int(np.flatnonzero(counts)[-1]) + 1
    best, best_kl = end, np.inf
    for i in range(levels, end + 1):
        p = counts[:i].copy()
        p[-1] += counts[i:].sum()
        q = np.zeros(i)
        size = i // levels
        for j in range(levels):
            a, b = j * size, (i if j == levels - 1 else (j + 1) * size)
            nz = p[a:b] != 0
            if nz.any():
                q[a:b][nz] = counts[a:b].sum() / nz.sum()

        def smooth(v: np.ndarray) -> np.ndarray:
            zeros = v == 0
            return v + 1e-4 * zeros - 1e-4 * zeros.sum() / (~zeros).sum() * ~zeros

        ps, qs = np.maximum(smooth(p), 1e-12), np.maximum(smooth(q), 1e-12)
        ps, qs = ps / ps.sum(), qs / qs.sum()
        kl = float(np.sum(ps * np.log(ps / qs)))
        if kl <= best_kl:
            best, best_kl = i, kl
    return float(edges[best])


@pytest.mark.parametrize("name", ["student_t", "outliers", "relu"])
def test_entropy_matches_a_loop_reference(name: str) -> None:
    x = DATA[name]
    obs = observe(spec("entropy", num_bins=512), x)
    hist = obs.hist  # type: ignore[attr-defined]
    ref = _reference_entropy(hist.counts, hist.edges(), 128)
    assert entropy_threshold(hist.counts, hist.edges(), 128) == ref
    assert obs.compute_range() == (-min(ref, hist.max), min(ref, hist.max))


@pytest.mark.parametrize("name", HEAVY)
def test_entropy_threshold_is_below_max_on_heavy_tails(name: str) -> None:
    x = DATA[name]
    _, t = observe(spec("entropy"), x).compute_range()
    amax = np.abs(x).max()
    assert np.percentile(np.abs(x), 99) < t < 0.75 * amax


def test_entropy_keeps_the_range_of_data_without_tails() -> None:
    x = np.random.default_rng(5).uniform(-3.0, 3.0, N)
    _, t = observe(spec("entropy"), x).compute_range()
    assert t >= 0.97 * np.abs(x).max()


def test_entropy_asymmetric_spec() -> None:
    x = DATA["relu"]
    lo, hi = observe(spec("entropy", symmetric=False, dtype=DType.UINT8), x).compute_range()
    assert lo == 0.0 and np.percentile(x, 99) < hi <= x.max()
    x = DATA["student_t"]
    lo, hi = observe(spec("entropy", symmetric=False), x).compute_range()
    _, t = observe(spec("entropy"), x).compute_range()
    assert (lo, hi) == (max(x.min(), -t), min(x.max(), t))


# --- nonoverflow ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [DType.INT8, DType.UINT8, DType.INT32])
@pytest.mark.parametrize("name", sorted(DATA))
def test_nonoverflow_symmetric_is_the_smallest_covering_power_of_two(
    name: str, dtype: DType
) -> None:
    x = DATA[name] * 3.7
    s = spec("nonoverflow", dtype=dtype)
    lo, hi = observe(s, x).compute_range()
    d = qmath.symmetric_divisor(qmath.int_type(dtype))
    amax = np.abs(x).max()
    assert lo == -hi and is_pow2(hi / d)
    assert hi >= amax and hi / 2 < amax
    scale, zp = qmath.compute_qparams(lo, hi, dtype, True)
    assert float(scale) == hi / d
    q = qmath.quantize(x, scale, zp, dtype).astype(np.int64) - int(zp)
    assert np.abs(q).max() <= d  # nothing saturates


@pytest.mark.parametrize("name", sorted(DATA))
def test_nonoverflow_asymmetric_never_clips_and_is_minimal(name: str) -> None:
    x = DATA[name] + 0.7
    s = spec("nonoverflow", symmetric=False, dtype=DType.UINT8)
    lo, hi = observe(s, x).compute_range()
    scale, zp = qmath.compute_qparams(lo, hi, DType.UINT8, False)
    scale, zp = float(scale), int(zp)
    assert is_pow2(scale) and (lo, hi) == (scale * (0 - zp), scale * (255 - zp))
    assert lo <= x.min() and hi >= x.max()
    deq = qmath.dequantize(qmath.quantize(x, scale, zp, DType.UINT8), scale, zp)
    assert np.abs(deq - x).max() <= scale / 2 * (1 + 1e-6)
    half = scale / 2  # no zero point makes half the scale cover the data
    zmin, zmax = min(x.min(), 0), max(x.max(), 0)
    assert not any(half * (0 - z) <= zmin and half * (255 - z) >= zmax for z in range(256))
    if x.min() >= 0:
        assert zp == 0


# --- ifmr -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DATA))
def test_ifmr_matches_the_search_on_the_data(name: str) -> None:
    x = DATA[name]
    s = spec("ifmr")
    obs = observe(s, x)
    lo, hi = obs.compute_range()
    a0 = np.percentile(np.abs(x), 99.9999, method="inverted_cdf")
    factors = 0.7 + 0.01 * np.arange(61)
    ref = best_mse_on_grid(x, s, [(-a0 * f, a0 * f) for f in factors])
    assert lo == -hi
    # The clip is one of the factors times a start point within one bin of numpy's a0.
    start = obs.hist.percentile(99.9999)  # type: ignore[attr-defined]
    assert abs(start - a0) <= bin_width(obs)
    assert np.isclose(hi / start, factors, rtol=1e-9, atol=0).any()
    assert quant_mse(x, (lo, hi), s) <= ref * 1.01


@pytest.mark.parametrize("name", ["student_t", "relu", "outliers"])
def test_ifmr_asymmetric(name: str) -> None:
    x = DATA[name]
    opts = {"max_percentile": 0.9999, "min_percentile": 0.999}
    s = spec("ifmr", symmetric=False, dtype=DType.UINT8, calib_options=opts)
    lo, hi = observe(s, x).compute_range()
    hi0, lo0 = np.percentile(x, [99.99, 0.1], method="inverted_cdf")
    factors = 0.7 + 0.01 * np.arange(61)
    ref = best_mse_on_grid(x, s, [(lo0 * f, hi0 * f) for f in factors])
    assert quant_mse(x, (lo, hi), s) <= ref * 1.01
    # Default percentiles start at (about) the data range: never worse than min/max.
    s = spec("ifmr", symmetric=False, dtype=DType.UINT8)
    got = observe(s, x).compute_range()
    assert quant_mse(x, got, s) <= quant_mse(x, (x.min(), x.max()), s)


def test_ifmr_degenerate_search_returns_the_percentile() -> None:
    x = DATA["laplace"]
    opts = {"search_range_start": 1.0, "search_range_end": 1.0, "max_percentile": 0.99}
    obs = observe(spec("ifmr", calib_options=opts), x)
    _, a = obs.compute_range()
    assert abs(a - np.percentile(np.abs(x), 99, method="inverted_cdf")) <= bin_width(obs)


def test_ifmr_asymmetric_option_overrides_the_spec() -> None:
    x = DATA["relu"]
    obs = observe(spec("ifmr", symmetric=True, calib_options={"asymmetric": True}), x)
    assert obs.hist.symmetric is False  # type: ignore[attr-defined]
    lo, hi = obs.compute_range()
    assert lo == -hi  # a symmetric spec still gets a symmetric range


# --- hfmg -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HEAVY + ["relu"])
def test_hfmg_is_close_to_the_best_range(name: str) -> None:
    x = DATA[name]
    for symmetric, dtype in ((True, DType.INT8), (False, DType.UINT8)):
        s = spec("hfmg", symmetric=symmetric, dtype=dtype)
        got = observe(s, x).compute_range()
        lo, hi = (-np.abs(x).max(), np.abs(x).max()) if symmetric else (min(x.min(), 0), x.max())
        assert lo <= got[0] <= got[1] <= hi
        ref = observe(spec("minmse", symmetric=symmetric, dtype=dtype), x).compute_range()
        assert quant_mse(x, got, s) <= 1.05 * quant_mse(x, ref, s)
        if name != "relu":
            assert quant_mse(x, got, s) < 0.97 * quant_mse(x, (lo, hi), s)


def test_hfmg_uses_its_own_bin_count() -> None:
    obs = observe(spec("hfmg", num_bins=512, calib_options={"num_of_bins": 1024}), DATA["normal"])
    assert obs.hist.num_bins == 1024  # type: ignore[attr-defined]
    assert make_observer(spec("hfmg")).hist.num_bins == 4096  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields", [{}, {"scale_type": ScaleType.POWER_OF_TWO}, {"symmetric": False}])
def test_minmse_on_an_all_zero_tensor_is_silent(fields):
    """Over 2^24 zeros (a zero-initialised block's output) overflowed the error model's
    density (counts / a 2^-1000 bin width) and leaked numpy's RuntimeWarning (preset sweep:
    mobilevit_xxs under XINT8); the range is (0, 0) either way."""
    import warnings

    obs = make_observer(spec("minmse", **fields))
    zeros = np.zeros(1 << 20, np.float32)
    for _ in range(17):
        obs.update(zeros)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert obs.compute_range() == (0.0, 0.0)
