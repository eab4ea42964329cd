"""Response bodies of the OpenAI routes, as msgspec structs: the OpenAPI schema.

The handlers build plain dicts and encode them with orjson (fast, and `null` fields
stay explicit as OpenAI sends them). These structs document those shapes; they use
`forbid_unknown_fields` so the tests can decode every response strictly against them,
which keeps schema and wire in step. Shapes follow OpenAI's API reference (chat
completion object, chat completion chunk, completion object) and vLLM's tokenizer
routes; `stop_reason` is vLLM's extra field (the stop string or token id that ended a
choice), and so is `prompt_logprobs` (requests that set `prompt_logprobs`).
"""

from __future__ import annotations

import msgspec


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ResponseFunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of the arguments object


class ResponseToolCall(_Strict):
    id: str
    type: str  # "function"
    function: ResponseFunctionCall


class AssistantMessage(_Strict):
    """`content` is null when the model only called tools; `reasoning_content` (vLLM's
    field, with --reasoning-parser) holds the text of its <think> block."""

    role: str
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None


class PromptLogprob(_Strict):
    """vLLM's Logprob of one prompt-token candidate."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt token: None for the first, then {token id (a string): PromptLogprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(_Strict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Strict):
    id: str
    object: str  # "chat.completion"
    created: int  # Unix seconds
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(_Strict):
    name: str | None = None
    arguments: str | None = None  # a fragment; a call's fragments join to its arguments


class DeltaToolCall(_Strict):
    """A piece of tool call `index`: the first has `id`, `type` and the name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Strict):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(_Strict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Strict):
    """One SSE event of a streamed chat completion ("chat.completion.chunk")."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Strict):
    """Legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Strict):
    """A completion ("text_completion"); streamed chunks have the same shape."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Strict):
    id: str
    object: str  # "model"
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Strict):
    object: str  # "list"
    data: list[ModelCard]


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Strict):
    prompt: str


class VersionResponse(_Strict):
    version: str


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Strict):
    error: ErrorDetail
