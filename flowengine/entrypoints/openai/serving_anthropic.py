"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes the chat route's request (chat_adapter.py): `system` a system
message, `messages` the conversation, `max_tokens` the cap, `stop_sequences` stop
strings; a conversation ending with an assistant message has that message
continued (Anthropic's prefill: the chat route's `continue_final_message`).

Tools are the chat route's (chat_tools.py): custom `tools` ({name, description,
input_schema}) become function tools, `tool_choice` auto / any / tool / none the chat
route's auto / required / named / none (`disable_parallel_tool_use` its
parallel_tool_calls false), with its rules (auto needs --enable-auto-tool-choice and
--tool-call-parser). An assistant message's `tool_use` blocks become its `tool_calls`,
a user message's `tool_result` blocks `tool` messages before its text. The answer's
blocks (anthropic_output.py) are a `thinking` block (with --reasoning-parser), a
`text` block and one `tool_use` block per call, their texts the chat route's
reasoning_content / content / tool_calls. `stop_reason` is "end_turn" (EOS or a stop
token), "tool_use" (it stopped after calling tools), "max_tokens" (the cap or the
context limit) or "stop_sequence" (with `stop_sequence` the string that matched);
null for a request the engine aborted.

Streaming sends Anthropic's named events (`event: <type>` plus `data: <json>`):
message_start (usage.input_tokens known, output_tokens 0), per block
content_block_start, content_block_delta (text_delta, thinking_delta,
input_json_delta) per delta and content_block_stop (without a parser the text block
starts before the ping), ping, message_delta (stop_reason, stop_sequence, cumulative
usage), message_stop. A failure after the stream started is an `error` event in
Anthropic's error shape, which ends the stream.

Every error of these routes, also those of the app itself (401, 413, 415, 503 while
draining, a body that is not JSON), has Anthropic's shape
`{"type": "error", "error": {"type": ..., "message": ...}}` with the same HTTP status
as on the OpenAI routes (`anthropic_error_response`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from flowengine.entrypoints.openai.anthropic_output import MessageContent
from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    JSONResponse,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.chat_adapter import ChatRun, rename_param
from flowengine.entrypoints.openai.chat_tools import chat_message
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import engine_error
from flowengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)
from flowengine.entrypoints.openai.protocol_anthropic import (
    AnthropicMessage,
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
)
from flowengine.entrypoints.openai.sse import HEADERS
from flowengine.entrypoints.openai.tool_parsers.request import resolve_tool_choice

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors"); other 4xx are
# invalid_request_error, other 5xx api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Anthropic's smallest `thinking.budget_tokens` (API reference, "Messages": "Must be
# >=1024 and less than max_tokens").
MIN_THINKING_BUDGET_TOKENS = 1024
# Chat field names in 400s -> this API's names.
PARAM_NAMES = {"stop": "stop_sequences"}
# The chat route's names of a tool's fields -> Anthropic's.
_CHAT_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.(name|parameters)")
_TOOL_FIELDS = {"name": "name", "parameters": "input_schema"}


def anthropic_param(param: str) -> str:
    """This API's name of a chat request field named in a 400."""
    if param in PARAM_NAMES:
        return PARAM_NAMES[param]
    return _CHAT_TOOL_FIELD.sub(lambda m: f"tools[{m[1]}].{_TOOL_FIELDS[m[2]]}", param)


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error object for `err`; the message names the field at fault."""
    error_type = ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    message = err.message
    if err.param is not None and err.param not in message:
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_error_response(err: APIError) -> Response:
    """A JSON error response in Anthropic's shape (status and headers of `err`)."""
    return JSONResponse(anthropic_error_body(err), err.status, err.headers or None)


def _event(type: str, data: dict[str, Any]) -> bytes:
    return b"event: " + type.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def anthropic_error_event(err: APIError) -> bytes:
    """The SSE `error` event that ends a failed stream."""
    return _event("error", anthropic_error_body(err))


def _block_text(blocks: list[ContentBlock], where: str) -> str:
    """The text of text-only blocks (`system`), joined with newlines; an empty text
    block is a 400 (Anthropic's rule)."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"content block type {block.type!r} is not supported here; send text "
                "blocks ({'type': 'text', 'text': ...})",
                f"{where}[{j}]",
            )
        texts.append(_nonempty_text(block.text, f"{where}[{j}]"))
    return "\n".join(texts)


def _nonempty_text(text: str, where: str) -> str:
    # Anthropic's rule, whatever the message: an empty text block says nothing (an
    # empty final assistant message is `content: ""` or `[]`, not an empty block).
    if not text:
        raise bad_request("text content blocks must be non-empty", f"{where}.text")
    return text


def _tool_result_text(block: ContentBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"tool_result content block type {part.type!r} is not supported; send "
                "text blocks",
                f"{where}.content[{k}]",
            )
        texts.append(_nonempty_text(part.text, f"{where}.content[{k}]"))
    return "\n".join(texts)


def check_supported(req: MessagesRequest | CountTokensRequest, has_reasoning: bool) -> None:
    """Raise APIError(400) for server tools, thinking without a reasoning parser, and a
    thinking budget Anthropic refuses."""
    for i, tool in enumerate(req.tools or ()):
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"tool type {tool.type!r} is a server tool, which this server does not "
                "run; send custom tools ({'name', 'description', 'input_schema'})",
                f"tools[{i}].type",
            )
        if tool.input_schema is None:
            raise bad_request(
                f"tool {tool.name!r} needs input_schema (a JSON Schema of an object)",
                f"tools[{i}].input_schema",
            )
    if req.thinking is not None and req.thinking.type == "enabled":
        if not has_reasoning:
            raise bad_request(
                "extended thinking needs a reasoning model served with --reasoning-parser; "
                "remove thinking or set {'type': 'disabled'}",
                "thinking",
            )
        max_tokens = req.max_tokens if isinstance(req, MessagesRequest) else None
        _check_budget(req.thinking.budget_tokens, max_tokens)


def _check_budget(budget_tokens: int | None, max_tokens: int | None) -> None:
    """Anthropic's rule for `thinking.budget_tokens` of enabled thinking: required, at
    least MIN_THINKING_BUDGET_TOKENS and less than max_tokens (count_tokens has none).
    The budget is still not enforced on the output; a request Anthropic refuses is
    refused here too, so a client learns of it on this server as well."""
    where = "thinking.budget_tokens"
    if budget_tokens is None:
        raise bad_request("enabled thinking needs budget_tokens", where)
    if budget_tokens < MIN_THINKING_BUDGET_TOKENS:
        raise bad_request(
            f"budget_tokens must be at least {MIN_THINKING_BUDGET_TOKENS}; got {budget_tokens}",
            where,
        )
    if max_tokens is not None and budget_tokens >= max_tokens:
        raise bad_request(
            f"budget_tokens ({budget_tokens}) must be less than max_tokens ({max_tokens}); "
            "raise max_tokens or lower the budget",
            where,
        )


def chat_messages_of(
    system: str | list[ContentBlock] | None, messages: list[AnthropicMessage]
) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages: text blocks of one message joined with
    newlines; an assistant message's `tool_use` blocks its `tool_calls` (id, name,
    arguments as JSON text); a user message's `tool_result` blocks
    {"role": "tool", "tool_call_id", "content"} messages before its text (a user
    message of tool results only has no user message); thinking blocks dropped.

    An empty `system` ("" or []) adds no system message (the template's default
    applies, as without `system`).

    Raises APIError(400) naming the block (Anthropic's rules): a message with empty
    content (other than a final assistant message), an empty text block (in any
    message, tool_result or `system`), a block type not served (image,
    document, ...), tool_use outside an assistant message, without id/name or with an
    id used twice in the message, tool_result outside a user message, after a text
    block of its message or answering no tool_use of the message before, and tool_use
    blocks without their tool_result in the next message.
    """
    out: list[dict[str, Any]] = []
    if system:
        # An empty `system` ("" or []) is no system prompt, as when it is absent: the
        # chat template's default system prompt applies (as vLLM's Messages route).
        text = system if isinstance(system, str) else _block_text(system, "system")
        out.append({"role": "system", "content": text})
    unanswered: dict[str, int] = {}  # tool_use ids of the last assistant message
    for i, m in enumerate(messages):
        if unanswered and m.role != "user":
            raise _unanswered(unanswered, i)
        if not m.content and not (m.role == "assistant" and i == len(messages) - 1):
            # Anthropic's rule: an empty turn would render as a turn with nothing said.
            raise bad_request(
                "all messages must have non-empty content except for the optional final "
                "assistant message",
                f"messages[{i}].content",
            )
        if isinstance(m.content, str):
            if unanswered:
                raise _unanswered(unanswered, i)
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                if block.text is None:
                    raise bad_request("a text block needs text", where)
                texts.append(_nonempty_text(block.text, where))
            elif block.type == "tool_use" and m.role == "assistant":
                if not block.id or not block.name:
                    raise bad_request("a tool_use block needs id and name", where)
                if any(c["id"] == block.id for c in calls):
                    # Two calls under one id: a tool_result could not say which it answers.
                    raise bad_request(
                        f"tool_use ids must be unique; {block.id!r} is used twice in "
                        f"messages[{i}]",
                        f"{where}.id",
                    )
                arguments = orjson.dumps(block.input or {}).decode()
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
            elif block.type == "tool_result" and m.role == "user":
                if texts:
                    # Anthropic's rule (its results are rendered before the turn's text,
                    # so a result after text would be silently moved).
                    raise bad_request(
                        "tool_result blocks must come first in a user message's content, "
                        "before any text blocks",
                        where,
                    )
                if block.tool_use_id not in unanswered:
                    raise bad_request(
                        f"tool_result answers tool_use_id {block.tool_use_id!r}, which is not "
                        "a tool_use block of the assistant message just before",
                        f"{where}.tool_use_id",
                    )
                del unanswered[block.tool_use_id]
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": _tool_result_text(block, where)})  # fmt: skip
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # an earlier turn's reasoning: templates do not render it
            elif block.type in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
                owner = "user" if block.type == "tool_result" else "assistant"
                raise bad_request(f"{block.type} blocks belong in {owner} messages", where)
            else:
                raise bad_request(
                    f"content block type {block.type!r} is not supported; send text, "
                    "tool_use or tool_result blocks",
                    where,
                )
        if unanswered:
            raise _unanswered(unanswered, i)
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
                unanswered = {c["id"]: i for c in calls}
            out.append(message)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "\n".join(texts)})
    if unanswered:
        raise _unanswered(unanswered, len(messages))
    return out


def _unanswered(ids: dict[str, int], i: int) -> APIError:
    where = next(iter(ids.values()))
    return bad_request(
        f"tool_use ids {sorted(ids)} of messages[{where}] have no tool_result block in the "
        "user message right after it; answer each call",
        f"messages[{min(i, where + 1)}]",
    )


def chat_tools(
    req: MessagesRequest | CountTokensRequest,
) -> tuple[list[ChatCompletionTool] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) as the chat route's. A tool_choice of
    auto or none without tools means no tools."""
    choice = req.tool_choice
    parallel = None
    if choice is not None and choice.disable_parallel_tool_use is not None:
        parallel = not choice.disable_parallel_tool_use
    chat_choice: Any = None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs name", "tool_choice.name")
            chat_choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        else:
            chat_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not req.tools:
        if chat_choice in (None, "auto", "none"):
            return None, None, parallel
        return None, chat_choice, parallel
    tools = [
        ChatCompletionTool(function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema))
        for t in req.tools
    ]  # fmt: skip
    return tools, chat_choice, parallel


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Anthropic's "prefill": a conversation ending with an assistant message has that
    message continued (the text returned is only the continuation), which the chat
    template gives with continue_final_message instead of a new assistant turn."""
    return messages[-1]["role"] == "assistant"


def stop_reason_of(run: ChatRun, num_tool_uses: int = 0) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished run that made
    `num_tool_uses` calls."""
    if run.finish_reason == "length":
        return "max_tokens", None
    if run.finish_reason == "stop":
        if num_tool_uses:
            return "tool_use", None
        if isinstance(run.stop_reason, str):
            return "stop_sequence", run.stop_reason
        return "end_turn", None  # EOS or a stop token id
    return None, None  # aborted by the engine


async def create_message(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle POST /v1/messages. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, MessagesRequest)
    check_supported(req, ctx.chat_parsing.reasoning_parser is not None)
    model = ctx.resolve_model(req.model)
    messages = chat_messages_of(req.system, req.messages)
    prefill = is_prefill(messages)
    tools, tool_choice, parallel = chat_tools(req)
    chat = ChatCompletionRequest(
        messages=[chat_message(m) for m in messages],
        model=model,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stream=req.stream,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    # max_tokens is required here and clients send one sized for the largest models:
    # it is capped at the context left rather than refused (the chat routes refuse).
    run = await ChatRun.open(ctx, chat, message_id, kind="messages", param_names=anthropic_param,
                             check_max_tokens=False)
    content = MessageContent(plain=not run.is_parsed)
    if req.stream:
        return StreamingResponse(
            _stream(run, content, model),
            cleanup=run.aclose,
            headers=HEADERS,
            error_event=anthropic_error_event,
        )
    try:
        content.start()
        async for delta in run.deltas():
            content.feed(delta)
        content.finish()
    finally:
        await run.aclose()
    reason, sequence = stop_reason_of(run, content.num_tool_uses)
    return json_response(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content.json(),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": run.num_prompt_tokens,
                "output_tokens": run.num_output_tokens,
            },
        }
    )


async def _stream(run: ChatRun, content: MessageContent, model: str) -> AsyncIterator[bytes]:
    try:
        message = {
            "id": run.request_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": run.num_prompt_tokens, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": message})
        for name, data in content.start():
            yield _event(name, data)
        yield _event("ping", {"type": "ping"})
        async for delta in run.deltas():
            for name, data in content.feed(delta):
                yield _event(name, data)
        for name, data in content.finish():
            yield _event(name, data)
        reason, sequence = stop_reason_of(run, content.num_tool_uses)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {
                    "input_tokens": run.num_prompt_tokens,
                    "output_tokens": run.num_output_tokens,
                },
            },
        )
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as err:
        yield anthropic_error_event(engine_error(err))
    finally:
        await run.aclose()


async def count_tokens(ctx: ServingContext, request: APIRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt's token count after the chat template,
    tools included (the `usage.input_tokens` that /v1/messages would report). Raises
    APIError(400/404)."""
    req = ctx.decode(request.raw_body, CountTokensRequest)
    check_supported(req, ctx.chat_parsing.reasoning_parser is not None)
    ctx.resolve_model(req.model)
    messages = chat_messages_of(req.system, req.messages)
    tools, tool_choice, parallel = chat_tools(req)
    # The tools and tool_choice are checked as /v1/messages checks them (a count for a
    # request that would be refused would mislead); counting needs no output parser,
    # so "auto" is checked as if the server had one.
    try:
        choice = resolve_tool_choice(tools, tool_choice, parallel, auto_enabled=True)
    except APIError as err:
        raise rename_param(err, anthropic_param) from None
    template_tools = choice.tools
    if choice.mode == "none" and ctx.chat_parsing.exclude_tools_when_tool_choice_none:
        template_tools = None
    # The engine's own template step, as /tokenize: the count is what a request uses.
    from flowengine.tokenize.chat import apply_chat_template

    try:
        prefill = is_prefill(messages)
        ids = apply_chat_template(
            ctx.tokenizer,
            messages,
            not prefill,
            continue_final_message=prefill,
            chat_template=getattr(ctx.engine, "chat_template", None),  # --chat-template
            tools=template_tools,
        )
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from err
    return json_response({"input_tokens": len(ids)})
