"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): request
and response bodies as msgspec structs (validation, OpenAPI schema, strict decoding in
the tests).

Field names, types and requirements follow Anthropic's API reference ("Messages",
"Count Message tokens", "Streaming Messages", "Errors"): `model`, `messages` and
`max_tokens` are required on /v1/messages, as Anthropic requires. Unknown fields are
ignored. Content blocks other than text (`tool_use`, `tool_result`, `image`,
`document`, `thinking`, ...) and `tools` are refused by the handler with a 400 naming
the block, until tool calling exists; so is `thinking` other than disabled, and
`output_config.format` (structured outputs) is typed null. `temperature`, `top_p` and
`top_k` are accepted (newer `anthropic` SDKs send them through `extra_body`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from flowengine.entrypoints.openai.protocol import Int64, PosInt


class ContentBlock(msgspec.Struct, kw_only=True):
    """One content block; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


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


class _MessagesInput(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[AnthropicMessage], msgspec.Meta(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


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


class TextBlock(_Strict):
    type: str  # "text"
    text: str


class AnthropicUsage(_Strict):
    input_tokens: int
    output_tokens: int


class MessageResponse(_Strict):
    """Anthropic's Message object ("message")."""

    id: str
    type: str  # "message"
    role: str  # "assistant"
    model: str
    content: list[TextBlock]
    stop_reason: str | None  # "end_turn" | "max_tokens" | "stop_sequence"
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
