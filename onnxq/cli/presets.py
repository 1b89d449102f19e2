"""Commands on configs: `onnxq presets` (the named presets), `onnxq config show` (the config a
set of flags resolves to) and `onnxq config convert` (a config file as a complete one)."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxq.cli.flags import add_config_flags, spec_overrides
from onnxq.config import PRESETS, config_to_yaml, get_preset, save_config
from onnxq.config.compose import OVERRIDES_SOURCE, compose_config
from onnxq.config.paths import absolute
from onnxq.errors import OnnxqError


def add_presets(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the named presets")
    p.add_argument("--show", metavar="NAME", help="print one preset as YAML")
    p.set_defaults(func=_cmd_presets)


def add_config(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="show the config a set of flags resolves to, or convert a config file")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved config (preset < --config < flags) as YAML")
    add_config_flags(show)
    show.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    show.set_defaults(func=_cmd_config_show)
    convert = cfg_sub.add_parser("convert", help="write a config file (YAML, JSON or AMCT .cfg) as a "
                                 "complete onnxq YAML/JSON config")
    convert.add_argument("input", help="config file to read")
    convert.add_argument("output", help="where to write it (.yaml, .yml or .json)")
    convert.add_argument("--preset", help="preset under the input (default: its preset: key, else U8S8)")
    convert.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    convert.set_defaults(func=_cmd_config_convert)


def _cmd_presets(args: argparse.Namespace) -> int:
    if args.show:
        print(config_to_yaml(get_preset(args.show)), end="")
        return 0
    width = max(len(name) for name in PRESETS)
    for name, preset in PRESETS.items():
        print(f"{name:<{width}}  {preset.description}")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    # `preset: none` heads every complete document: not the preset it was resolved from
    named = f" (--preset {args.preset})" if args.preset else ""
    # refused: nothing printed; paths absolute, so the output redirected anywhere reads back to the same files
    text = config_to_yaml(absolute(compose_config(args.preset, args.config, spec_overrides(args), label=OVERRIDES_SOURCE)))
    print(f"# the config resolved from preset{named} < --config < flags; complete, so `preset: none`")
    print(text, end="")
    return 0


def _cmd_config_convert(args: argparse.Namespace) -> int:
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise OnnxqError(f"convert would overwrite its input {args.input}; give another output path")
    save_config(compose_config(args.preset, args.input), args.output)
    print(f"onnxq: wrote {args.output}")
    return 0
