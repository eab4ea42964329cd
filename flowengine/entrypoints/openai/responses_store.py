"""The Responses API's store: finished responses kept in memory, bounded, LRU.

`POST /v1/responses` with `store: true` (OpenAI's default) keeps the response body and
the conversation it answered, for `GET /v1/responses/{id}` and for a later request's
`previous_response_id`. Memory is bounded twice: at most `max_entries` responses and
at most `max_bytes` bytes of text (the encoded body plus the conversation's message
texts, tool calls as JSON text); past either, the least recently used responses (stored, read or continued
longest ago) are dropped first. A response larger than `max_bytes` alone is not
kept. Plain logic, no asyncio: the server's event loop is its only user.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

# Defaults of --responses-store-max and --responses-store-max-bytes.
DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """One finished response.

    Attributes:
        body: the Response object as returned to the client (a JSON-ready dict).
        messages: the conversation it answered, without its `instructions` (OpenAI:
            instructions are not carried over), as chat messages ({"role", "content"},
            plus `tool_calls` / `tool_call_id` where the turn had them).
        output_text: the assistant text it produced.
        num_bytes: what it counts against the store's byte bound.
        turn: its answer as chat messages when it is more than the text (tool calls),
            else None (the answer is {"role": "assistant", "content": output_text}).
    """

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]
    output_text: str
    num_bytes: int
    turn: tuple[dict[str, Any], ...] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """Its messages followed by its answer: the history of a request that names it
        as `previous_response_id`."""
        if self.turn is not None:
            return [*self.messages, *self.turn]
        return [*self.messages, {"role": "assistant", "content": self.output_text}]


def _message_bytes(m: dict[str, Any]) -> int:
    """What one message counts: its role and text, and its tool calls' JSON."""
    extra = sum(len(orjson.dumps(m[k])) for k in ("tool_calls", "tool_call_id") if k in m)
    return len(m["role"]) + len(m["content"]) + extra


class ResponseStore:
    """LRU map from response id to `StoredResponse` (see the module docstring).

    Args:
        max_entries: most responses kept; 0 keeps none (`store: true` is then a no-op
            and every id is unknown).
        max_bytes: most bytes kept (>= 0).

    Raises ValueError for negative bounds.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(
                f"the responses store bounds must be >= 0, got max_entries={max_entries}, "
                f"max_bytes={max_bytes}"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(
        self,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        output_text: str,
        turn: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Keep a finished response under `body["id"]` (replacing one with that id);
        evict LRU entries to stay within bounds. `turn`: the answer as chat messages
        when it made tool calls (kept only then). Returns False if it was not kept (the
        store keeps nothing, or this response alone is over `max_bytes`)."""
        response_id = body["id"]
        if turn is not None and not any("tool_calls" in m for m in turn):
            turn = None  # the text alone is the answer
        num_bytes = (
            len(orjson.dumps(body))
            + sum(_message_bytes(m) for m in messages)
            + len(output_text)
            + sum(_message_bytes(m) for m in turn or ())
        )
        self.delete(response_id)
        if self.max_entries == 0 or num_bytes > self.max_bytes:
            return False
        while self._entries and (
            len(self._entries) >= self.max_entries or self.num_bytes + num_bytes > self.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        self._entries[response_id] = StoredResponse(
            body, tuple(messages), output_text, num_bytes, tuple(turn) if turn else None
        )
        self.num_bytes += num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Drop a response; False if it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def ids(self) -> list[str]:
        """Stored ids, least recently used first."""
        return list(self._entries)
