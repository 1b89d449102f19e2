"""Commands on a float model and its quantized model: `onnxq compare` (how close their outputs
are) and `onnxq analyze` (per-layer and per-tensor error)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from onnxq.analyze import analyze_models, format_analysis
from onnxq.analyze.analysis import RANKS
from onnxq.analyze.html import write_html_report
from onnxq.analyze.labelled import accuracy_note
from onnxq.cli.arguments import check_counts, check_model_files
from onnxq.errors import CalibrationDataError, ModelError
from onnxq.evaluate import compare_models, format_comparison
from onnxq.graph.save import check_apart, check_output_paths


def add_compare(sub: argparse._SubParsersAction) -> None:
    c = _model_pair_parser(sub, "compare", "compare a quantized model with its float original",
                           "array in the --data .npz holding class labels")
    c.add_argument("--kernels", choices=("deployed", "reference", "both"), default="deployed",
                   help="deployed: a default onnxruntime session, as users run it (default); "
                        "reference: Q/DQ unfused, float arithmetic; both: report both")
    c.set_defaults(func=_cmd_compare)


def add_analyze(sub: argparse._SubParsersAction) -> None:
    a = _model_pair_parser(sub, "analyze", "per-layer and per-tensor error of a quantized model",
                           "an array in the --data .npz holding class labels: top-1 of both models against them, and left out of the inputs")
    a.add_argument("--json", metavar="FILE.json", help="write every figure as JSON")
    a.add_argument("--report", metavar="FILE.html", help="write an HTML report")
    a.add_argument("--top", type=int, default=15, help="rows of each table on the terminal (default 15)")
    a.add_argument("--rank", choices=RANKS, default="output",
                   help="order of the layer table: output (default): what each layer alone does to the model's "
                        "output, as the accuracy search ranks (a short run of a model per layer); noise: the "
                        "layer's own channel noise, without those runs (faster, and can misrank)")
    a.set_defaults(func=_cmd_analyze)


def _model_pair_parser(sub: argparse._SubParsersAction, name: str, help_text: str,
                       labels_help: str) -> argparse.ArgumentParser:
    """A subcommand reading a float model, its quantized model and data (compare, analyze)."""
    c = sub.add_parser(name, help=help_text)
    c.add_argument("float_model")
    c.add_argument("quant_model")
    c.add_argument("--data", required=True, help="inputs: .npz, .npy or a folder of them")
    c.add_argument("--labels", metavar="KEY", help=labels_help)
    c.add_argument("--max-samples", type=int)
    c.add_argument("--batch-size", type=int, help="samples per run (dynamically quantized models compute "
                   "their activation scales per run, so their figures depend on it)")
    c.add_argument("--providers", nargs="+", help="onnxruntime execution providers")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return c


def _check_pair(args: argparse.Namespace) -> None:
    """The two models are two: the same file (or the same bytes) twice gave SQNR inf and
    empty tables with exit 0."""
    first, second = Path(args.float_model), Path(args.quant_model)
    if first.resolve() == second.resolve() or (first.stat().st_size == second.stat().st_size
                                               and first.read_bytes() == second.read_bytes()):
        raise ModelError(f"{args.float_model} and {args.quant_model} are the same model; give the float model, then "
                         "the quantized one onnxq wrote from it")


def _cmd_compare(args: argparse.Namespace) -> int:
    data, labels = _data_and_labels(args.data, args.labels)
    check_model_files(args, "float_model", "quant_model")
    _check_pair(args)
    check_counts(args, "--max-samples", "--batch-size")
    result = compare_models(args.float_model, args.quant_model, data, labels, args.max_samples,
                            providers=args.providers, kernels=args.kernels,
                            progress=False if args.quiet else None, **_batch_size(args))
    print(format_comparison(result))
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    check_model_files(args, "float_model", "quant_model")
    _check_pair(args)
    check_counts(args, "--max-samples", "--batch-size", "--top")
    check_output_paths(args.quant_model, args.json, args.report)
    check_apart({"--json": args.json, "--report": args.report},
                {"the float model": args.float_model, "the quantized model": args.quant_model, "the data": args.data})
    data, labels = _data_and_labels(args.data, args.labels)
    analysis = analyze_models(args.float_model, args.quant_model, data, max_samples=args.max_samples,
                              providers=args.providers, progress=False if args.quiet else None,
                              rank=args.rank, **_batch_size(args))
    if labels is not None:
        analysis.notes.insert(0, accuracy_note(args.float_model, args.quant_model, data, labels,
                                               max_samples=args.max_samples, providers=args.providers,
                                               **_batch_size(args)))
    if args.json:
        analysis.to_json(args.json)
    if args.report:
        write_html_report(args.report, analysis=analysis, title=f"onnxq analysis of {args.quant_model}")
    print(format_analysis(analysis, args.top))
    return 0


def _data_and_labels(data: str, key: str | None) -> tuple[object, object]:
    """`--data` and the labels array `--labels KEY` names in it (split off the inputs)."""
    if key is None:
        return data, None
    path = Path(data)
    if path.suffix != ".npz" or not path.is_file():
        raise CalibrationDataError("--labels KEY needs --data to be one .npz file holding that key")
    with np.load(path) as npz:
        if key not in npz.files:
            raise CalibrationDataError(f"{path} has no array {key!r}; keys: {', '.join(npz.files)}")
        arrays = {k: npz[k] for k in npz.files}
    return arrays, arrays.pop(key)


def _batch_size(args: argparse.Namespace) -> dict[str, int]:
    """`--batch-size` as a keyword (absent: the command's own default)."""
    return {} if args.batch_size is None else {"batch_size": args.batch_size}
