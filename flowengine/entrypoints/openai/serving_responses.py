"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API.

A request becomes the chat route's request (chat_adapter.py): `instructions` a system
message, `input` the conversation (after the stored conversation of
`previous_response_id`, if given), `max_output_tokens` the chat route's
`max_completion_tokens`. The answer is one `message` output item with one
`output_text` part. A response that stopped at `max_output_tokens` (or the context
limit) has `status: "incomplete"` and `incomplete_details.reason:
"max_output_tokens"`.

Streaming sends OpenAI's typed events, each as `event: <type>` plus `data: <json>`
with a `sequence_number` counting from 0: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta
(one per text delta), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete). A failure
after the stream started ends it with response.failed (status "failed", `error`).
There is no `data: [DONE]`; OpenAI's Responses streams end with their last event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.chat_adapter import ChatRun
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import engine_error
from flowengine.entrypoints.openai.logprobs import chat_logprobs
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from flowengine.entrypoints.openai.protocol_responses import (
    INCLUDE_LOGPROBS,
    RESPONSES_UNSUPPORTED_FIELDS,
    InputItem,
    ResponsesRequest,
)
from flowengine.entrypoints.openai.responses_store import ResponseStore
from flowengine.entrypoints.openai.sse import HEADERS

# Chat field names in 400s -> this API's names.
PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input"}
# Content part types that carry text: user/system/developer input, replayed assistant output.
TEXT_PART_TYPES = ("input_text", "output_text")


def decode_request(body: bytes) -> ResponsesRequest:
    """Parse a /v1/responses body. Raises APIError(400) naming the bad field."""
    try:
        return ServingContext.decode(body, ResponsesRequest)
    except APIError as err:
        if err.param in RESPONSES_UNSUPPORTED_FIELDS:
            err.message = (
                f"{err.param} is not supported yet by this server; remove it (it would "
                "change the output, so it is refused rather than ignored)"
            )
        raise


def check_supported(req: ResponsesRequest) -> None:
    """Raise APIError(400) for fields set to values this server cannot honour."""
    if req.tools:
        raise bad_request(
            "tools are not supported yet by this server (tool calling); remove them", "tools"
        )
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request(
            "tool_choice needs tools, which this server does not support yet; remove it "
            "or use 'auto' or 'none'",
            "tool_choice",
        )
    if req.background:
        raise bad_request(
            "background responses are not supported; send the request without "
            "background (stream it for long outputs)",
            "background",
        )
    for i, value in enumerate(req.include or ()):
        if value != INCLUDE_LOGPROBS:
            raise bad_request(
                f"include {value!r} is not supported; this server can include only "
                f"{INCLUDE_LOGPROBS!r}",
                f"include[{i}]",
            )
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported; use 'disabled' (an input over the "
            "context length is a 400)",
            "truncation",
        )
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        raise bad_request(
            f"text.format type {req.text.format.type!r} is not supported; use 'text'",
            "text.format",
        )


def input_messages(items: str | list[InputItem]) -> list[dict[str, str]]:
    """`input` as chat messages ({"role", "content"} with text content; text parts of
    one message joined with newlines, as the chat route joins them).

    Raises APIError(400) naming the item for function_call / function_call_output
    items (tool calling is not served yet), other non-message items, a message
    without a role, and non-text content parts (images, files).
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for i, item in enumerate(items):
        if item.type in ("function_call", "function_call_output"):
            raise bad_request(
                f"input[{i}] is a {item.type} item; tool calling is not supported yet by "
                "this server, send message items only",
                f"input[{i}]",
            )
        if item.type != "message":
            raise bad_request(
                f"input[{i}] has type {item.type!r}; only message items are supported",
                f"input[{i}].type",
            )
        if item.role is None:
            raise bad_request(
                f"input[{i}] needs a role: user, assistant, system or developer",
                f"input[{i}].role",
            )
        if item.content is None or isinstance(item.content, str):
            text = item.content or ""
        else:
            texts = []
            for j, part in enumerate(item.content):
                if part.type not in TEXT_PART_TYPES or part.text is None:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported; send text "
                        "parts ({'type': 'input_text', 'text': ...})",
                        f"input[{i}].content[{j}]",
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        messages.append({"role": item.role, "content": text})
    return messages


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Log-probabilities are computed only when `include` asks for them (OpenAI's and
    vLLM's rule; `top_logprobs` alone changes nothing)."""
    return INCLUDE_LOGPROBS in (req.include or ())


def chat_request(
    req: ResponsesRequest, messages: list[dict[str, str]], model: str
) -> ChatCompletionRequest:
    """The chat route's request for this Responses request (same sampling fields)."""
    logprobs = wants_logprobs(req)
    return ChatCompletionRequest(
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],  # type: ignore[arg-type]
        model=model,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        priority=req.priority,
        cache_salt=req.cache_salt,
        user=req.user,
        stream=req.stream,
    )


class _Response:
    """The Response object of one request as it progresses (a JSON-ready dict)."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ResponsesRequest,
        run: ChatRun,
        model: str,
        response_id: str,
    ) -> None:
        self.ctx = ctx
        self.run = run
        self.num_top = (req.top_logprobs or 0) if wants_logprobs(req) else None
        self.message_id = f"msg_{uuid.uuid4().hex}"
        # The output's log-probabilities once known (a stream joins its deltas').
        self.logprobs: list[dict[str, Any]] | None = None
        self.body: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "completed_at": None,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": model,
            "output": [],
            "parallel_tool_calls": True
            if req.parallel_tool_calls is None
            else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": run.params.temperature,
            "top_p": run.params.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else "auto",
            "tools": [],
            "top_logprobs": req.top_logprobs,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": dict(req.metadata or {}),
            "background": False,
        }

    def snapshot(self) -> dict[str, Any]:
        return dict(self.body)

    def token_logprobs(self, token_ids: list[int], logprobs: Any) -> list[dict[str, Any]]:
        """OpenAI's per-token log-probabilities for these tokens ([] if not asked)."""
        if self.num_top is None or not token_ids or not logprobs:
            return []
        return chat_logprobs(token_ids, logprobs, self.num_top, self.ctx.tokenizer)

    def all_logprobs(self) -> list[dict[str, Any]]:
        return self.token_logprobs(self.run.token_ids, self.run.logprobs)

    def message(self, status: str) -> dict[str, Any]:
        """The output message item; with its text part once the text is final."""
        content = [] if status == "in_progress" else [self.part(self.run.text, self.logprobs)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def finish(self) -> dict[str, Any]:
        """The final body once the run finished: status, output, usage."""
        run = self.run
        if run.finish_reason == "stop":
            status = "completed"
        else:
            status = "incomplete"
            if run.finish_reason == "length":
                self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.logprobs is None:
            self.logprobs = self.all_logprobs()
        self.body["status"] = status
        self.body["completed_at"] = int(time.time())
        self.body["output"] = [self.message(status)]
        self.body["usage"] = {
            "input_tokens": run.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": run.num_cached_tokens},
            "output_tokens": run.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": run.num_prompt_tokens + run.num_output_tokens,
        }
        return self.body

    def fail(self, err: APIError) -> dict[str, Any]:
        self.body["status"] = "failed"
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        self.body["error"] = {"code": code, "message": err.message}
        return self.body


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found (it was not stored, was deleted, "
        "or was evicted from this server's bounded store)",
        param=param,
        code="response_not_found",
    )


async def create_response(
    ctx: ServingContext, store: ResponseStore, request: APIRequest
) -> Response:
    """Handle POST /v1/responses. Raises APIError (400/404/429/503)."""
    req = decode_request(request.raw_body)
    check_supported(req)
    model = ctx.resolve_model(req.model)
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = previous.conversation()
    conversation = [*history, *input_messages(req.input)]
    if not conversation:
        raise bad_request("input is empty; send a string or at least one message", "input")
    messages = conversation
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *conversation]
    response_id = f"resp_{uuid.uuid4().hex}"
    run = await ChatRun.open(
        ctx,
        chat_request(req, messages, model),
        response_id,
        kind="responses",
        param_names=PARAM_NAMES,
    )
    resp = _Response(ctx, req, run, model, response_id)

    def keep(body: dict[str, Any]) -> None:
        if req.store:
            store.put(dict(body), conversation, run.text)

    if req.stream:
        events = _Events()
        return StreamingResponse(
            _stream(resp, events, keep),
            cleanup=run.aclose,
            headers=HEADERS,
            error_event=lambda err: events("response.failed", response=resp.fail(err)),
        )
    try:
        await run.collect()
    finally:
        await run.aclose()
    body = resp.finish()
    keep(body)
    return json_response(body)


class _Events:
    """Frames the typed events of one stream, numbering them from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type: str, **fields: Any) -> bytes:
        data = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + type.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def _stream(
    resp: _Response, ev: _Events, keep: Callable[[dict[str, Any]], None]
) -> AsyncIterator[bytes]:
    run = resp.run
    item_id = resp.message_id
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    try:
        yield ev("response.created", response=resp.snapshot())
        yield ev("response.in_progress", response=resp.snapshot())
        yield ev("response.output_item.added", output_index=0, item=resp.message("in_progress"))
        yield ev("response.content_part.added", **where, part=resp.part(""))
        logprobs: list[dict[str, Any]] = []
        async for delta in run.deltas():
            lps = resp.token_logprobs(delta.token_ids, delta.logprobs)
            logprobs.extend(lps)
            yield ev("response.output_text.delta", **where, delta=delta.text, logprobs=lps)
        text = run.text
        resp.logprobs = logprobs
        yield ev("response.output_text.done", **where, text=text, logprobs=logprobs)
        yield ev("response.content_part.done", **where, part=resp.part(text, logprobs))
        body = resp.finish()
        yield ev("response.output_item.done", output_index=0, item=body["output"][0])
        keep(body)
        last = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield ev(last, response=body)
    except Exception as err:
        yield ev("response.failed", response=resp.fail(engine_error(err)))
    finally:
        await run.aclose()


async def retrieve_response(
    ctx: ServingContext, store: ResponseStore, request: APIRequest
) -> Response:
    """GET /v1/responses/{response_id}: a stored response. Raises APIError(404)."""
    response_id = request.path_params["response_id"]
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    return json_response(entry.body)


async def delete_response(
    ctx: ServingContext, store: ResponseStore, request: APIRequest
) -> Response:
    """DELETE /v1/responses/{response_id}: drop a stored response. Raises APIError(404)."""
    response_id = request.path_params["response_id"]
    if not store.delete(response_id):
        raise _not_found(response_id, "response_id")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
