"""pytest plugin: record a digest of every quantized model the suite builds, so that a
refactor can show it changes no output (with `benchmarks/digests.py` for the shared models).

    PYTHONPATH=benchmarks ONNXQ_DIGESTS=before.tsv python -m pytest -q -p digest_plugin   # old commit
    PYTHONPATH=benchmarks ONNXQ_DIGESTS=after.tsv python -m pytest -q -p digest_plugin    # new commit
    python benchmarks/compare_digests.py before.tsv after.tsv

Wraps QuantizationResult's constructor (the one object every pipeline run returns), so
the digests follow the class wherever a refactor moves it. One line per result:
test id, index within the test, sha256 of the serialized model, sha256 of the notes.
"""
import hashlib
import os

import pytest

_current = {"id": None, "n": 0}
_rows = []


def pytest_configure(config):
    if not os.environ.get("ONNXQ_DIGESTS"):
        return
    import onnx_ir as ir

    import onnxq

    cls = onnxq.QuantizationResult
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            data = ir.to_proto(self.ir_model).SerializeToString(deterministic=True)
            model = hashlib.sha256(data).hexdigest()[:16]
        except Exception as e:  # noqa: BLE001  a result that cannot serialize is recorded as such
            model = f"error:{type(e).__name__}"
        notes = getattr(self.summary, "notes", [])
        text = "\n".join(str(n) for n in notes)
        _rows.append((_current["id"], _current["n"], model, hashlib.sha256(text.encode()).hexdigest()[:16]))
        _current["n"] += 1

    cls.__init__ = __init__


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current["id"], _current["n"] = item.nodeid, 0
    yield


def pytest_unconfigure(config):
    path = os.environ.get("ONNXQ_DIGESTS")
    if path:
        with open(path, "w") as f:
            for row in _rows:
                f.write("\t".join(str(x) for x in row) + "\n")
