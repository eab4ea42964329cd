"""Incremental scanner of JSON tool calls: objects {"name": <string>, "arguments": <value>}.

The call objects are those whose enclosing containers are only arrays: one bare object,
the objects of a top-level array (`[{...}, {...}]`, also what `tool_choice=required`
generates), or top-level objects separated by `,` or `;` (Llama 3's form). The argument
key is "arguments" or "parameters" (Llama 3 and vLLM's `required` schema use the
latter); other keys are skipped. Text arrives in pieces of any size; the scanner
releases `ToolCallDelta`s through its parser (`ToolParser.new_call`) as soon as they are
certain: a call's name once its string is closed, argument text character by character
(a scalar or a JSON-string argument value once it has ended: it may still grow, or
must be decoded).

It checks the structure of the call objects (keys, colons, commas, brackets and
strings); inside an argument value only brackets and strings are tracked, the value
is passed on as the model wrote it. On anything else it stops with `failed` set; the
parser then decides what the text was (see base.py: malformed before a name is content).
"""

from __future__ import annotations

import json

from flowengine.entrypoints.openai.tool_parsers.base import ToolCallDelta, ToolParser

_WHITESPACE = " \t\n\r"
_SCALAR_START = "-0123456789tfn"


class _Value:
    """Reads one JSON value's raw text (container, string or scalar) to its end."""

    def __init__(self, first: str) -> None:
        self.raw = first
        self.kind = "container" if first in "{[" else "string" if first == '"' else "scalar"
        self.depth = 1 if self.kind == "container" else 0
        self.in_string = self.kind == "string"
        self.escape = False
        self.done = False

    def add(self, ch: str) -> bool:
        """Consume `ch`; False when `ch` is not part of the value (a scalar's end: the
        caller must read `ch` again). Sets `done` at the value's last character."""
        if self.kind == "scalar":
            if ch in ",}]" or ch in _WHITESPACE:
                self.done = True
                return False
            self.raw += ch
            return True
        self.raw += ch
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    self.done = True
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        return True


class JsonCallScanner:
    """See the module docstring. `feed` returns the tool-call pieces now certain."""

    def __init__(
        self,
        parser: ToolParser,
        arg_keys: tuple[str, ...] = ("arguments", "parameters"),
        separators: str = ",;",
    ) -> None:
        self.parser = parser
        self.arg_keys = arg_keys
        self.separators = separators
        self.stack: list[str] = []  # containers around the current position
        self.failed = False
        self.num_calls = 0  # calls reported by this scanner
        self.num_closed = 0  # call objects read to their closing brace
        self._in_call = False
        self._expect = "key"  # inside a call object: key, colon, value or comma
        self._value: _Value | None = None  # a key or value being read
        self._key: str | None = None
        self._name: str | None = None
        self._call: ToolCallDelta | None = None  # the first piece of the current call
        self._args_sent = False  # some argument text of the current call was released
        self._args_pending = ""  # argument text read before the name was known
        self._out: list[ToolCallDelta] = []

    @property
    def in_string(self) -> bool:
        """Inside a JSON string (where any character, also '<', may appear)."""
        return self._value is not None and self._value.in_string

    @property
    def is_idle(self) -> bool:
        """Between calls: no call object open, nothing half-read."""
        return not self._in_call and self._value is None

    def feed(self, text: str) -> list[ToolCallDelta]:
        i = 0
        while i < len(text) and not self.failed:
            if self._step(text[i]):
                i += 1
        return self._flush()

    def finish(self) -> list[ToolCallDelta]:
        """End of the text: a pending scalar argument ends here; an open call is
        closed as it is (a call without argument text gets "{}")."""
        value = self._value
        if not self.failed and value is not None and value.kind == "scalar" and self._in_call:
            value.done = True
            self._value_done()
        self.close_open_call()
        return self._flush()

    def close_open_call(self) -> None:
        """The current call ends here (end of text, or the format broke after its name)."""
        if self._call is not None and not self._args_sent:
            self._emit_args("{}")
        self._call = None

    # ---------------------------------------------------------------- internals
    def _fail(self) -> bool:
        self.failed = True
        return True

    def _step(self, ch: str) -> bool:
        """Read one character; False when it must be read again (after a scalar)."""
        value = self._value
        if value is not None:
            consumed = value.add(ch)
            if self._key in self.arg_keys and self._expect == "value" and consumed:
                self._stream_args(ch)
            if value.done:
                self._value_done()
            return consumed
        if ch in _WHITESPACE:
            return True
        if not self._in_call:
            return self._outside(ch)
        expect = self._expect
        if expect == "key":
            if ch == '"':
                self._value = _Value(ch)
            elif ch == "}":
                self._close_call()
            else:
                self._fail()
        elif expect == "colon":
            if ch == ":":
                self._expect = "value"
            else:
                self._fail()
        elif expect == "value":
            if ch not in '{["' and ch not in _SCALAR_START:
                return self._fail()
            self._value = _Value(ch)
            if self._key in self.arg_keys:
                self._stream_args(ch)
        elif ch == ",":  # expect == "comma"
            self._expect = "key"
        elif ch == "}":
            self._close_call()
        else:
            self._fail()
        return True

    def _outside(self, ch: str) -> bool:
        """A character between call objects."""
        if ch == "{" and all(c == "[" for c in self.stack):
            self.stack.append("{")
            self._in_call, self._expect = True, "key"
            self._key = self._name = None
            self._args_sent, self._args_pending = False, ""
        elif ch == "[" and all(c == "[" for c in self.stack):
            self.stack.append("[")
        elif ch == "]" and self.stack:
            self.stack.pop()
        elif ch not in self.separators:
            self._fail()
        return True

    def _value_done(self) -> None:
        value = self._value
        assert value is not None
        self._value = None
        if self._expect == "key":
            self._key = json.loads(value.raw)
            self._expect = "colon"
            return
        self._expect = "comma"
        key = self._key
        if key == "name" and self._name is None:
            name = json.loads(value.raw) if value.kind == "string" else None
            if not isinstance(name, str) or not name:
                self._fail()
                return
            self._name = name
            self._call = self.parser.new_call(name)
            self.num_calls += 1
            self._out.append(self._call)
            if self._args_pending:
                self._emit_args(self._args_pending)
                self._args_pending = ""
        elif key in self.arg_keys:
            if value.kind == "container":
                return  # already streamed
            if value.kind == "string":
                text = json.loads(value.raw)  # arguments given as a JSON string
            elif value.raw == "null":
                text = "{}"
            else:
                text = value.raw
            if self._call is None:
                self._args_pending = text
            else:
                self._emit_args(text)

    def _stream_args(self, ch: str) -> None:
        """One character of a container argument value."""
        assert self._value is not None
        if self._value.kind != "container":
            return  # released whole once it ends (_value_done)
        if self._call is None:
            self._args_pending += ch
        else:
            self._emit_args(ch)

    def _emit_args(self, text: str) -> None:
        assert self._call is not None
        self._args_sent = True
        last = self._out[-1] if self._out else None
        if last is not None and last.index == self._call.index:
            last.arguments += text
        else:
            self._out.append(ToolCallDelta(self._call.index, arguments=text))

    def _close_call(self) -> None:
        self.stack.pop()
        self._in_call = False
        if self._name is None:
            self._fail()
            return
        self.num_closed += 1
        self.close_open_call()

    def _flush(self) -> list[ToolCallDelta]:
        out, self._out = self._out, []
        return out
