"""The `onnxq` command line: the parser of every command, and the run of the one given, with
a user mistake as one line on stderr and exit status 2 (`--debug`: its traceback instead)."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

from onnxq import __version__
from onnxq.cli import compare, model, presets, quantize
from onnxq.cli.flags import in_flag_terms
from onnxq.errors import OnnxqError
from onnxq.plugins import load_plugins

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped

# Each command's parser (and the function it runs), in the order `onnxq --help` lists them.
COMMANDS = (quantize.add_quantize, quantize.add_calibrate, presets.add_presets, compare.add_compare,
            compare.add_analyze, presets.add_config, model.add_convert, model.add_run, model.add_inspect)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes (a bad flag value, a missing argument) as one line and exit 2, like
    every other user mistake, instead of the whole usage block; subcommands inherit it."""

    argv: list[str] = []  # the command line being parsed (`main`), for the hints of `error`

    def error(self, message: str) -> NoReturn:
        if "arguments are required" in message:
            message += _swallowed(self, self.argv)
        print(f"onnxq: error: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's signature)
        """As argparse's, but an unknown option points to the help of the command it was given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            where = _command_prog(self, parsed)
            print(f"onnxq: error: unrecognized arguments: {' '.join(extras)}; see {where} --help", file=sys.stderr)
            raise SystemExit(EXIT_USAGE)
        return parsed


def _swallowed(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """A hint where a flag that takes several values came before the paths and took them
    (`onnxq quantize --exclude conv1 in.onnx out.onnx` read three node names)."""
    many = {opt for action in parser._actions if action.nargs in ("+", "*") for opt in action.option_strings}
    for i, arg in enumerate(argv):
        if arg not in many:
            continue
        values = list(itertools.takewhile(lambda a: not a.startswith("-"), argv[i + 1:]))
        if any(v.lower().endswith(".onnx") or os.path.exists(v) for v in values):  # it took a model or a path
            return f" ({arg} takes every value after it: put the paths before {arg})"
    return ""


def _command_prog(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> str:
    """The program name of the innermost command `parsed` ran (`onnxq config show`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _command_prog(chosen, parsed)
    return parser.prog


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onnxq", description="Post-training quantization for ONNX models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE",
                        help="import code that registers observers, passes or algorithms first "
                             "(repeatable; also $ONNXQ_PLUGINS)")
    parser.add_argument("--version", action="version", version=f"onnxq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(sub)
    for command in _leaves(sub):  # --plugin after the command too
        command.add_argument("--plugin", action="append", dest="command_plugins", default=[],
                             metavar="FILE.py|MODULE", help="import code that registers observers, "
                             "passes or algorithms first (repeatable; also $ONNXQ_PLUGINS)")
    return parser


def _leaves(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Every command's parser (`config show` and `config convert`, not `config`)."""
    leaves = []
    for parser in dict.fromkeys(sub.choices.values()):
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += _leaves(nested[0]) if nested else [parser]
    return leaves


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status is 0, 2 for a user mistake (one line on
    stderr, or its traceback with --debug: the status does not change), 130 when
    interrupted, 143 when terminated (SIGTERM; temporary files removed), 141 when the reader of stdout went away (`onnxq presets | head -1`)."""
    try:  # a plugin's algorithms bring their flags: load plugins before the parser is built
        load_plugins(_plugin_flags(sys.argv[1:] if argv is None else argv))
    except OnnxqError as exc:
        print(f"onnxq: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _Parser.argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM (kill, a scheduler's timeout) unwinds like Ctrl-C: temporary files go
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _plugin_flags(argv: list[str]) -> list[str]:
    """The values of every `--plugin` in `argv` (before or after the command)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--plugin" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--plugin="):
            found.append(arg.split("=", 1)[1])
    return found


def _run(args: argparse.Namespace) -> int:
    try:
        load_plugins(args.plugin + getattr(args, "command_plugins", []))
        return args.func(args)
    except OnnxqError as exc:
        if args.debug:
            traceback.print_exc()
        else:
            print(f"onnxq: error: {in_flag_terms(str(exc), args)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("onnxq: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python would report the closed pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
