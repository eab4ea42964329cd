"""The content blocks of one Anthropic Messages answer, and the stream events that
build them.

A run's parsed deltas (chat_adapter.Delta) become Anthropic's blocks in the order the
model wrote them: reasoning text (with --reasoning-parser) a `thinking` block, content
text a `text` block, each tool call a `tool_use` block (`id`, `name`, `input`). A new
kind of output stops the open block and starts the next. Streamed, each block is
`content_block_start` (the block empty: `thinking: ""`, `text: ""`, `input: {}`),
`content_block_delta` events (`thinking_delta`, `text_delta`, `input_json_delta` with
the arguments' JSON text in fragments, which join to the block's `input`), and
`content_block_stop`; a non-streamed answer runs the same steps and keeps the blocks.
Without a parser the text block starts at once (index 0), as before any text; an
answer with no block at all gets an empty text block.

Thinking blocks carry `signature: ""`: there is no signature to verify (the blocks are
the model's own text); a client sends them back unchanged and they are not rendered.
A call's `input` is its arguments parsed as a JSON object; a call cut by max_tokens
has arguments that do not parse, and its non-streamed `input` is then {} (the
streamed fragments hold what was generated). Pure logic.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from flowengine.entrypoints.openai.chat_adapter import Delta
from flowengine.entrypoints.openai.tool_parsers import ToolCallDelta

Event = tuple[str, dict[str, Any]]


def tool_use_id(parser_id: str | None) -> str:
    """Anthropic's id form "toolu_..." from the tool parser's id (its random tail)."""
    return "toolu_" + (parser_id or uuid.uuid4().hex).rsplit("-", 1)[-1]


def call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the `input` object; {} when they do not parse
    as an object (a call cut short)."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class _Block:
    def __init__(self, kind: str, index: int, block_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.index = index
        self.id = block_id
        self.name = name
        self.text = ""  # text, thinking or the call's arguments

    def start_json(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "text": ""}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def json(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": self.text, "signature": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name,
                "input": call_input(self.text)}  # fmt: skip


class MessageContent:
    """Builds an answer's `content` from a run's deltas (see the module docstring).

    Args:
        plain: no tool or reasoning parser runs (the text block starts at once).
    """

    def __init__(self, plain: bool) -> None:
        self.plain = plain
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, _Block] = {}  # parser call index -> block

    @property
    def num_tool_uses(self) -> int:
        return len(self._calls)

    def start(self) -> list[Event]:
        return self._switch("text") if self.plain else []

    def feed(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._switch("thinking")
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning},
                                      delta.reasoning))  # fmt: skip
        # Within one delta: the open call's last fragments come before any text, and
        # text before a call that starts in it.
        known = set(self._calls)
        going = [p for p in delta.tool_calls if p.index in known]
        events += self._tool_pieces(going)
        if delta.text:
            events += self._switch("text")
            events.append(self._delta({"type": "text_delta", "text": delta.text}, delta.text))
        events += self._tool_pieces([p for p in delta.tool_calls if p.index not in known])
        return events

    def _tool_pieces(self, pieces: list[ToolCallDelta]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            block = self._calls.get(piece.index)
            if block is None:
                events += self._stop()
                block = _Block("tool_use", len(self.blocks), tool_use_id(piece.id),
                               piece.name or "")  # fmt: skip
                self._calls[piece.index] = block
                events += self._begin(block)
            if piece.arguments:
                block.text += piece.arguments
                events.append(("content_block_delta", {
                    "type": "content_block_delta", "index": block.index,
                    "delta": {"type": "input_json_delta", "partial_json": piece.arguments},
                }))  # fmt: skip
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if not self.blocks:
            events += self._switch("text")
        return events + self._stop()

    def json(self) -> list[dict[str, Any]]:
        return [b.json() for b in self.blocks]

    def _delta(self, body: dict[str, Any], text: str) -> Event:
        block = self._open
        assert block is not None
        block.text += text
        return ("content_block_delta",
                {"type": "content_block_delta", "index": block.index, "delta": body})  # fmt: skip

    def _begin(self, block: _Block) -> list[Event]:
        self.blocks.append(block)
        self._open = block
        return [("content_block_start", {"type": "content_block_start", "index": block.index,
                                         "content_block": block.start_json()})]  # fmt: skip

    def _switch(self, kind: str) -> list[Event]:
        if self._open is not None and self._open.kind == kind:
            return []
        return self._stop() + self._begin(_Block(kind, len(self.blocks)))

    def _stop(self) -> list[Event]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [("content_block_stop", {"type": "content_block_stop", "index": block.index})]
