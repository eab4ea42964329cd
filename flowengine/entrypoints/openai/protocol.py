"""Request bodies of the OpenAI routes, as msgspec structs (validation + OpenAPI schema).

Field names, types and defaults follow the OpenAI API reference (Completions, Chat
Completions) plus vLLM's extra sampling fields (`top_k`, `min_p`, ...), which the
`openai` SDK sends through `extra_body`. Unknown fields are ignored, as OpenAI and
vLLM do; fields we know but cannot honour (`suffix`, `functions`, ...) are
declared here so the handlers can answer 400 when they are set, and vLLM's extra
fields that change the output but are not implemented yet (`UNSUPPORTED_FIELDS`:
`guided_whitespace_pattern`, `documents`, ...) are typed `null`:
any other value is a 400 naming the field, so no client believes its output was
constrained when it was not.

Every integer is bounded to a signed 64-bit integer (`Int64`), so a request that
passes validation can always be encoded for the engine's rings (issue 21 item 1);
msgspec rejects non-finite floats (`1e999`) itself.

Decoding with `msgspec.json.decode(body, type=...)` raises `msgspec.ValidationError`
naming the field (`... - at $.messages[0].role`), which becomes a 400. A top-level
field sent as `null` that has a default but no null value of its own (`stream`, `n`,
`echo`, `store`, ...) takes its default (`null_default_fields`), as OpenAI's spec makes
those fields nullable and vLLM's Optional fields accept null.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

INT64_MAX = (1 << 63) - 1
Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=INT64_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
# A count of log-probabilities: >= 0, or -1 for the whole vocabulary (vLLM's meaning).
NumLogprobs = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]


def _accepts_none(tp: Any) -> bool:
    if tp is None or tp is type(None) or tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _accepts_none(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_none(arg) for arg in typing.get_args(tp))
    return False


@functools.cache
def null_default_fields(struct: type[msgspec.Struct]) -> frozenset[str]:
    """The JSON names of `struct`'s fields that have a default but do not accept null:
    sent as null, they take their default (ServingContext.decode)."""
    return frozenset(
        f.encode_name for f in msgspec.structs.fields(struct)
        if not f.required and not _accepts_none(f.type)
    )  # fmt: skip


# vLLM request fields (vllm/entrypoints/openai/protocol.py) that FlowEngine does not
# implement yet. Declared with type `null` below; a value is refused with this message.
UNSUPPORTED_FIELDS = frozenset(
    {
        "guided_whitespace_pattern",
        "logits_processors", "kv_transfer_params",
        "documents", "mm_processor_kwargs",
        "return_tokens_as_token_ids", "return_token_ids",
        # Only vLLM's default value (true on completions, false on chat) is accepted.
        "add_special_tokens",
        "reasoning_effort", "logprobs_mode", "thinking_token_budget",
    }
)  # fmt: skip


class StreamOptions(msgspec.Struct, kw_only=True):
    """`include_usage`: one extra chunk before `[DONE]` with `usage` and no choices.
    vLLM's `continuous_usage_stats`: also every chunk carries the usage so far, its
    choice's completion tokens (vLLM's rule); it implies `include_usage` unless that
    is false, as in vLLM, whose `include_usage` defaults to true."""

    include_usage: bool | None = None
    continuous_usage_stats: bool = False

    def usage_flags(self) -> tuple[bool, bool]:
        """(include_usage, continuous usage)."""
        include = self.continuous_usage_stats if self.include_usage is None else self.include_usage
        return include, include and self.continuous_usage_stats


class StructuredOutputsRequest(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` extra field (the fields of StructuredOutputsParams);
    exactly one of json, regex, choice, grammar, json_object, structural_tag."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: the output is JSON valid against `schema`
    (constrained whatever `strict` says, as vLLM does)."""

    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's
    `structural_tag` (its `format`, or the older `structures` + `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields that both generation routes accept (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: PosInt = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    # Ranges of these floats are SamplingParams' (its messages name the rule); the
    # OpenAPI document states them (openapi.py SAMPLING_RANGES).
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (same names and meanings as SamplingParams).
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = None
    # vLLM's extra sampling fields, as SamplingParams (vllm_xargs -> extra_args).
    allowed_token_ids: list[NonNegInt] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NumLogprobs | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    vllm_xargs: dict[str, str | int | float] | None = None
    # Structured outputs (OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* names); at most one of them per request (sampling.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Checked to be a backend name, then ignored: the server's
    # --structured-outputs-backend compiles every request (vLLM v1's rule).
    guided_decoding_backend: str | None = None
    # Not implemented yet (UNSUPPORTED_FIELDS): only null is accepted.
    guided_whitespace_pattern: None = None
    logits_processors: None = None
    kv_transfer_params: None = None
    return_tokens_as_token_ids: None = None
    return_token_ids: None = None
    logprobs_mode: None = None
    # vLLM's beam search (serving_beam.py): beam width = `n` (completions: `best_of`
    # when set); length_penalty and early_stopping as transformers' generate.
    # (null: the default, as absent).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions.

    `prompt` is a string, a list of strings, a list of token ids, or a list of
    token-id lists (each prompt one request; choice index = prompt index * n + sample).
    `logprobs` asks for that many top log-probabilities per token (0 to the server's
    `--max-logprobs`, 20 by default as in vLLM). `max_tokens` 0 is served only with
    `echo`: the prompt alone (OpenAI's and vLLM's way to score a text). Omitted it is
    16 (OpenAI's default), capped at the context left; a value the client sends must
    fit the context with the prompt (else 400, as vLLM); null: up to the context limit.
    """

    prompt: str | list[str | NonNegInt | list[NonNegInt]]
    # UNSET (omitted) tells the default apart from a sent 16 (only a sent cap is checked).
    max_tokens: NonNegInt | None | msgspec.UnsetType = msgspec.UNSET
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    best_of: PosInt | None = None
    # vLLM's default (true: the tokenizer's BOS etc. around the prompt) is what this
    # route does; false is not implemented yet (a 400, see errors.py).
    add_special_tokens: Literal[True] | None = None


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    """A call an assistant message made: the function's name, its arguments as JSON text."""

    name: str
    arguments: str


class MessageToolCall(msgspec.Struct, kw_only=True):
    """One of an assistant message's `tool_calls` (sent back for multi-turn use)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message; `content` is a string or a list of text parts. An assistant message
    may carry `tool_calls` (content then may be null); a `tool` message answers the
    call `tool_call_id` with its result in `content`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A tool's function: `parameters` is a JSON Schema of an object (checked as one)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(msgspec.Struct, kw_only=True):
    """One entry of `tools` (OpenAI's function tool)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice` that forces one function: {"type": "function", "function": {"name"}}."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions.

    `max_completion_tokens` (or the older `max_tokens`) caps the answer; unset, it runs
    to EOS or the context limit. `logprobs: true` with `top_logprobs` 0-20 returns
    per-token log-probabilities in OpenAI's chat format.
    """

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=-1, le=20)] | None = None
    # Tool calling (OpenAI's fields): tools reach the chat template; tool_choice none,
    # auto (parsed by --tool-call-parser), required or a named function (both enforced
    # by a JSON schema); parallel_tool_calls false allows one call. An empty `tools`
    # array is no tools (as vLLM accepts it), a 400 with "required" or a named function.
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    # vLLM's chat-template options: extra template variables (e.g. enable_thinking),
    # the assistant header, or continuing the last message (not with the header).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A per-request Jinja template (text); refused unless --trust-request-chat-template.
    chat_template: str | None = None
    # vLLM's chat fields that change the output (sampling.py): `structural_tag` is a
    # constraint as vLLM's older guided_* names are (xgrammar's structural tag, a dict
    # or its JSON text); `best_of` other than `n` is refused as on completions; `echo`
    # (the last message prepended to the answer) is refused where vLLM would echo.
    structural_tag: dict[str, Any] | str | None = None
    best_of: PosInt | None = None
    echo: bool = False
    # Not implemented yet (UNSUPPORTED_FIELDS): only null is accepted.
    documents: None = None
    mm_processor_kwargs: None = None
    # vLLM's default (false: the chat template writes the special tokens) is what this
    # route does; true is not implemented yet (a 400, see errors.py).
    add_special_tokens: Literal[False] | None = None
    reasoning_effort: None = None


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
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # As the chat route's: refused unless --trust-request-chat-template.
    chat_template: str | None = None
    tools: list[ChatCompletionTool] | None = None
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
