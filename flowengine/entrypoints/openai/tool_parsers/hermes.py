"""Hermes-style tool calls (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3 templates):

    Some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each `<tool_call>...</tool_call>` region holds one JSON call object (a list of them is
accepted too); text outside the regions is content. A region whose JSON breaks before
the call's name is content, tags included; an unclosed region at the end of the output
(a cut by max_tokens) ends the call there. vLLM's `hermes` parser reads the same format.
"""

from __future__ import annotations

from flowengine.entrypoints.openai.tool_parsers.base import (
    ParsedDelta,
    ToolParser,
    partial_suffix,
)
from flowengine.entrypoints.openai.tool_parsers.json_calls import JsonCallScanner


class TaggedJsonToolParser(ToolParser):
    """JSON calls between a start and an end tag, anywhere in the text."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet decided
        self._mode = "text"  # text | call | skip (a broken call: drop to the end tag)
        self._scanner: JsonCallScanner | None = None
        self._region = ""  # raw text of the current region (content if it breaks early)

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._buf:
            if self._mode == "text":
                at = self._buf.find(self.start_tag)
                if at == -1:
                    keep = partial_suffix(self._buf, self.start_tag)
                    out.content += self.gate.push(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.content += self.gate.push(self._buf[:at])
                self._buf = self._buf[at + len(self.start_tag):]
                self._mode, self._region = "call", ""
                self._scanner = JsonCallScanner(self)
            elif self._mode == "skip":
                at = self._buf.find(self.end_tag)
                if at == -1:
                    self._buf = self._buf[len(self._buf) - partial_suffix(self._buf, self.end_tag):]
                    break
                self._buf, self._mode = self._buf[at + len(self.end_tag):], "text"
            elif not self._read_call(out):
                break
        return out

    def _read_call(self, out: ParsedDelta, at_end: bool = False) -> bool:
        """Feed the scanner up to the end tag (or, `at_end`, the end of the text).
        False: more text is needed."""
        scanner = self._scanner
        assert scanner is not None
        buf = self._buf
        end, found, i = len(buf), False, 0
        # Feed the text up to each '<' and look for the end tag there, outside strings.
        while i < len(buf) and not scanner.failed:
            j = buf.find("<", i)
            j = len(buf) if j == -1 else j
            out.tool_calls.extend(scanner.feed(buf[i:j]))
            i = j
            if j == len(buf) or scanner.failed:
                break
            if not scanner.in_string:
                if buf.startswith(self.end_tag, j):
                    end, found = j, True
                    break
                if not at_end and self.end_tag.startswith(buf[j:]):
                    end = j  # maybe the end tag, arriving
                    break
            out.tool_calls.extend(scanner.feed("<"))
            i = j + 1
        closed = found or at_end
        self._region += buf[:end] if not scanner.failed else buf[:i]
        rest = buf[end:] if not scanner.failed else buf[i:]
        if scanner.failed:
            if scanner.num_calls == 0:
                # Nothing was reported: the region was text. Read it again as text, so
                # that a later <tool_call> in it is still found.
                out.content += self.gate.push(self.start_tag)
                self._buf, self._mode = self._region + rest, "text"
                return True
            scanner.close_open_call()
            out.tool_calls.extend(scanner.finish())
            self._buf, self._mode = rest, "skip"
            return True
        self._buf = rest
        if not closed:
            return False
        if found:
            self._buf = rest[len(self.end_tag):]
        out.tool_calls.extend(scanner.finish())
        if scanner.num_calls == 0:  # e.g. an empty region: text as it was
            out.content += self.gate.push(self.start_tag + self._region + (self.end_tag if found else ""))
        self._mode = "text"
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        # The end of the text ends an open region; a region that breaks is read again
        # as text, which may hold further regions.
        while self._buf or self._mode == "call":
            if self._mode == "call":
                self._read_call(out, at_end=True)
            elif self._mode == "text":
                before = self._buf
                out.extend(self.feed(""))
                if self._buf == before:  # only a partial start tag is left: text
                    out.content += self.gate.push(self._buf)
                    self._buf = ""
            else:  # skip: nothing after a broken call is kept
                self._buf = ""
        out.content += self.gate.finish()
        return out


class HermesToolParser(TaggedJsonToolParser):
    name = "hermes"
