"""onnxq's cache on disk (`onnxq/cache.py`): the CPU kernel probe's answers are read back in a
new process instead of probed again, and a cache that is damaged or unwritable is skipped."""

from __future__ import annotations

import pytest

from onnxq import cache
from onnxq.target import probe


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and no answers held in this process."""
    monkeypatch.setenv("ONNXQ_CACHE_DIR", str(tmp_path / "cache"))
    for held in (probe.saturating_kernels, probe.wrong_kernels, probe._machine_key):
        held.cache_clear()
    if probe._machine_key() is None:
        pytest.skip("this CPU shows no feature flags (/proc/cpuinfo): the probe is not cached here")
    probe._machine_key.cache_clear()  # a test may change what the key reads
    yield tmp_path / "cache" / probe.CACHE_KIND
    for held in (probe.saturating_kernels, probe.wrong_kernels, probe._machine_key):
        held.cache_clear()


def _probes_counted(monkeypatch) -> list[int]:
    calls = [0]
    real = probe._saturates

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(probe, "_saturates", counted)
    return calls


def test_the_probe_answers_once_per_machine_and_a_new_process_reads_them(fresh, monkeypatch):
    calls = _probes_counted(monkeypatch)
    saturating, wrong = probe.saturating_kernels(), probe.wrong_kernels()
    assert calls[0] == 7  # five kernels for saturation, two for wrong results
    assert len(list(fresh.glob("*.json"))) == 2
    # a new process: nothing held in memory, the kernels not run again, the same answers
    probe.saturating_kernels.cache_clear()
    probe.wrong_kernels.cache_clear()
    assert probe.saturating_kernels() == saturating and probe.wrong_kernels() == wrong
    assert calls[0] == 7
    assert all(isinstance(pair, tuple) and len(pair) == 2 for pair in saturating)


@pytest.mark.parametrize("content", ["{not json", '{"kind": "saturating", "found": [[1, 2]]}', "[]", "[" * 100000,
                                     '{"kind": "saturating", "found": ' + "[" * 3000 + "]" * 3000 + "}"])
def test_a_damaged_entry_is_probed_again_and_replaced(fresh, monkeypatch, content):
    expected = probe.saturating_kernels()
    (entry,) = [p for p in fresh.glob("*.json") if cache.read(probe.CACHE_KIND, p.stem)["kind"] == "saturating"]
    entry.write_text(content)
    probe.saturating_kernels.cache_clear()
    calls = _probes_counted(monkeypatch)
    assert probe.saturating_kernels() == expected
    assert calls[0] == 5
    assert cache.read(probe.CACHE_KIND, entry.stem)["kind"] == "saturating"


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("ONNXQ_CACHE_DIR", str(blocker))
    probe.saturating_kernels.cache_clear()
    calls = _probes_counted(monkeypatch)
    try:
        first = probe.saturating_kernels()
        probe.saturating_kernels.cache_clear()
        assert probe.saturating_kernels() == first  # probed again, the same answer
    finally:
        probe.saturating_kernels.cache_clear()
    assert calls[0] == 10  # five kernels, twice: nothing was stored
    assert blocker.read_text().startswith("a file")


def test_an_entry_naming_an_unknown_kernel_is_probed_again(fresh, monkeypatch):
    expected = probe.wrong_kernels()
    (entry,) = [p for p in fresh.glob("*.json") if cache.read(probe.CACHE_KIND, p.stem)["kind"] == "wrong"]
    entry.write_text('{"kind": "wrong", "found": ["everything"]}')
    probe.wrong_kernels.cache_clear()
    calls = _probes_counted(monkeypatch)
    assert probe.wrong_kernels() == expected and calls[0] == 2


def test_a_cpu_without_feature_flags_is_not_cached(fresh, monkeypatch):
    """Without flags two CPUs of one architecture and core count would share an entry."""
    monkeypatch.setattr(cache, "cpu_fingerprint", lambda: "x86_64 2")
    probe.saturating_kernels()
    assert not fresh.exists() or not list(fresh.glob("*.json"))
