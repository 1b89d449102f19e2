"""Shared pytest configuration for the onnxq test suite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# `from helpers import ...` works under every --import-mode.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a test that takes more than a minute (still run by default)"
    )


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    """The suite's own onnxq cache (`onnxq/cache.py`): the tests probe this machine's
    kernels themselves, not read what an earlier run left in ~/.cache/onnxq."""
    previous = os.environ.get("ONNXQ_CACHE_DIR")
    os.environ["ONNXQ_CACHE_DIR"] = str(tmp_path_factory.mktemp("onnxq_cache"))
    yield
    if previous is None:
        os.environ.pop("ONNXQ_CACHE_DIR", None)
    else:
        os.environ["ONNXQ_CACHE_DIR"] = previous
