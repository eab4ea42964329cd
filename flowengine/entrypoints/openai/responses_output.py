"""The output items of one Responses API response, and the stream events that build them.

A run's parsed deltas (chat_adapter.Delta: reasoning text, content text, tool-call
pieces) become OpenAI's output items, in the order the model wrote them:
- reasoning text (with --reasoning-parser): a `reasoning` item, its text in one
  `reasoning_text` content part;
- content text: a `message` item with one `output_text` part;
- each tool call: a `function_call` item (`call_id`, `name`, `arguments`).
A new kind of output closes the open item and opens the next one. Each step returns
the typed events OpenAI streams for it (`response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`, their
`.done` events, `response.output_item.done`) as (type, fields) pairs; a non-streamed
response runs the same steps and keeps only the items, so both have the same output.

Items closed before the end are "completed"; the one open at the end gets the
response's status ("incomplete" when cut by max_output_tokens). Without a parser the
message item opens at once, so a plain stream starts with its item as before any
text. A response that produced no item at all gets an empty message. Pure logic.

Log-probabilities (`include: ["message.output_text.logprobs"]`) travel with the text:
each `output_text.delta` carries those of the tokens generated since the previous one
(with a parser, reasoning and tool-call tokens before a text delta included), and the
message's part holds them all.
"""

from __future__ import annotations

import uuid
from typing import Any

from flowengine.entrypoints.openai.chat_adapter import Delta
from flowengine.entrypoints.openai.tool_parsers import ToolCallDelta

Event = tuple[str, dict[str, Any]]


def call_ids(parser_id: str | None) -> tuple[str, str]:
    """(item id, call_id) of a function call, OpenAI's forms "fc_..." and "call_...",
    from the tool parser's id (its random tail)."""
    tail = (parser_id or uuid.uuid4().hex).rsplit("-", 1)[-1]
    return f"fc_{tail}", f"call_{tail}"


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


class _Item:
    """One output item being built: a message, a reasoning item or a function call."""

    def __init__(self, kind: str, index: int, item_id: str, call_id: str = "", name: str = ""):
        self.kind = kind
        self.index = index
        self.id = item_id
        self.call_id = call_id
        self.name = name
        self.text = ""  # message text, reasoning text or call arguments
        self.logprobs: list[dict[str, Any]] = []
        self.status: str | None = None  # set when closed

    def where(self) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"item_id": self.id, "output_index": self.index}
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def json(self, status: str) -> dict[str, Any]:
        """The item as OpenAI sends it (in progress: with empty content/arguments)."""
        open_ = status == "in_progress"
        if self.kind == "message":
            content = [] if open_ else [output_text_part(self.text, self.logprobs)]
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": content}  # fmt: skip
        if self.kind == "reasoning":
            content = [] if open_ else [reasoning_part(self.text)]
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                    "status": status}  # fmt: skip
        return {"id": self.id, "type": "function_call", "call_id": self.call_id,
                "name": self.name, "arguments": "" if open_ else self.text, "status": status}  # fmt: skip


class ResponseOutput:
    """Builds a response's `output` from a run's deltas (see the module docstring).

    Args:
        plain: no tool or reasoning parser runs (the message opens at once).
        message_id: the id of the first message item ("msg_..."); later ones get
            fresh ids.
    """

    def __init__(self, plain: bool, message_id: str | None = None) -> None:
        self.plain = plain
        self._message_id = message_id
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, _Item] = {}  # parser call index -> item
        self._pending_logprobs: list[dict[str, Any]] = []
        self.final: list[dict[str, Any]] | None = None

    def start(self) -> list[Event]:
        """Events at the start of the output (the plain message item)."""
        return self._switch("message") if self.plain else []

    def feed(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[Event]:
        """Events for one delta; `logprobs` are its tokens' entries (OpenAI's form)."""
        events: list[Event] = []
        self._pending_logprobs.extend(logprobs)
        if delta.reasoning:
            events += self._switch("reasoning")
            item = self._open
            assert item is not None
            item.text += delta.reasoning
            events.append(("response.reasoning_text.delta",
                           {**item.where(), "delta": delta.reasoning}))  # fmt: skip
        # Within one delta: the open call's last fragments come before any text, and
        # text before a call that starts in it.
        known = set(self._calls)
        going = [p for p in delta.tool_calls if p.index in known]
        for piece in going:
            events += self._tool_piece(piece)
        if delta.text or (self.plain and logprobs):
            events += self._switch("message")
            events.append(self._text_delta(delta.text))
        for piece in delta.tool_calls:
            if piece.index not in known:
                events += self._tool_piece(piece)
        return events

    def finish(self, status: str) -> list[Event]:
        """Events that close the output; `status` is the response's ("completed" or
        "incomplete"), given to the item still open. Sets `final`."""
        events: list[Event] = []
        if self._pending_logprobs and self._open is not None and self._open.kind == "message":
            events.append(self._text_delta(""))
        if not self.items:
            events += self._switch("message")
        events += self._close(status)
        self.final = [item.json(item.status or status) for item in self.items]
        return events

    def _text_delta(self, text: str) -> Event:
        item = self._open
        assert item is not None and item.kind == "message"
        item.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        item.logprobs.extend(logprobs)
        return ("response.output_text.delta", {**item.where(), "delta": text, "logprobs": logprobs})

    def _tool_piece(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        item = self._calls.get(piece.index)
        if item is None:
            item_id, call_id = call_ids(piece.id)
            events += self._close("completed")
            item = _Item("function_call", len(self.items), item_id, call_id, piece.name or "")
            self._add(item)
            self._calls[piece.index] = item
            events.append(("response.output_item.added",
                           {"output_index": item.index, "item": item.json("in_progress")}))  # fmt: skip
        if piece.arguments:
            item.text += piece.arguments
            events.append(("response.function_call_arguments.delta",
                           {**item.where(), "delta": piece.arguments}))  # fmt: skip
        return events

    def _add(self, item: _Item) -> None:
        self.items.append(item)
        self._open = item

    def _switch(self, kind: str) -> list[Event]:
        """Close the open item unless it is of `kind`, and open one of `kind`."""
        if self._open is not None and self._open.kind == kind:
            return []
        events = self._close("completed")
        if kind == "message":
            item_id = self._message_id or f"msg_{uuid.uuid4().hex}"
            self._message_id = None
        else:
            item_id = f"rs_{uuid.uuid4().hex}"
        item = _Item(kind, len(self.items), item_id)
        self._add(item)
        events.append(("response.output_item.added",
                       {"output_index": item.index, "item": item.json("in_progress")}))  # fmt: skip
        if kind == "message":
            part = output_text_part("")
        else:
            part = reasoning_part("")
        events.append(("response.content_part.added", {**item.where(), "part": part}))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = item.where()
        if item.kind == "message":
            part = output_text_part(item.text, item.logprobs)
            events: list[Event] = [
                ("response.output_text.done", {**where, "text": item.text,
                                               "logprobs": item.logprobs}),
                ("response.content_part.done", {**where, "part": part}),
            ]  # fmt: skip
        elif item.kind == "reasoning":
            events = [
                ("response.reasoning_text.done", {**where, "text": item.text}),
                ("response.content_part.done", {**where, "part": reasoning_part(item.text)}),
            ]
        else:
            events = [("response.function_call_arguments.done",
                       {**where, "name": item.name, "arguments": item.text})]  # fmt: skip
        events.append(("response.output_item.done",
                       {"output_index": item.index, "item": item.json(status)}))  # fmt: skip
        return events
