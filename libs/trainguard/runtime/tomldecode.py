"""TOML config files decoded by msgspec, with errors that name the key and its line.

``tomllib`` parses; msgspec checks the result against a Struct (``forbid_unknown_fields``
catches typos, ``Meta`` bounds catch bad numbers) and says where, as a path
(``$.causes.oom.escalate_after``). :func:`locate` turns that path back into a line of the
file, reading the file the way TOML does: comments are stripped before a line is looked
at, so a key name inside a comment never takes the line number.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, TypeVar

import msgspec

from trainguard.contract.errors import ConfigError

T = TypeVar("T")

_PATH = re.compile(r"at `\$((?:\.[^.`\[]+|\[\d+\])*)`")
_KEY_IN = re.compile(r"at `key` in `\$((?:\.[^.`\[]+|\[\d+\])*)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_TABLE = re.compile(r"^\[\[?\s*(.+?)\s*\]\]?$")
_ASSIGN = re.compile(r"^((?:\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+)"
                     r"(?:\s*\.\s*(?:\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+))*)\s*=")


class TomlError(ConfigError):
    """A config file that does not parse or does not match its schema."""

    def __init__(self, source: str, line: int, message: str) -> None:
        self.source, self.line, self.message = source, line, message
        super().__init__(f"{source}, line {line}: {message}" if line else f"{source}: {message}")


def strip_comment(line: str) -> str:
    """``line`` without its ``#`` comment (a ``#`` inside a quoted string is kept)."""
    quote = ""
    escaped = False
    for i, ch in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _keys(dotted: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("\"'") for part in
                 re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", dotted))


def locate(text: str, path: tuple[str, ...]) -> int:
    """The line (1-based) that defines ``path`` (``("causes", "oom", "escalate_after")``),
    else the nearest enclosing table's line, else 0."""
    best, best_depth = 0, 0
    table: tuple[str, ...] = ()
    for n, raw in enumerate(text.splitlines(), 1):
        code = strip_comment(raw).strip()
        if not code:
            continue
        if m := _TABLE.match(code):
            table = _keys(m.group(1))
            full = table
        elif m := _ASSIGN.match(code):
            full = table + _keys(m.group(1))
        else:
            continue
        depth = len(full)
        if full == path[:depth] and depth > best_depth:
            best, best_depth = n, depth
            if depth == len(path):
                return n
    return best


def _where(message: str) -> tuple[tuple[str, ...], str]:
    """The key path an error of msgspec points at, and the message without it."""
    keys: tuple[str, ...] = ()
    if m := _KEY_IN.search(message) or _PATH.search(message):
        keys = tuple(k for k in re.split(r"\.|\[\d+\]", m.group(1)) if k)
        message = message[:m.start()].rstrip(" -")
    if m := _UNKNOWN_FIELD.search(message):
        keys += (m.group(1),)
        message = f"unknown key {m.group(1)!r}"
    return keys, message


def parse(text: str, source: str) -> dict[str, Any]:
    """``text`` parsed as TOML; :class:`TomlError` with the line where it is not."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        text_of = str(exc)  # "Invalid value (at line 2, column 14)"
        if m := re.search(r"\s*\(at line (\d+), column (\d+)\)$", text_of):
            raise TomlError(source, int(m.group(1)),
                            f"{text_of[:m.start()]} (column {m.group(2)})") from None
        raise TomlError(source, 0, text_of) from None


def convert(value: Any, cls: type[T], *, text: str, source: str,
            at: tuple[str, ...] = ()) -> T:
    """``value`` (a part of the parsed ``text`` found at key path ``at``) as ``cls``;
    :class:`TomlError` naming the key and its line otherwise.

    msgspec writes a dict key as ``[...]`` in its paths, so a table of tables keyed by
    name (``[causes.<cause>]``) is converted one entry at a time, with ``at`` naming it.
    """
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as exc:
        keys, why = _where(str(exc))
        keys = at + keys
        raise TomlError(source, locate(text, keys),
                        f"{'.'.join(keys)}: {why}" if keys else why) from None


def fail(text: str, source: str, at: tuple[str, ...], why: str) -> TomlError:
    """An error about the key at ``at``, with its line."""
    return TomlError(source, locate(text, at), f"{'.'.join(at)}: {why}" if at else why)
