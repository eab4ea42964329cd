"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes the chat route's request (chat_adapter.py): `system` a system
message, `messages` the conversation, `max_tokens` the cap, `stop_sequences` stop
strings; a conversation ending with an assistant message has that message
continued (Anthropic's prefill: the chat route's `continue_final_message`). The answer
is one text block; `stop_reason` is "end_turn" (EOS or a stop
token), "max_tokens" (the cap or the context limit) or "stop_sequence" (with
`stop_sequence` the string that matched); null for a request the engine aborted.

Streaming sends Anthropic's named events (`event: <type>` plus `data: <json>`):
message_start (usage.input_tokens known, output_tokens 0), content_block_start
(index 0, an empty text block), ping, content_block_delta (text_delta) per text delta,
content_block_stop, message_delta (stop_reason, stop_sequence, cumulative usage),
message_stop. A failure after the stream started is an `error` event in Anthropic's
error shape, which ends the stream.

Every error of these routes, also those of the app itself (401, 413, 415, 503 while
draining, a body that is not JSON), has Anthropic's shape
`{"type": "error", "error": {"type": ..., "message": ...}}` with the same HTTP status
as on the OpenAI routes (`anthropic_error_response`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    JSONResponse,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.chat_adapter import ChatRun
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import engine_error
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from flowengine.entrypoints.openai.protocol_anthropic import (
    AnthropicMessage,
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
)
from flowengine.entrypoints.openai.sse import HEADERS

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
# Chat field names in 400s -> this API's names.
PARAM_NAMES = {"stop": "stop_sequences"}


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
    texts = []
    for j, block in enumerate(blocks):
        if block.type in ("tool_use", "tool_result"):
            raise bad_request(
                f"{block.type} blocks need tool calling, which this server does not "
                "support yet; send text blocks only",
                f"{where}[{j}]",
            )
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"content block type {block.type!r} is not supported; send text blocks "
                "({'type': 'text', 'text': ...})",
                f"{where}[{j}]",
            )
        texts.append(block.text)
    return "\n".join(texts)


def check_supported(req: MessagesRequest | CountTokensRequest) -> None:
    """Raise APIError(400) for tools, forced tool choice and extended thinking."""
    if req.tools:
        raise bad_request(
            "tools are not supported yet by this server (tool calling); remove them", "tools"
        )
    if req.tool_choice is not None and req.tool_choice.get("type") not in ("auto", "none"):
        raise bad_request(
            "tool_choice needs tools, which this server does not support yet; remove it",
            "tool_choice",
        )
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise bad_request(
            "extended thinking is not supported by this server; remove thinking or set "
            "{'type': 'disabled'}",
            "thinking",
        )


def chat_messages_of(
    system: str | list[ContentBlock] | None, messages: list[AnthropicMessage]
) -> list[dict[str, str]]:
    """`system` and `messages` as chat messages ({"role", "content"}, text blocks of one
    message joined with newlines). Raises APIError(400) naming a non-text block."""
    out = []
    if system is not None:
        text = system if isinstance(system, str) else _block_text(system, "system")
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            text = m.content
        else:
            text = _block_text(m.content, f"messages[{i}].content")
        out.append({"role": m.role, "content": text})
    return out


def is_prefill(messages: list[dict[str, str]]) -> bool:
    """Anthropic's "prefill": a conversation ending with an assistant message has that
    message continued (the text returned is only the continuation), which the chat
    template gives with continue_final_message instead of a new assistant turn."""
    return messages[-1]["role"] == "assistant"


def stop_reason_of(run: ChatRun) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished run."""
    if run.finish_reason == "length":
        return "max_tokens", None
    if run.finish_reason == "stop":
        if isinstance(run.stop_reason, str):
            return "stop_sequence", run.stop_reason
        return "end_turn", None  # EOS or a stop token id
    return None, None  # aborted by the engine


async def create_message(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle POST /v1/messages. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, MessagesRequest)
    check_supported(req)
    model = ctx.resolve_model(req.model)
    messages = chat_messages_of(req.system, req.messages)
    prefill = is_prefill(messages)
    chat = ChatCompletionRequest(
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],  # type: ignore[arg-type]
        model=model,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stream=req.stream,
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    run = await ChatRun.open(ctx, chat, message_id, kind="messages", param_names=PARAM_NAMES)
    if req.stream:
        return StreamingResponse(
            _stream(run, model),
            cleanup=run.aclose,
            headers=HEADERS,
            error_event=anthropic_error_event,
        )
    try:
        await run.collect()
    finally:
        await run.aclose()
    reason, sequence = stop_reason_of(run)
    return json_response(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": run.text}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {
                "input_tokens": run.num_prompt_tokens,
                "output_tokens": run.num_output_tokens,
            },
        }
    )


async def _stream(run: ChatRun, model: str) -> AsyncIterator[bytes]:
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
        yield _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        yield _event("ping", {"type": "ping"})
        async for delta in run.deltas():
            yield _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": delta.text},
                },
            )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        reason, sequence = stop_reason_of(run)
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
    """POST /v1/messages/count_tokens: the prompt's token count after the chat template
    (the `usage.input_tokens` that /v1/messages would report). Raises APIError(400/404)."""
    req = ctx.decode(request.raw_body, CountTokensRequest)
    check_supported(req)
    ctx.resolve_model(req.model)
    messages = chat_messages_of(req.system, req.messages)
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
        )
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from err
    return json_response({"input_tokens": len(ids)})
