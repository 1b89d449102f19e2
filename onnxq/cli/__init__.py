"""Command line: `onnxq quantize`, `analyze`, `compare`, `presets`, `inspect`.

Flags override the config file, which overrides the preset. A user mistake prints one
line on stderr and exits with status 2; `--debug` shows the traceback instead.

`entry`: the parser and the run of a command; one module per group of commands
(`quantize`: quantize, calibrate; `model`: convert, run, inspect; `compare`: compare,
analyze; `presets`: presets, config); `flags`: the config flags and their translation into
the config-file shape; `algorithms`: the algorithm flags; `arguments`: shared checks.
"""

from onnxq.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
