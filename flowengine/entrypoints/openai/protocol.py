"""Request bodies of the OpenAI routes, as msgspec structs (validation + OpenAPI schema).

Field names, types and defaults follow the OpenAI API reference (Completions, Chat
Completions) plus vLLM's extra sampling fields (`top_k`, `min_p`, ...), which the
`openai` SDK sends through `extra_body`. Unknown fields are ignored, as OpenAI and
vLLM do; fields we know but cannot honour (`suffix`, `tools`, `logit_bias`, ...) are
declared here so the handlers can answer 400 when they are set.

Decoding with `msgspec.json.decode(body, type=...)` raises `msgspec.ValidationError`
naming the field (`... - at $.messages[0].role`), which becomes a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """`include_usage`: one extra chunk before `[DONE]` with `usage` and no choices."""

    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields that both generation routes accept (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (same names and meanings as SamplingParams).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions.

    `prompt` is a string, a list of strings, a list of token ids, or a list of
    token-id lists (each prompt one request; choice index = prompt index * n + sample).
    `logprobs` asks for that many top log-probabilities per token (0-5).
    """

    prompt: str | list[str | int | list[int]]
    max_tokens: NonNegInt | None = 16
    echo: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message; `content` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions.

    `max_completion_tokens` (or the older `max_tokens`) caps the answer; unset, it runs
    to EOS or the context limit. `logprobs: true` with `top_logprobs` 0-20 returns
    per-token log-probabilities in OpenAI's chat format.
    """

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize with a prompt (vLLM's shape)."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize with messages: the chat template is applied first (vLLM's shape)."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    tokens: list[NonNegInt]
    model: str | None = None


REQUEST_TYPES: tuple[type, ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
