"""A new observer is one class and one `register_observer` line: no enum or package edit.

The toy observer below calibrates to half of each tensor's largest magnitude (a crude
clipping rule). The test checks the quantizer really used it: the emitted activation
scales are exactly what its range gives, from a Python config, a dict (YAML/JSON) config
and the CLI's `--calib-method`; misspelled names are one-line errors naming the nearest.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import GraphBuilder, initializers, random_feeds, save

import onnxq
from onnxq.calibrate.observers import OBSERVERS, Observer, register_observer
from onnxq.cli import main
from onnxq.config import config_from_dict, get_preset
from onnxq.config.compose import compose_config
from onnxq.errors import ConfigError
from onnxq.numerics.qmath import compute_qparams


class HalfMaxObserver(Observer):
    """Range [0, max|x| / 2] for uint8 (symmetric specs: +-max|x| / 2)."""

    integer_only = False

    def __init__(self, spec):
        super().__init__(spec)
        self.absmax, self.count = 0.0, 0

    def update(self, x: np.ndarray) -> None:
        self.absmax = max(self.absmax, float(np.abs(x).max(initial=0.0)))
        self.count += x.size

    def _merge(self, other: Observer) -> None:
        self.absmax = max(self.absmax, other.absmax)
        self.count += other.count

    @property
    def num_values(self) -> int:
        return self.count

    def compute_range(self) -> tuple[float, float]:
        half = self.absmax / 2
        return -half, half


@pytest.fixture
def toy():
    register_observer("halfmax_toy")(HalfMaxObserver)
    yield "halfmax_toy"
    OBSERVERS.pop("halfmax_toy", None)


def model_and_data():
    b = GraphBuilder(3)
    x = b.input("x", ["N", 4, 6, 6])
    model = b.build([b.relu(b.conv(x, 4, 8))], name="toy_observer")
    return model, random_feeds(model, 6, seed=1)


def input_scale(model) -> float:
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    return float(initializers(model)[q.input[1]])


def expected_scale(feeds) -> float:
    absmax = max(float(np.abs(f["x"]).max()) for f in feeds)
    scale, _ = compute_qparams(-absmax / 2, absmax / 2, "uint8", False)
    return float(scale)


def test_registered_observer_calibrates_from_python_and_dict_configs(toy):
    model, feeds = model_and_data()
    config = get_preset("U8S8")
    config.global_quant_config.input_tensors.calib_method = toy
    config.global_quant_config.output_tensors.calib_method = toy
    by_python = onnxq.quantize(model, None, config, feeds).model
    assert input_scale(by_python) == pytest.approx(expected_scale(feeds), rel=1e-6)
    minmax = onnxq.quantize(model, None, "U8S8", feeds).model
    assert input_scale(minmax) > 1.9 * input_scale(by_python)  # the toy really clipped
    as_dict = compose_config("U8S8", None, {"global_quant_config": {
        "input_tensors": {"calib_method": toy}, "output_tensors": {"calib_method": toy}}})
    by_dict = onnxq.quantize(model, None, as_dict, feeds).model
    assert by_dict.SerializeToString() == by_python.SerializeToString()


def test_registered_observer_from_the_cli(toy, tmp_path):
    model, feeds = model_and_data()
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=np.concatenate([f["x"] for f in feeds]))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(src), str(out), "--calib-data", str(tmp_path / "calib.npz"),
                 "--calib-method", toy, "--quiet"]) == 0
    assert input_scale(onnx.load(str(out))) == pytest.approx(expected_scale(feeds), rel=1e-6)


def test_unknown_observer_names_the_nearest():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"global_quant_config": {"input_tensors": {"calib_method": "percentil"}}})
    message = str(err.value)
    assert "\n" not in message and "did you mean 'percentile'" in message and "register_observer" in message


def test_a_name_cannot_be_registered_twice(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_observer(toy)(type("Other", (HalfMaxObserver,), {}))


PLUGIN = '''
from onnxq.calibrate.observers import Observer, register_observer


@register_observer("halfmax_plugin")
class HalfMax(Observer):
    integer_only = False

    def __init__(self, spec):
        super().__init__(spec)
        self.absmax, self.count = 0.0, 0

    def update(self, x):
        self.absmax = max(self.absmax, float(abs(x).max(initial=0.0)))
        self.count += x.size

    def _merge(self, other):
        self.absmax, self.count = max(self.absmax, other.absmax), self.count + other.count

    @property
    def num_values(self):
        return self.count

    def compute_range(self):
        return -self.absmax / 2, self.absmax / 2

    def state(self):
        import numpy as np
        return {"absmax": np.float64(self.absmax), "count": np.int64(self.count)}

    def set_state(self, arrays):
        self.absmax, self.count = float(arrays["absmax"]), int(arrays["count"])
'''


def _cli_case(tmp_path):
    model, feeds = model_and_data()
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=np.concatenate([f["x"] for f in feeds]))
    (tmp_path / "halfmax_plugin.py").write_text(PLUGIN)
    return feeds, ["quantize", str(src), str(tmp_path / "q.onnx"), "--calib-data", str(tmp_path / "calib.npz"),
                   "--calib-method", "halfmax_plugin", "--quiet"]


def test_an_installed_cli_loads_an_observer_from_a_plugin_file(tmp_path):
    """A fresh `onnxq` process knows nothing of the user's observer until `--plugin` (or
    $ONNXQ_PLUGINS) imports the file that registers it."""
    import os
    import subprocess
    import sys

    feeds, argv = _cli_case(tmp_path)
    cli = [sys.executable, "-m", "onnxq.cli"]
    env = {k: v for k, v in os.environ.items() if k != "ONNXQ_PLUGINS"}
    without = subprocess.run(cli + argv, capture_output=True, text=True, env=env)
    assert without.returncode == 2 and "'halfmax_plugin'" in without.stderr and "--plugin FILE.py" in without.stderr
    plugin = str(tmp_path / "halfmax_plugin.py")
    for extra, environ in (([], {"ONNXQ_PLUGINS": plugin}), (["--plugin", plugin], {})):
        done = subprocess.run(cli + argv + extra, capture_output=True, text=True, env={**env, **environ})
        assert done.returncode == 0, done.stderr
        assert input_scale(onnx.load(str(tmp_path / "q.onnx"))) == pytest.approx(expected_scale(feeds), rel=1e-6)


def test_a_broken_plugin_is_one_line_and_exit_2(tmp_path, capsys):
    _, argv = _cli_case(tmp_path)
    (tmp_path / "broken.py").write_text("import numpy\nraise RuntimeError('bad plugin\\nsecond line')\n")
    for plugin, says in ((tmp_path / "broken.py", "failed to import: RuntimeError: bad plugin"),
                         (tmp_path / "missing.py", "no such file"), ("no_such_plugin_module", "no module of that name")):
        assert main(["--plugin", str(plugin)] + argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and not (tmp_path / "q.onnx").exists()


def test_calibration_shards_in_worker_processes_load_the_plugin(tmp_path):
    """`onnxq calibrate --shards 2` runs shards in fresh (spawned) processes: they import
    the plugins the command loaded, and the merged statistics quantize as one run does."""
    import subprocess
    import sys

    feeds, argv = _cli_case(tmp_path)
    plugin = str(tmp_path / "halfmax_plugin.py")
    cli = [sys.executable, "-m", "onnxq.cli", "--plugin", plugin]
    model, calib = argv[1], argv[4]
    done = subprocess.run(cli + ["calibrate", model, "--calib-data", calib, "--stats", str(tmp_path / "s.npz"),
                                 "--calib-method", "halfmax_plugin", "--shards", "2", "--batch-size", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(cli + ["quantize", model, str(tmp_path / "q.onnx"), "--stats", str(tmp_path / "s.npz"),
                                 "--calib-method", "halfmax_plugin", "--batch-size", "2", "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert input_scale(onnx.load(str(tmp_path / "q.onnx"))) == pytest.approx(expected_scale(feeds), rel=1e-6)
