"""Tool calls that are the whole output, as JSON: Llama 3's `llama3_json` format and
the output of `tool_choice=required` / a named function (a grammar makes it).

- `llama3_json` (Llama 3.1-3.3 JSON tool calling, vLLM's parser of that name): the
  output is `{"name": ..., "parameters": {...}}`, several separated by `;`, optionally
  after `<|python_tag|>`. An output that does not start with `{` is content.
- `RequiredToolParser`: `tool_choice=required`, the array vLLM's schema asks for,
  `[{"name": ..., "parameters": {...}}, ...]` (flowengine/entrypoints/openai/
  tool_parsers/request.py builds the schema).
- `NamedToolParser`: `tool_choice` naming a function: the output is that function's
  arguments object.
Output that breaks before a call's name is content (see base.py).
"""

from __future__ import annotations

from flowengine.entrypoints.openai.tool_parsers.base import (
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    add_piece,
)
from flowengine.entrypoints.openai.tool_parsers.json_calls import JsonCallScanner


class WholeTextJsonToolParser(ToolParser):
    """The whole output (after optional leading whitespace and `prefix`) is JSON calls
    when it starts with one of `first_chars`; otherwise it is content."""

    first_chars = "{["
    prefix = ""
    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    separators = ",;"

    def __init__(self) -> None:
        super().__init__()
        self._raw = ""  # everything so far, while it may still turn out to be content
        self._mode = "start"  # start | calls | text | skip
        self._scanner = JsonCallScanner(self, self.arg_keys, self.separators)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "start":
            self._raw += text
            head = self._raw.lstrip()
            if self.prefix and head.startswith(self.prefix):
                head = head[len(self.prefix):].lstrip()
            elif self.prefix and self.prefix.startswith(head):
                return out  # maybe the prefix, arriving
            if not head:
                return out
            if head[0] not in self.first_chars:
                self._mode = "text"
                out.content += self.gate.push(self._raw)
                self._raw = ""
                return out
            self._mode = "calls"
            text = head  # _raw already holds it
        elif self._mode == "calls" and self._scanner.num_calls == 0:
            self._raw += text
        if self._mode == "text":
            out.content += self.gate.push(text)
        elif self._mode == "calls":
            out.tool_calls.extend(self._scanner.feed(text))
            if self._scanner.num_calls:
                self._raw = ""
            if self._scanner.failed:
                self._broken(out)
        return out

    def _broken(self, out: ParsedDelta) -> None:
        if self._scanner.num_calls == 0:
            self._mode = "text"
            out.content += self.gate.push(self._raw)
        else:
            self._scanner.close_open_call()
            out.tool_calls.extend(self._scanner.finish())
            self._mode = "skip"
        self._raw = ""

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "start":
            out.content += self.gate.push(self._raw)  # whitespace, or a partial prefix
        elif self._mode == "calls":
            out.tool_calls.extend(self._scanner.finish())
            if self._scanner.num_calls == 0:
                out.content += self.gate.push(self._raw)
        self._raw = ""
        out.content += self.gate.finish()
        return out


class Llama3JsonToolParser(WholeTextJsonToolParser):
    name = "llama3_json"
    first_chars = "{"
    prefix = "<|python_tag|>"


class RequiredToolParser(WholeTextJsonToolParser):
    """`tool_choice=required`: an array of {"name", "parameters"} objects."""

    name = "required"
    first_chars = "["
    arg_keys = ("parameters",)
    separators = ","


class NamedToolParser(ToolParser):
    """`tool_choice` naming a function: the whole output is its arguments object
    (leading and trailing whitespace dropped)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name
        self._started = False
        self._held = ""  # trailing whitespace: inside the object or after it

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            text = text.lstrip()
            if not text:
                return out
            self._started = True
            out.tool_calls.append(self.new_call(self.function_name))
        stripped = text.rstrip()
        if stripped:  # the call's first arguments join its id/name entry
            add_piece(out.tool_calls, self._args(self._held + stripped))
            self._held = text[len(stripped):]
        else:
            self._held += text
        return out

    def _args(self, text: str) -> ToolCallDelta:
        return ToolCallDelta(0, arguments=text)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:  # nothing generated (e.g. max_tokens cut at once)
            self._started = True
            out.tool_calls.append(self.new_call(self.function_name, "{}"))
        return out
