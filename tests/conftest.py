"""Shared pytest configuration for the onnxq test suite."""

from __future__ import annotations

import sys
from pathlib import Path

# `from helpers import ...` works under every --import-mode.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a test that takes more than a minute (still run by default)"
    )
