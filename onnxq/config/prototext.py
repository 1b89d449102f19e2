"""A reader for protobuf text format (`key: value`, `key { ... }`), checked against a
schema, for configs that other tools write that way (AMCT's `.cfg`).

Hand-written rather than `google.protobuf.text_format` over a generated descriptor so a
misspelled field gets a one-line error with its line number and the nearest field name,
and the order of fields is kept (AMCT lets the algorithm configured last win).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onnxq.errors import ConfigError, closest_name

# A field's kind: "bool", "int", "float", "string", "enum", the name of a message, or
# "opaque": any value or message, read but not checked (a field only ever refused).
SCALARS = ("bool", "int", "float", "string", "enum")
OPAQUE = "opaque"


@dataclass(frozen=True)
class Field:
    kind: str
    repeated: bool = False


Schema = Mapping[str, Mapping[str, Field]]  # message name -> field name -> Field


@dataclass
class Message:
    """A parsed message: its fields in file order, each with the line it starts on."""

    type: str
    line: int
    fields: list[tuple[str, Any, int]] = field(default_factory=list)

    def get(self, name: str, default: Any = None) -> Any:
        """The last value of field `name` (protobuf's rule for a repeated scalar field)."""
        values = self.all(name)
        return values[-1] if values else default

    def all(self, name: str) -> list[Any]:
        return [value for key, value, _ in self.fields if key == name]

    def names(self) -> list[str]:
        return [key for key, _, _ in self.fields]

    def has(self, name: str) -> bool:
        return name in self.names()


_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)[fF]?)
  | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[{}<>:;,\[\]])
""", re.VERBOSE)


def _tokens(text: str, where: str) -> list[tuple[str, str, int]]:
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ConfigError(f"{where}: line {line}: cannot read {text[pos:pos + 20]!r}; "
                              "expected `field: value` or `field { ... }`")
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str, schema: Schema, where: str) -> None:
        self.tokens = _tokens(text, where)
        self.i = 0
        self.schema = schema
        self.where = where

    def error(self, line: int, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: line {line}: {message}")

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def next(self) -> tuple[str, str, int]:
        token = self.peek()
        if token is None:
            last = self.tokens[-1][2] if self.tokens else 1
            raise self.error(last, "the file ends inside a message; a closing } is missing")
        self.i += 1
        return token

    def message(self, type_name: str, line: int, closing: str | None) -> Message:
        msg = Message(type_name, line)
        fields = self.schema[type_name]
        while True:
            token = self.peek()
            if token is None:
                if closing is not None:
                    raise self.error(line, f"{type_name} opened here is never closed with {closing}")
                return msg
            kind, text, at = self.next()
            if closing is not None and text == closing:
                return msg
            if text in (";", ","):
                continue
            if kind != "word":
                raise self.error(at, f"expected a field name, got {text!r}")
            if text not in fields:
                hint = closest_name(text, list(fields))
                fix = f"did you mean '{hint}'?" if hint else f"fields of {type_name}: {', '.join(fields)}"
                raise self.error(at, f"unknown field {text!r} in {type_name}; {fix}")
            spec = fields[text]
            if not spec.repeated and msg.has(text):
                raise self.error(at, f"{text} is given twice in {type_name}; give it once")
            msg.fields.append((text, self.value(text, spec, at), at))

    def value(self, name: str, spec: Field, at: int) -> Any:
        token = self.peek()
        if token is not None and token[1] == ":":
            self.next()
        kind, text, line = self.next()
        if spec.kind == OPAQUE:
            depth = 1 if text in ("{", "<") else 0
            while depth:
                token = self.next()[1]
                depth += (token in ("{", "<")) - (token in ("}", ">"))
            return Message(OPAQUE, line)
        if spec.kind not in SCALARS:
            closing = {"{": "}", "<": ">"}.get(text)
            if closing is None:
                raise self.error(line, f"{name} is a message: write {name} {{ ... }}")
            return self.message(spec.kind, line, closing)
        return self.scalar(name, spec.kind, kind, text, line)

    def scalar(self, name: str, want: str, kind: str, text: str, line: int) -> Any:
        if want == "string" and kind == "string":
            return bytes(text[1:-1], "utf-8").decode("unicode_escape")
        if want == "bool" and text in ("true", "false", "True", "False", "1", "0"):
            return text in ("true", "True", "1")
        if want == "int" and kind == "number" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if want == "float" and kind == "number":
            return float(text.rstrip("fF"))
        if want == "enum" and kind in ("word", "string"):
            return text.strip("\"'")
        expected = {"bool": "true or false", "int": "an integer", "float": "a number",
                    "string": "a quoted string", "enum": "a name"}[want]
        raise self.error(line, f"{name} must be {expected}, got {text!r}")


def parse_prototext(text: str, schema: Schema, root: str, where: str) -> Message:
    """The message of type `root` that `text` holds; `ConfigError` naming `where` and the
    line for anything the schema does not allow."""
    return _Parser(text, schema, where).message(root, 1, None)
