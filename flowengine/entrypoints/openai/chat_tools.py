"""Tool calling and reasoning set-up of one chat-style request, shared by every route
that generates an assistant turn (chat completions, OpenAI Responses, Anthropic
Messages), so each route has the chat route's rules and output parsing.

`setup_chat_output` resolves the request's `tools` / `tool_choice` /
`parallel_tool_calls` (tool_parsers/request.py: OpenAI's and vLLM's checks, the
server's `--enable-auto-tool-choice` / `--tool-call-parser`), constrains the output
with a JSON schema for `required` or a named function (after the think block with a
`--reasoning-parser`), and returns the factory of per-choice output parsers
(chat_parsing.py) and the tools the chat template gets. Raises APIError(400).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions, ChoiceParser
from flowengine.entrypoints.openai.errors import bad_request
from flowengine.entrypoints.openai.protocol import ChatMessage, FunctionCall, MessageToolCall
from flowengine.entrypoints.openai.tool_parsers.request import (
    ToolChoice,
    resolve_tool_choice,
    tool_choice_schema,
)
from flowengine.reasoning import ThinkReasoningParser, get_reasoning_parser
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams

# Makes a choice's parser from the prompt text; None: plain content.
ParserFactory = Callable[[str | None], ChoiceParser] | None


@dataclass(frozen=True)
class ChatOutputSetup:
    """What a request's tools and the server's parsers decide.

    Attributes:
        choice: the resolved tool choice.
        params: the request's SamplingParams with the tool choice's constraint and
            detokenizer setting.
        make_parser: makes one `ChoiceParser` per choice, None for plain content.
        template_tools: the tools the chat template renders (OpenAI's
            {"type": "function", "function": {...}} dicts), None for none.
    """

    choice: ToolChoice
    params: SamplingParams
    make_parser: ParserFactory
    template_tools: list[dict[str, Any]] | None


def setup_chat_output(
    parsing: ChatParsingOptions,
    params: SamplingParams,
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
) -> ChatOutputSetup:
    """The chat route's tool/reasoning set-up for one request; `tools` are
    `ChatCompletionTool` structs, `tool_choice` the chat route's value (None, "none",
    "auto", "required" or a `NamedToolChoice`). Raises APIError(400) naming the field."""
    choice = resolve_tool_choice(
        tools, tool_choice, parallel_tool_calls, auto_enabled=parsing.auto_enabled
    )
    params = tool_params(params, choice, parsing.tool_parser_class(choice))
    if parsing.reasoning_parser is not None:
        params = after_reasoning(params, get_reasoning_parser(parsing.reasoning_parser))
    template_tools = choice.tools
    if choice.mode == "none" and parsing.exclude_tools_when_tool_choice_none:
        template_tools = None
    return ChatOutputSetup(choice, params, parsing.parser_factory(choice), template_tools)


def tool_params(
    params: SamplingParams, choice: ToolChoice, parser_cls: type | None
) -> SamplingParams:
    """The request's SamplingParams with what its tool choice needs: the JSON schema of
    `required` / a named function as a structured-output constraint (so arguments
    always parse), and the detokenizer setting of a parser whose markers are special
    tokens. Raises APIError(400)."""
    changes: dict[str, Any] = {}
    schema = tool_choice_schema(choice)
    if schema is not None:
        changes.update(_schema_constraint(params, schema))
    wanted = getattr(parser_cls, "skip_special_tokens", None)
    if wanted is not None and params.skip_special_tokens != wanted:
        changes["skip_special_tokens"] = wanted
    return params.clone(**changes) if changes else params


def _schema_constraint(params: SamplingParams, schema: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams changes that constrain the output to the tool choice's `schema`.
    Raises APIError(400): another constraint is set too, or a tool's parameters use a
    schema feature the grammar backends cannot compile (named in the message)."""
    if params.structured_outputs is not None:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the output to the "
            "tools' schemas; it cannot be combined with response_format or another "
            "structured-output constraint",
            "tool_choice",
        )
    from flowengine.structured_outputs.validate import validate_structured_outputs

    constraint = StructuredOutputsParams(json=schema)
    try:
        validate_structured_outputs(constraint, field="tools")
    except ValueError as err:
        raise bad_request(str(err), "tools") from None
    return {"structured_outputs": constraint}


def after_reasoning(
    params: SamplingParams, parser_cls: type[ThinkReasoningParser]
) -> SamplingParams:
    """With a reasoning parser, a constraint (response_format, structured_outputs,
    guided_*, a tool choice's schema) applies only after the think block
    (`ThinkReasoningParser.gated_constraint`; a structural tag stays as given)."""
    constraint = params.structured_outputs
    if constraint is None:
        return params
    gated = parser_cls.gated_constraint(constraint)
    return params if gated is constraint else params.clone(structured_outputs=gated)


def chat_message(m: dict[str, Any]) -> ChatMessage:
    """A chat-route message from a front door's converted message dict (role, content,
    optional tool_calls [{id, function: {name, arguments}}] and tool_call_id)."""
    calls = [
        MessageToolCall(id=c["id"], function=FunctionCall(
            name=c["function"]["name"], arguments=c["function"]["arguments"]))
        for c in m.get("tool_calls") or ()
    ]  # fmt: skip
    return ChatMessage(
        role=m["role"], content=m["content"], tool_calls=calls or None,
        tool_call_id=m.get("tool_call_id"),
    )  # fmt: skip
