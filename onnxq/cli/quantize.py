"""`onnxq quantize` and `onnxq calibrate`: a model quantized, or its calibration statistics
saved (one shard or all of them) for `quantize --stats`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxq.cli.arguments import check_counts
from onnxq.cli.flags import add_config_flags, in_cli_words, spec_overrides
from onnxq.config import save_config
from onnxq.config.compose import OVERRIDES_SOURCE, ConfigSources, compose_config
from onnxq.config.defaults import default_preset
from onnxq.config.paths import for_reuse
from onnxq.errors import OnnxqError
from onnxq.graph.save import check_apart, check_output_paths, write_text_atomic
from onnxq.quantize import calibrate_shard, calibrate_sharded, quantize
from onnxq.report import format_summary


def add_quantize(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("quantize", help="quantize a model with calibration data")
    q.add_argument("input", help="float ONNX model")
    q.add_argument("output", help="where to write the quantized model")
    q.add_argument("--calib-data", help="calibration data: .npz, .npy or a folder of them")
    add_config_flags(q)
    q.add_argument("--save-config", metavar="FILE.yaml",
                   help="write the config used (with the layers an accuracy target promoted) to reuse; without "
                        "--save-ranges, which a rerun would write over")
    q.add_argument("--report", metavar="FILE.html",
                   help="write an HTML report: settings, summary, per-layer error, ranges, promotions")
    q.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    q.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    q.set_defaults(func=_cmd_quantize)


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="calibrate (one shard of) the data and save mergeable statistics "
                         "for quantize --stats")
    cal.add_argument("input", help="float ONNX model")
    cal.add_argument("--calib-data", help="calibration data: .npz, .npy or a folder of them (or --calib-text)")
    cal.add_argument("--stats", required=True, metavar="FILE.npz", help="where to write the statistics")
    cal.add_argument("--shard", metavar="I/N", help="calibrate only shard I of N (1-based): a contiguous "
                     "stretch of the batches; run every shard (on any machines), then quantize --stats with all files")
    cal.add_argument("--shards", type=int, metavar="N", help="run all N shards in parallel on --executor and "
                     "write their merged statistics")
    cal.add_argument("--executor", choices=("process", "ray"),
                     help="where --shards run: local processes (default) or Ray tasks (pip install 'onnxq[ray]')")
    cal.add_argument("--ray-address", metavar="ADDR", help="an existing Ray cluster (default: a local instance)")
    add_config_flags(cal, stats=False)
    cal.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    cal.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    cal.set_defaults(func=_cmd_calibrate)


def _cmd_quantize(args: argparse.Namespace) -> int:
    sources = ConfigSources(args.preset, args.config, spec_overrides(args))
    progress = False if args.quiet else None
    check_output_paths(args.input, args.save_config)
    check_apart({"--save-config": args.save_config}, {
        "the input model": args.input, "the calibration data (--calib-data)": args.calib_data,
        "the config file (--config)": args.config, "the output model": args.output, "the report (--report)": args.report})
    check_apart({"--save-config": args.save_config, "--save-ranges": args.save_ranges}, {})
    plugins = [p for p in (*getattr(args, "plugin", ()), *getattr(args, "command_plugins", ())) if Path(p).is_file()]
    for label, out in (("the output model", args.output), ("--save-config", args.save_config),
                       ("--report", args.report), ("--save-ranges", args.save_ranges)):
        check_apart({label: out}, {f"the plugin {p}": p for p in plugins})
    # The sources, not a composed config: where they name no preset, the model picks it.
    result = quantize(args.input, args.output, sources, args.calib_data, progress=progress, report=args.report)
    if args.report and Path(args.report).is_file():  # its notes in a Python caller's words; this user typed flags
        write_text_atomic(args.report, in_cli_words(Path(args.report).read_text(encoding="utf-8")))
    if args.save_config:
        mp = result.summary.mixed_precision
        save_config(for_reuse(mp.config if mp is not None else result.config), args.save_config)
    if not args.quiet:
        print(in_cli_words(format_summary(result.summary)))
        if args.save_config:
            print(f"  config written to {args.save_config}")
        if args.report:
            print(f"  report written to {args.report}")
    elif (mp := result.summary.mixed_precision) is not None and not mp.met:
        # the one line --quiet keeps: a pipeline must see that the model it got misses the target
        print(f"onnxq: warning: accuracy target {mp.target} NOT met on {mp.scored_on} (final {mp.final_score:.4g}, "
              f"float {mp.float_score:.4g}); written: {mp.written}", file=sys.stderr)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    output = args.stats
    args.stats = None  # the file written, not statistics to read (FLAG_PATHS)
    check_output_paths(args.input, output)
    check_apart({"--stats": output}, {"the calibration data": args.calib_data, "the config file": args.config})
    ignored = [flag for flag, value in (("--save-ranges", args.save_ranges), ("--format", args.format),
                                        ("--ladder", args.ladder), ("--rung-min-gain", args.rung_min_gain),
                                        ("--check-samples", args.check_samples), ("--latency", args.latency))
               if value is not None]
    if ignored:
        raise OnnxqError(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect on calibrate, "
                         "which writes statistics only: give it to onnxq quantize --stats FILE")
    check_counts(args, "--shards")
    config = compose_config(args.preset, args.config, spec_overrides(args),
                            lambda: default_preset(args.input), label=OVERRIDES_SOURCE)
    progress = False if args.quiet else None
    if args.shard is not None and args.shards is not None:
        raise OnnxqError("--shard i/n calibrates one shard here, --shards N runs all N on --executor; give one")
    if args.shard is None and (args.executor is not None or args.ray_address is not None) and args.shards is None:
        raise OnnxqError("--executor and --ray-address run shards: add --shards N")
    if args.shard is not None:
        result = calibrate_shard(args.input, output, config, args.calib_data, args.shard, progress=progress)
    else:
        result = calibrate_sharded(args.input, output, config, args.calib_data, args.shards or 1,
                                   args.executor or "process", args.ray_address, progress=progress)
    if not args.quiet:
        first, end = result.window
        print(f"onnxq: statistics of batches {first}..{end - 1} of {result.total_batches} "
              f"({result.num_samples} samples) written to {result.path}")
    return 0
