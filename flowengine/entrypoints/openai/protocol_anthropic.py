"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): request
and response bodies as msgspec structs (validation, OpenAPI schema, strict decoding in
the tests).

Field names, types and requirements follow Anthropic's API reference ("Messages",
"Count Message tokens", "Streaming Messages", "Errors"): `model`, `messages` and
`max_tokens` are required on /v1/messages, as Anthropic requires. Unknown fields are
ignored. Content blocks are `text`, `tool_use` (assistant), `tool_result` (user) and
`thinking` / `redacted_thinking` (assistant, sent back and not rendered); others
(`image`, `document`, ...) are refused by the handler with a 400 naming the block, and
so are server tools (web search, code execution, ...): custom tools ({name,
description, input_schema}) are served. `output_config.format` (structured outputs)
is typed null. `temperature`, `top_p` and `top_k` are accepted (newer `anthropic`
SDKs send them through `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from flowengine.entrypoints.openai.protocol import Int64, PosInt


class ToolResultPart(msgspec.Struct, kw_only=True):
    """One block of a `tool_result`'s content; only text blocks are served."""

    type: str
    text: str | None = None


class ContentBlock(msgspec.Struct, kw_only=True):
    """One content block: `text` (text), `tool_use` (id, name, input: a call the
    assistant made), `tool_result` (tool_use_id, content: a string or text blocks,
    is_error), `thinking` (thinking, signature) or `redacted_thinking` (data)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class AnthropicMessage(msgspec.Struct, kw_only=True):
    """One turn: `content` is a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Metadata(msgspec.Struct, kw_only=True):
    """`metadata.user_id`: an opaque id of the end user (accepted, not used)."""

    user_id: str | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    """`output_config`: `effort` is accepted and has no effect (no reasoning models are
    served with thinking); `format` (structured outputs) is not served: null only."""

    effort: str | None = None
    format: None = None


class AnthropicTool(msgspec.Struct, kw_only=True):
    """One entry of `tools`: a custom tool (`type` omitted or "custom") with
    `input_schema` a JSON Schema of an object. Server tools (a `type` such as
    "web_search_20250305") are refused by the handler."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice`: auto (the model decides), any (it must call a tool), tool (it
    must call `name`), none; `disable_parallel_tool_use` allows at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    """`thinking`: "enabled" (needs the server's --reasoning-parser; `budget_tokens`
    is required, >= 1024 and < max_tokens as Anthropic requires, checked by the
    handler, and not enforced on the output) or "disabled"."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Int64 | None = None


class _MessagesInput(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(_MessagesInput, kw_only=True):
    """POST /v1/messages.

    `system` is a string or a list of text blocks (joined with newlines) and becomes a
    system message before `messages`. `max_tokens` (required) caps the output;
    `stop_sequences` are stop strings (not included in the output; the one that matched
    is the response's `stop_sequence`). `top_k` and `temperature` as in SamplingParams.
    """

    max_tokens: PosInt
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(_MessagesInput, kw_only=True):
    """POST /v1/messages/count_tokens: the same conversation fields, no sampling."""


# ---------------------------------------------------------------- response bodies


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TextBlock(_Strict, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(_Strict, tag="tool_use", tag_field="type"):
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Strict, tag="thinking", tag_field="type"):
    thinking: str
    signature: str  # always "": nothing to verify


class AnthropicUsage(_Strict):
    input_tokens: int
    output_tokens: int


class MessageResponse(_Strict):
    """Anthropic's Message object ("message")."""

    id: str
    type: str  # "message"
    role: str  # "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock | ThinkingBlock]
    stop_reason: str | None  # "end_turn" | "max_tokens" | "stop_sequence" | "tool_use"
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(_Strict):
    input_tokens: int


class AnthropicErrorDetail(_Strict):
    type: str  # "invalid_request_error", "authentication_error", ...
    message: str


class AnthropicErrorResponse(_Strict):
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""

    type: Literal["error"]
    error: AnthropicErrorDetail
