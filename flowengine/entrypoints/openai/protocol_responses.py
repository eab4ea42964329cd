"""POST /v1/responses (OpenAI's Responses API): request and response bodies as msgspec
structs (validation, OpenAPI schema, and the tests' strict decoding).

Field names, types and defaults follow OpenAI's API reference ("Create a model
response", the Response object, the streaming events) plus vLLM's extra sampling
fields (`top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`, `ignore_eos`,
`priority`, `cache_salt`), which the `openai` SDK sends through `extra_body`. Unknown
fields are ignored, as OpenAI and vLLM do. Fields that would change the output and
are not served yet (`reasoning`, `conversation`, `prompt`) are typed `null`: any
other value is a 400 naming the field; tools other than function tools, `background`,
`include` values other than "message.output_text.logprobs" and `truncation: "auto"`
are refused by the handler, also with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from flowengine.entrypoints.openai.protocol import Int64, NonNegInt, PosInt

# Fields refused while null is the only value served (see the module docstring).
RESPONSES_UNSUPPORTED_FIELDS = frozenset({"reasoning", "conversation", "prompt"})
# `include` values served: the output text's log-probabilities (OpenAI's name).
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class InputContentPart(msgspec.Struct, kw_only=True):
    """One content part of an input message: `input_text` (user, system, developer)
    or `output_text` (an assistant message replayed from an earlier response)."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`:

    - a message (`type` "message" or omitted, OpenAI's EasyInputMessage) with string
      or part-list `content`;
    - `function_call`: a call the model made earlier (`call_id`, `name`, `arguments`
      as JSON text), as the `function_call` output item returned it;
    - `function_call_output`: the result of call `call_id` (`output`, text or
      `input_text` parts);
    - `reasoning`: an earlier reasoning output item, accepted so that a client can send
      a response's `output` back whole; it is not rendered (chat templates drop earlier
      turns' reasoning).
    Other item types are refused with a 400 naming the item.
    """

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    """One entry of `tools`: OpenAI's function tool, flat (`name`, `description`,
    `parameters` a JSON Schema of an object, `strict`). Built-in tools (web_search,
    file_search, ...) are refused by the handler with a 400 naming the tool."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: `text` (plain), `json_object` (any JSON object) or `json_schema`
    (JSON valid against `schema`, constrained whatever `strict` says; OpenAI's flat
    form of the chat route's `response_format.json_schema`, run as that)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    """`text`: the output's `format` (structured outputs, as the chat route's)."""

    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses.

    `input` is a string (one user message) or a list of message items;
    `instructions` becomes a system message before them ("" is none: the chat template's
    default system prompt applies, as in vLLM); it is not carried over by
    `previous_response_id`, as OpenAI documents. `max_output_tokens` caps the output
    (unset: to EOS or the context limit). `store` (default true) keeps the response
    in the server's bounded in-memory store for `GET /v1/responses/{id}` and
    `previous_response_id`. `include: ["message.output_text.logprobs"]` returns each
    output token's log-probability, with `top_logprobs` (0-20) alternatives each.
    """

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Function tools (the chat route's tool calling): tool_choice "none", "auto"
    # (--enable-auto-tool-choice), "required" or {"type": "function", "name": ...}.
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: PosInt | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra sampling fields (same names and meanings as SamplingParams).
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None
    # Not served yet (RESPONSES_UNSUPPORTED_FIELDS): only null is accepted.
    reasoning: None = None
    conversation: None = None
    prompt: None = None


# ---------------------------------------------------------------- response bodies


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class OutputText(_Strict):
    type: str  # "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]  # [] unless include asks for them


class OutputMessage(_Strict, tag="message", tag_field="type"):
    """A `message` output item: the assistant's text."""

    id: str
    role: str  # "assistant"
    status: str  # "in_progress" | "completed" | "incomplete"
    content: list[OutputText]


class FunctionCallItem(_Strict, tag="function_call", tag_field="type"):
    """A `function_call` output item: `call_id` is what a later `function_call_output`
    input item answers; `arguments` the model's JSON text of the arguments object."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str  # "in_progress" | "completed" | "incomplete"


class ReasoningText(_Strict):
    type: str  # "reasoning_text"
    text: str


class ReasoningItem(_Strict, tag="reasoning", tag_field="type"):
    """A `reasoning` output item (with --reasoning-parser): the think block's text in
    `content`; `summary` is always [] (no summaries are written)."""

    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: str  # "in_progress" | "completed" | "incomplete"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(_Strict):
    cached_tokens: int


class OutputTokensDetails(_Strict):
    reasoning_tokens: int


class ResponseUsage(_Strict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Strict):
    reason: str  # "max_output_tokens"


class ResponseErrorObject(_Strict):
    code: str
    message: str


class TextConfigOut(_Strict):
    format: dict[str, Any]  # the request's text.format ({"type": "text"} by default)


class ResponseObject(_Strict):
    """OpenAI's Response object ("response")."""

    id: str
    object: str  # "response"
    created_at: int  # Unix seconds
    completed_at: int | None
    status: str  # "in_progress" | "completed" | "incomplete" | "failed"
    error: ResponseErrorObject | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextConfigOut
    tool_choice: str | dict[str, str]
    tools: list[Any]  # the request's function tools, as sent
    top_logprobs: int | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
    background: bool


class ResponseDeleted(_Strict):
    id: str
    object: str  # "response.deleted"
    deleted: bool
