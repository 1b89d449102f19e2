"""The README's quick start runs as written, and the README stays short with working links.

The quick-start commands are read from the README itself (every line of the ```bash blocks
of its "Quick start" section) and run in a temporary directory holding a copy of models/,
so nothing is written into the repository. The README's Python API block runs there too.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# The quantized example's top-1 may lose at most this many points against float on the
# held-out images (it loses 0.2: 99.0% float, 98.8% quantized, in a default session).
TOP1_MARGIN = 1.0
# What .ci/run does: the README must show these as separate lines of the quick start.
CI_LINES = ("python3 -m venv .venv", ". .venv/bin/activate", 'pip install -e ".[test]"', "python -m pytest -q")
# Not run here: creating and activating a virtual environment and installing into it is
# what the environment running this test already did (and would need the network), and
# the test-running line would run this very suite again. The other commands run with the
# current interpreter's environment, `onnxq` on PATH from it.
NOT_RUN = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def section(text: str, title: str) -> str:
    """The body of the `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def blocks(text: str, lang: str) -> list[str]:
    return [body for fence, body in FENCE.findall(text) if fence == lang]


def commands(block: str) -> list[str]:
    """One command per line; a trailing backslash continues it; comments and blanks skipped."""
    out, pending = [], ""
    for line in block.splitlines():
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def quick_start() -> list[str]:
    return [c for block in blocks(section(README.read_text(), "Quick start"), "bash") for c in commands(block)]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "models", tmp_path / "models")
    return tmp_path


def environment(tmp_path: Path) -> dict[str, str]:
    """This interpreter's environment with this checkout's onnxq first on the path and the
    `onnxq` script on PATH (a stand-in that runs `python -m onnxq` where none is installed)."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "onnxq").exists():
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        script = bin_dir / "onnxq"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m onnxq "$@"\n')
        script.chmod(0o755)
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PATH=str(bin_dir) + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=path)


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=environment(cwd), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def positionals(command: str, subcommand: str) -> list[str]:
    """The two paths after `onnxq SUBCOMMAND` (input and output, or float and quantized)."""
    words = shlex.split(command)
    at = words.index(subcommand)
    return words[at + 1:at + 3]


def test_quick_start_shows_the_ci_commands_as_separate_lines():
    lines = quick_start()
    for line in CI_LINES:
        assert line in lines, f"the quick start must show `{line}` on a line of its own (.ci/run runs it)"


def test_quick_start_runs_and_the_quantized_model_keeps_its_accuracy(workdir: Path):
    to_run = [c for c in quick_start() if not c.startswith(NOT_RUN)]
    quantize = [c for c in to_run if c.startswith("onnxq quantize ")]
    compare = [c for c in to_run if c.startswith("onnxq compare ")]
    assert len(quantize) == 1 and len(compare) == 1, to_run
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "models").iterdir()}
    outputs = {c: run(["bash", "-c", c], workdir).stdout for c in to_run}
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "models").iterdir()} == before, "wrote into the repo"

    model_in, model_out = positionals(quantize[0], "quantize")
    assert model_in == "models/digits_cnn.onnx"
    quantized = workdir / model_out
    onnx.checker.check_model(str(quantized), full_check=True)
    assert any(n.op_type == "DequantizeLinear" for n in onnx.load(str(quantized)).graph.node)
    assert positionals(compare[0], "compare") == [model_in, model_out]

    found = re.search(r"top-1 accuracy: float ([\d.]+)%, quantized ([\d.]+)%", outputs[compare[0]])
    assert found, outputs[compare[0]]
    float_top1, quantized_top1 = (float(v) for v in found.groups())
    assert float_top1 > 90
    assert quantized_top1 >= float_top1 - TOP1_MARGIN, (float_top1, quantized_top1)


def test_python_api_runs(workdir: Path):
    (code,) = blocks(section(README.read_text(), "Python API"), "python")
    run([sys.executable, "-c", code], workdir)
    written = [p for p in re.findall(r'"([\w/.-]+\.onnx)"', code) if p != "models/digits_cnn.onnx"]
    assert written
    for path in written:
        onnx.checker.check_model(str(workdir / path))


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_LINES, f"README.md has {len(lines)} lines; reference material goes to docs/"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def local_links(path: Path) -> list[tuple[Path, str]]:
    text = FENCE.sub("", path.read_text())
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve() if file else path, anchor))
    return out


PAGES = [README, ROOT / "models" / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_existing_files_and_headings(page: Path):
    for target, anchor in local_links(page):
        assert target.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.name} links to {target.name}#{anchor}: no such heading"


def test_readme_links_every_docs_page():
    linked = {target for target, _ in local_links(README)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.resolve() in linked, f"README.md does not link docs/{page.name}"
