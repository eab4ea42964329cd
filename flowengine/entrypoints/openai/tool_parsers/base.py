"""What every tool-call parser shares: the delta types, the content gate, the base class.

A parser turns the model's text into OpenAI's assistant message parts: `content` and
`tool_calls` (each an id, a function name and its `arguments` as JSON text). It is one
incremental state machine per choice: `feed(text)` takes the next text delta and
returns what may be sent now, `finish()` what is left at the end. The non-streamed
message is the same machine fed the whole text at once (`extract`), so a streamed
response's deltas join to exactly the non-streamed message, however the text was cut.

Rules all formats follow (OpenAI's and vLLM's behaviour where they define one):
- `arguments` is the model's own JSON text of the arguments object (whitespace kept),
  sent in fragments as it is generated; a call without arguments gets "{}".
- A call is reported from the moment its name is complete. Output that breaks the
  format before that (malformed JSON, a missing name) is plain content, as if no tool
  had been called; output that breaks it later ends that call where it broke.
- Whitespace that only separates content from tool calls is not content: a run of
  whitespace is held until more content follows; at a tool call or at the end (after
  tool calls) it is dropped. Without tool calls the text is returned unchanged.

Pure logic: no asyncio, no I/O.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import ClassVar


def random_tool_call_id() -> str:
    """vLLM's tool call id form: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """One piece of a tool call (OpenAI's `delta.tool_calls[i]`): the first piece of a
    call has its `id` and `name`, later ones only `arguments` fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_json(self) -> dict:
        body: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            body["id"] = self.id
            body["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        body["function"] = function
        return body


def add_piece(pieces: list[ToolCallDelta], piece: ToolCallDelta) -> None:
    """Add `piece` to the pieces of one chunk, merged into the entry of its index when
    there is one: OpenAI and vLLM send one `delta.tool_calls` entry per index per
    chunk (the call's first one with id, type, name and its first arguments text)."""
    for have in pieces:
        if have.index == piece.index:
            have.id = have.id if have.id is not None else piece.id
            have.name = have.name if have.name is not None else piece.name
            have.arguments += piece.arguments
            return
    pieces.append(piece)


@dataclass
class ParsedDelta:
    """What a parser releases for one text delta: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        for piece in other.tool_calls:
            add_piece(self.tool_calls, piece)


@dataclass
class ToolCall:
    """A complete tool call of the non-streamed message."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """The non-streamed result: content (None when empty) and the calls in order."""

    content: str | None
    tool_calls: list[ToolCall]


def join_deltas(deltas: list[ParsedDelta]) -> ExtractedToolCalls:
    """Fold parser deltas into the message they stream (what a client reassembles)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                call = calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
            call.arguments += piece.arguments
    return ExtractedToolCalls(content or None, [calls[i] for i in sorted(calls)])


class ContentGate:
    """Releases content text with the whitespace rule of the module docstring."""

    def __init__(self) -> None:
        self._held = ""  # a run of whitespace that may only separate content from calls
        self.num_calls = 0  # tool calls seen so far

    def push(self, text: str) -> str:
        """Content text that may be released now."""
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self._held += text
            return ""
        out = self._held + stripped
        self._held = text[len(stripped):]
        return out

    def at_tool_call(self) -> None:
        """A tool call starts here: the whitespace before it is not content."""
        self._held = ""
        self.num_calls += 1

    def finish(self) -> str:
        """End of the text: held whitespace is content only if no call was made."""
        held, self._held = self._held, ""
        return held if self.num_calls == 0 else ""


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`
    (text that must be held back: the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base of the tool-call parsers; one instance per choice of one request.

    Subclasses implement `feed` and `finish`. Class attributes:
        name: the `--tool-call-parser` name.
        skip_special_tokens: None, or the value the request's detokenizer must use
            because the format's markers are special tokens (Mistral's [TOOL_CALLS]).
    """

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool | None] = None

    def __init__(self) -> None:
        self.gate = ContentGate()
        self._next_index = 0

    def new_call(self, name: str, arguments: str = "") -> ToolCallDelta:
        """The first piece of the next tool call (a fresh id and index)."""
        self.gate.at_tool_call()
        delta = ToolCallDelta(self._next_index, self.make_id(), name, arguments)
        self._next_index += 1
        return delta

    def make_id(self) -> str:
        return random_tool_call_id()

    @property
    def num_calls(self) -> int:
        return self._next_index

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    @classmethod
    def extract(cls, text: str, *args: object, **kwargs: object) -> ExtractedToolCalls:
        """Parse a whole model output (the non-streamed message)."""
        parser = cls(*args, **kwargs)  # type: ignore[arg-type]
        return join_deltas([parser.feed(text), parser.finish()])
