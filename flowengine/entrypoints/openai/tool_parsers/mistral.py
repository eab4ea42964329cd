"""Mistral tool calls: content, then `[TOOL_CALLS]` and the calls, in either of the
forms Mistral's tokenizers define (vLLM's `mistral` parser reads both):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v3-v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{}      (v11+)

`[TOOL_CALLS]` and `[ARGS]` are special tokens, so requests parsed with this format
are detokenized with skip_special_tokens=False (as vLLM's parser asks), and the end
of sequence marker `</s>`, if it shows, is dropped. Mistral wants tool call ids of 9
letters and digits.
"""

from __future__ import annotations

import random
import re
import string

from flowengine.entrypoints.openai.tool_parsers.base import (
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    partial_suffix,
)
from flowengine.entrypoints.openai.tool_parsers.json_calls import JsonCallScanner, _Value

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    eos = "</s>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = "text"  # text | head | json | name | args | skip
        self._raw = ""  # text of the current [TOOL_CALLS] section (content if it breaks)
        self._scanner: JsonCallScanner | None = None
        self._value: _Value | None = None
        self._call: ToolCallDelta | None = None

    def make_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text.replace(self.eos, "")
        out = ParsedDelta()
        while self._buf and self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Advance on the buffer; False when more text is needed."""
        buf, mode = self._buf, self._mode
        if mode in ("text", "skip"):
            at = buf.find(self.marker)
            if at == -1:
                keep = partial_suffix(buf, self.marker)
                if mode == "text":
                    out.content += self.gate.push(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            if mode == "text":
                out.content += self.gate.push(buf[:at])
            self._buf, self._mode, self._raw = buf[at + len(self.marker):], "head", ""
            return True
        if mode == "head":  # what follows [TOOL_CALLS] tells the form
            head = buf.lstrip()
            if not head:
                return False
            self._raw += buf[: len(buf) - len(head)]
            self._buf = head
            if head[0] in "[{":
                self._mode, self._scanner = "json", JsonCallScanner(self, ("arguments",), ",")
            else:
                self._mode = "name"
            return True
        if mode == "json":
            assert self._scanner is not None
            at = buf.find(self.marker)
            piece = buf if at == -1 else buf[:at]
            piece = piece[: len(piece) - partial_suffix(piece, self.marker)] if at == -1 else piece
            self._raw += piece
            out.tool_calls.extend(self._scanner.feed(piece))
            self._buf = buf[len(piece):]
            if self._scanner.failed:
                return self._broken(out, self._scanner.num_calls)
            if at == -1:
                return False
            out.tool_calls.extend(self._scanner.finish())
            self._mode = "text"
            return True
        if mode == "name":
            at = buf.find(self.args_marker)
            if at == -1:
                if buf.find(self.marker) != -1 or not _NAME.match(buf) and buf.strip():
                    return self._broken(out, 0)
                return False
            name = buf[:at].strip()
            self._raw += buf[: at + len(self.args_marker)]
            self._buf = buf[at + len(self.args_marker):]
            if not _NAME.fullmatch(name):
                return self._broken(out, 0)
            self._call = self.new_call(name)
            out.tool_calls.append(self._call)
            self._mode, self._value = "args", None
            return True
        # mode == "args": one JSON value, streamed while it is an object or array
        assert self._call is not None
        i = 0
        while i < len(buf):
            ch = buf[i]
            if self._value is None:
                if ch in " \t\n\r":
                    i += 1
                    continue
                if ch not in "{[":
                    break  # not a JSON object: the call ends here
                self._value = _Value(ch)
                self._emit(out, ch)
            elif self._value.add(ch):
                self._emit(out, ch)
            i += 1
            if self._value is not None and self._value.done:
                break
        self._buf = buf[i:]
        if self._value is not None and not self._value.done:
            return False
        if self._value is None and i == len(buf):
            return False
        if self._value is None:
            self._emit(out, "{}")
        self._mode, self._call, self._value = "text", None, None
        return True

    def _emit(self, out: ParsedDelta, text: str) -> None:
        assert self._call is not None
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self._call.index:
            last.arguments += text
        else:
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments=text))

    def _broken(self, out: ParsedDelta, num_calls: int) -> bool:
        if num_calls == 0:  # the section was text
            out.content += self.gate.push(self.marker + self._raw)
            self._mode = "text"  # the rest of the buffer is read as text
            return True
        assert self._scanner is not None
        self._scanner.close_open_call()
        out.tool_calls.extend(self._scanner.finish())
        self._mode = "skip"
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._buf and self._step(out):
            pass
        mode = self._mode
        if mode == "text":
            out.content += self.gate.push(self._buf)
        elif mode == "head":
            out.content += self.gate.push(self.marker + self._raw + self._buf)
        elif mode == "json":
            assert self._scanner is not None
            out.tool_calls.extend(self._scanner.finish())
            if self._scanner.num_calls == 0:
                out.content += self.gate.push(self.marker + self._raw + self._buf)
        elif mode == "name":
            out.content += self.gate.push(self.marker + self._raw + self._buf)
        elif mode == "args" and self._value is None:
            self._emit(out, "{}")
        self._buf = ""
        out.content += self.gate.finish()
        return out
