"""Pythonic tool calls (Llama 3.2 and 4 templates, vLLM's `pythonic` parser): the whole
output is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit="celsius"), get_time(tz="CET")]

Each call is reported once its closing parenthesis is read (its arguments are Python
literals, converted to a JSON object); the values are read with `ast.literal_eval`,
never evaluated. An output that is not such a list is content; a list that breaks
after its first call ends there.
"""

from __future__ import annotations

import ast
import json
import re

from flowengine.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolParser

# What a list of calls starts with: "[", a (dotted) name, "(".
_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_OPENING_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")


def parse_call(text: str) -> tuple[str, str]:
    """`name(key=literal, ...)` → (name, JSON arguments). Raises ValueError."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"not a Python call: {err}") from err
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("a tool call takes keyword arguments only")
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise ValueError(f"{name!r} is not a function name")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs is not a literal argument")
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
            raise ValueError(f"argument {keyword.arg!r} is not a literal") from err
    try:
        return name, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError) as err:  # e.g. a set, bytes or complex literal
        raise ValueError(f"arguments are not JSON values: {err}") from err


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self) -> None:
        super().__init__()
        self._raw = ""  # the whole output
        self._pos = 0  # next character of _raw to scan
        self._mode = "start"  # start | list | text | done
        self._depth = 0  # brackets open, the list's own included
        self._quote = ""  # the open string's quote (' " ''' \"\"\"), or ""
        self._escape = False
        self._call_start: int | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "text":
            out.content += self.gate.push(text)
            return out
        self._raw += text
        if self._mode == "start":
            head = self._raw.lstrip()
            if not head:
                return out
            if not _OPENING.match(head):
                if _OPENING_PREFIX.match(head):
                    return out  # may still become a call list
                return self._as_text(out)
            self._mode = "list"
            self._pos = len(self._raw) - len(head)
        if self._mode == "list":
            self._scan(out, at_end=False)
        return out

    def _as_text(self, out: ParsedDelta) -> ParsedDelta:
        self._mode = "text"
        out.content += self.gate.push(self._raw)
        self._raw = ""
        return out

    def _scan(self, out: ParsedDelta, at_end: bool) -> None:
        raw = self._raw
        i = self._pos
        while i < len(raw):
            ch = raw[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif len(self._quote) == 3 and ch == self._quote[0] and len(raw) - i < 3 \
                        and not at_end:
                    break  # the closing triple quote may be arriving
                elif ch == "\\":
                    self._escape = True
                elif raw.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = ""
                i += 1
                continue
            if ch in "'\"":
                if len(raw) - i < 3 and not at_end:
                    break  # a triple quote may be arriving
                self._quote = ch * 3 if raw.startswith(ch * 3, i) else ch
                i += len(self._quote)
                continue
            if ch in "([{":
                self._depth += 1
                if self._depth == 2 and self._call_start is None:
                    self._fail(out)
                    return
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 1 and ch == ")":
                    assert self._call_start is not None
                    try:
                        name, arguments = parse_call(raw[self._call_start: i + 1])
                    except ValueError:
                        self._fail(out)
                        return
                    out.tool_calls.append(self.new_call(name, arguments))
                    self._call_start = None
                elif self._depth == 0:
                    self._mode = "done"  # what follows the list is not kept
                    self._pos = len(raw)
                    return
            elif self._depth == 1 and self._call_start is None and not ch.isspace():
                if ch == "," and self.num_calls:
                    pass
                elif ch.isalpha() or ch == "_":
                    self._call_start = i
                else:
                    self._fail(out)
                    return
            i += 1
        self._pos = i

    def _fail(self, out: ParsedDelta) -> None:
        if self.num_calls == 0:
            self._as_text(out)
        else:
            self._mode = "done"

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "start":
            self._as_text(out)
        elif self._mode == "list":
            self._scan(out, at_end=True)
            if self._mode == "list" and self.num_calls == 0:
                self._as_text(out)  # a list that never closed its first call
        out.content += self.gate.finish()
        return out
