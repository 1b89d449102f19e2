"""A self-contained HTML report: settings, summary, per-output, per-layer and per-tensor error,
range plots and the mixed-precision search, in one file that loads nothing from the network.

Every number in a table cell comes from the JSON embedded in the page
(`<script type="application/json" id="onnxq-data">`): the cell carries `data-key` (its path
in that JSON, e.g. `layers.3.own_sqnr_db`) and `data-value` (the JSON value), and shows
`format_value(key, value)`. Charts are inline SVG drawn by matplotlib (Agg, no pyplot).
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxq.analyze.analysis import Analysis, json_safe, tail_name
from onnxq.config.accuracy import parse_target
from onnxq.config.io import config_to_dict, config_to_yaml
from onnxq.errors import OnnxqError
from onnxq.graph.save import write_text_atomic
from onnxq.report import Summary, format_summary

if TYPE_CHECKING:
    from onnxq.config import Config

WORST_LAYERS = 30  # layers in the SQNR bar chart
WORST_TENSORS = 12  # tensors in the range plots
_COUNTS = {"samples", "promoted", "ranked_layers", "evaluations"}  # shown as integers
_DASH = "\u2014"
_HOWTO = (
    "How to read this report: SQNR is the signal-to-quantization-noise ratio in dB of the "
    "quantized values against the float ones; higher is better (each 6 dB halves the error, "
    "below about 20 dB a tensor is usually hurting accuracy) and cosine near 1 is good. "
    "<em>Alone</em> is the error a layer adds when only it is quantized; <em>with prefix</em> "
    "is its error with every earlier layer quantized too, so a large gap means error carried in "
    "from upstream. Layers are ranked worst first by the model's output SQNR with that layer "
    "alone quantized (<em>output dB</em>) where it was measured, the rest after them by their "
    "channels' noise. "
    "<em>Clipped</em> is the share of float values outside the calibrated range; in the range "
    "plots the red lines mark that range over the histogram of float values. "
    f"{_DASH} means no error at all (infinite SQNR) or not measured."
)
_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12px}.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:12px;margin:.6em 0}
th,td{border:1px solid #ddd;padding:2px 6px}th{background:#f0f0f0;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.name{overflow-wrap:anywhere;max-width:32em}figure{margin:1em 0}
figure svg{max-width:100%;height:auto}figcaption{font-size:12px;color:#555}
nav a{margin-right:1em}"""


def _threshold(target: str, float_score: float) -> float | None:
    """The score the target asks for, when it can be worked out."""
    try:
        return parse_target(target).threshold(float_score)
    except (OnnxqError, ValueError, TypeError):
        return None


def report_data(analysis: Analysis | None, summary: Summary | None,
                config: Config | None) -> dict[str, Any]:
    """The JSON embedded in the page: the analysis fields at the top level (`layers`,
    `tensors`, `outputs`, ...), then `summary`, `mixed_precision` and `config` (or null)."""
    data: dict[str, Any] = json_safe(analysis.to_dict()) if analysis is not None else {}
    data["summary"] = None if summary is None else json_safe(
        {f.name: getattr(summary, f.name) for f in dataclasses.fields(summary)
         if f.name != "mixed_precision"})
    mp = summary.mixed_precision if summary is not None else None
    data["mixed_precision"] = None if mp is None else json_safe(
        {f.name: getattr(mp, f.name) for f in dataclasses.fields(mp) if f.name != "config"}
        | {"threshold": _threshold(mp.target, mp.float_score)})
    data["config"] = None if config is None else json_safe(config_to_dict(config))
    return data


def format_value(key: str, value: Any) -> str:
    """How the page shows the JSON value at `key` (a dotted path): by field name, not by
    type, so 1.0 and 1 (the same JSON number to a browser) show alike."""
    name = next((p for p in reversed(key.split(".")) if not p.isdigit()), key)
    if value is None:
        return _DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.4g}" if v is not None else _DASH for v in value) + "]"
    if name.startswith("size"):
        return f"{value / 1e6:.2f} MB"
    if name in _COUNTS:
        return str(int(value))
    if name.endswith("_db"):
        return f"{value:.2f}"
    if "cosine" in name:
        return f"{value:.6f}"
    if name in ("saturation", "top1_agreement"):
        return f"{value:.2%}"
    if name.startswith("latency"):
        return f"{value:.3f} ms"
    if name == "seconds":
        return f"{value:.1f} s"
    return f"{value:.4g}"


def value_at(data: Any, key: str) -> Any:
    """The value at a dotted path such as `layers.3.own_sqnr_db`."""
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def _cell(data: dict[str, Any], key: str) -> str:
    value = value_at(data, key)
    kind = "name" if isinstance(value, str) else "num"
    shown = html.escape(format_value(key, value))
    return (f'<td class="{kind}" data-key="{html.escape(key)}" '
            f'data-value="{html.escape(json.dumps(value))}">{shown}</td>')


def _table(data: dict[str, Any], prefix: str, columns: list[tuple[str, str]]) -> str:
    """One row per item of the list at `prefix`; `columns` are (header, field)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in columns)
    rows = "".join("<tr>" + "".join(_cell(data, f"{prefix}.{i}.{f}") for _, f in columns) + "</tr>"
                   for i in range(len(value_at(data, prefix))))
    if not rows:
        return "<p>None.</p>"
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    return f'<div class="scroll">{table}</div>'


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure  # optional: the report extra
    except ImportError:
        raise OnnxqError("the HTML report needs matplotlib: pip install 'onnxq[report]'") from None
    return Figure


def _svg(fig: Any, prefix: str, tight: bool = True) -> str:
    """The figure as inline SVG with its ids made unique in the page and no metadata."""
    import matplotlib  # optional: the report extra (`_figure_class` said so if missing)

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "onnxq", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None},
                    bbox_inches="tight" if tight else None)
    text = buf.getvalue()
    text = re.sub(r"<metadata>.*?</metadata>", "", text[text.index("<svg"):], flags=re.S)
    return re.sub(r'(\bid="|url\(#|href="#)', lambda m: m.group(1) + prefix, text)


def _figure(svg: str, caption: str) -> str:
    return f'<figure class="chart">{svg}<figcaption>{html.escape(caption)}</figcaption></figure>'


def _label(name: str, width: int = 40) -> str:
    return tail_name(name, width).replace("$", r"\$")  # no mathtext


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _layers_chart(layers: list[dict[str, Any]]) -> str:
    worst = layers[:WORST_LAYERS]
    fig = _figure_class()(figsize=(8, 1.2 + 0.3 * len(worst)))
    ax = fig.add_subplot()
    ys = range(len(worst))
    bars = [("output, layer alone", "output_sqnr_db"), ("alone", "own_sqnr_db"), ("with prefix", "prefix_sqnr_db")]
    bars = [b for b in bars if b[1] != "output_sqnr_db" or any(r.get(b[1]) is not None for r in worst)]
    height = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars):
        ax.barh([y + (i - (len(bars) - 1) / 2) * height for y in ys], [_nan(r.get(key)) for r in worst], height,
                label=label)
    ax.set_yticks(list(ys), [_label(r["name"]) for r in worst], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("SQNR (dB), higher is better")
    ax.legend(fontsize=8, ncols=len(bars), loc="lower left", bbox_to_anchor=(0, 1))
    ax.grid(axis="x", alpha=0.3)
    output = "the model's output with the layer alone quantized (the ranking), " if len(bars) == 3 else ""
    return _figure(_svg(fig, "layers-"), f"SQNR of the {len(worst)} most sensitive layers: {output}"
                   "the layer's own output quantized alone and with every earlier layer quantized too.")


def _ranges_chart(tensors: list[dict[str, Any]]) -> str:
    worst = tensors[:WORST_TENSORS]
    cols = min(4, len(worst))
    rows = math.ceil(len(worst) / cols)
    fig = _figure_class()(figsize=(2.6 * cols, 1.8 * rows))
    inches = 1.8 * rows
    fig.subplots_adjust(left=0.03, right=0.97, bottom=0.5 / inches, top=1 - 0.3 / inches,
                        wspace=0.12, hspace=0.45)
    for i, t in enumerate(worst):
        ax = fig.add_subplot(rows, cols, i + 1)
        hist = t.get("histogram") or {}
        if hist.get("counts") and None not in hist["edges"]:
            ax.stairs(hist["counts"], hist["edges"], fill=True, color="#4c72b0")
            ax.set_yscale("symlog", linthresh=1)
        for x in t["calibrated_range"]:
            if x is not None:
                ax.axvline(x, color="#c44e52", linestyle="--", linewidth=1)
        ax.set_title(_label(t["name"], 30), fontsize=7)
        ax.tick_params(labelsize=6)
        ax.tick_params(axis="y", which="both", left=False, labelleft=False)
    return _figure(_svg(fig, "ranges-", tight=False), f"Float values of the {len(worst)} worst "
                   "tensors (count on a log scale) with the calibrated range marked in red.")


def _trials_chart(mp: dict[str, Any]) -> str:
    fig = _figure_class()(figsize=(6.5, 3.2))
    ax = fig.add_subplot()
    if mp["base_score"] is not None:
        ax.plot([0], [mp["base_score"]], "o", color="gray", label="all quantized")
    for rung in dict.fromkeys(t["rung"] for t in mp["trials"]):
        trials = [t for t in mp["trials"] if t["rung"] == rung and t["score"] is not None]
        line, = ax.plot([t["promoted"] for t in trials if t["met"]],
                        [t["score"] for t in trials if t["met"]], "o",
                        label=f"promoted to {_label(str(rung))}")
        ax.plot([t["promoted"] for t in trials if not t["met"]],
                [t["score"] for t in trials if not t["met"]], "o", mfc="none",
                color=line.get_color())
    if mp["threshold"] is not None:
        ax.axhline(mp["threshold"], color="#c44e52", linestyle="--", label="target")
    if mp["float_score"] is not None:
        ax.axhline(mp["float_score"], color="gray", linestyle=":", label="float model")
    ax.set_xlabel("layers promoted (most sensitive first)")
    ax.set_ylabel("score")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _figure(_svg(fig, "trials-"),
                   "Score of each model the search tried (hollow: target not met).")


def _pairs_table(data: dict[str, Any], prefix: str, fields: list[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(h)}</th>{_cell(data, f'{prefix}.{f}')}</tr>"
                   for h, f in fields)
    return f"<table><tbody>{rows}</tbody></table>"


def _section(ident: str, heading: str, body: str) -> str:
    return f'<section id="{ident}"><h2>{html.escape(heading)}</h2>\n{body}\n</section>'


def _analysis_sections(data: dict[str, Any]) -> list[str]:
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data["notes"])
    outputs = (f"<p>Measured on {data['samples']} samples ({html.escape(data['method'])}).</p>"
               + _table(data, "outputs", [("output", "name"), ("SQNR dB", "sqnr_db"),
                                          ("cosine", "cosine"), ("max err", "max_abs_error"),
                                          ("top-1 agreement", "top1_agreement")])
               + (f"<ul>{notes}</ul>" if notes else ""))
    layers = (_layers_chart(data["layers"]) if data["layers"] else "") + _table(
        data, "layers", [("layer", "name"), ("op", "op_type"), ("output dB", "output_sqnr_db"),
                         ("alone dB", "own_sqnr_db"), ("with prefix dB", "prefix_sqnr_db"),
                         ("channel noise", "channel_noise"), ("cosine", "own_cosine")])
    tensors = _table(data, "tensors", [
        ("tensor", "name"), ("dtype", "dtype"), ("dB", "sqnr_db"), ("cosine", "cosine"),
        ("max err", "max_abs_error"), ("used range", "used_range"),
        ("calibrated range", "calibrated_range"), ("clipped", "saturation")])
    tensors += _ranges_chart(data["tensors"]) if data["tensors"] else ""
    return [_section("outputs", "Outputs", outputs),
            _section("layers", "Layers, most sensitive first", layers),
            _section("tensors", "Tensors, worst first", tensors)]


def _mixed_precision_section(data: dict[str, Any]) -> str:
    body = _pairs_table(data, "mixed_precision", [
        ("target", "target"), ("met", "met"), ("threshold", "threshold"),
        ("float score", "float_score"), ("all quantized score", "base_score"),
        ("after algorithm rungs", "algorithm_score"),
        ("final score", "final_score"), ("best score (target not met)", "best_score"),
        ("written (target not met)", "written"), ("ranked layers", "ranked_layers"),
        ("models scored", "evaluations"), ("size before", "size_before"),
        ("size after", "size_after"), ("latency before (batch 1)", "latency_ms_before"),
        ("latency after (batch 1)", "latency_ms_after"), ("search time", "seconds")])
    body += "<h3>Algorithm rungs</h3>" + _table(data, "mixed_precision.rungs", [
        ("rung", "rung"), ("score", "score"), ("met", "met"), ("kept", "kept"), ("seconds", "seconds"),
        ("what", "why")])
    body += "<h3>Promotions</h3>" + _table(data, "mixed_precision.promotions", [
        ("node", "node"), ("rung", "rung"), ("output dB with only it quantized (the ranking)", "output_db")])
    body += "<h3>Trials</h3>" + _trials_chart(data["mixed_precision"]) + _table(
        data, "mixed_precision.trials",
        [("promoted", "promoted"), ("rung", "rung"), ("score", "score"), ("met", "met")])
    return _section("mixed-precision", "Mixed precision", body)


def render_html(data: dict[str, Any], summary: Summary | None, config: Config | None,
                title: str) -> str:
    """The whole page for `data` (from `report_data`)."""
    sections = []
    if config is not None:
        # `preset: none` heads a whole config (the preset the run started from is already in
        # it): read as "no preset", it contradicted the summary's U8S8 (vision-transformer trial)
        said = ("# every setting of the run, the preset it started from included: 'preset: none' means this "
                "document needs no preset under it (onnxq quantize ... --config this.yaml runs it again)\n")
        yaml = html.escape(said + config_to_yaml(config))
        sections.append(_section("settings", "Settings", f"<pre>{yaml}</pre>"))
    if summary is not None:
        text = html.escape(format_summary(summary))
        sections.append(_section("summary", "Summary", f"<pre>{text}</pre>"))
    if "layers" in data:
        sections += _analysis_sections(data)
    if data["mixed_precision"] is not None:
        sections.append(_mixed_precision_section(data))
    ids = re.findall(r'<section id="([^"]+)"', "".join(sections))
    nav = " ".join(f'<a href="#{s}">{s}</a>' for s in ids)
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">', f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{html.escape(title)}</h1>",
        f'<p id="how-to-read">{_HOWTO}</p>', f"<nav>{nav}</nav>", *sections,
        f'<script type="application/json" id="onnxq-data">{blob}</script>',
        "</body>", "</html>", ""])


def write_html_report(path: str | os.PathLike, *, analysis: Analysis | None = None,
                      summary: Summary | None = None, config: Config | None = None,
                      title: str = "onnxq report") -> Path:
    """Write the report atomically (a temp file in the same folder, then os.replace); return
    the path. Raises OnnxqError when matplotlib is missing."""
    _figure_class()  # fail early, before any work, when matplotlib is missing
    path = Path(path)
    text = render_html(report_data(analysis, summary, config), summary, config, title)
    return write_text_atomic(path, text)
