"""POST /v1/responses, GET and DELETE /v1/responses/{response_id} (and its /cancel, always
an error: no background responses): OpenAI's Responses API.

A request becomes the chat route's request (chat_adapter.py): `instructions` a system
message (unless empty), `input` the conversation (after the stored conversation of
`previous_response_id`, if given), `max_output_tokens` the chat route's
`max_completion_tokens`. Function `tools` (flat, OpenAI's Responses shape),
`tool_choice` and `parallel_tool_calls` become the chat route's, with its rules
(`auto` needs --enable-auto-tool-choice and --tool-call-parser; `required` and a
named function are enforced by a JSON schema); `function_call` input items become an
assistant message's `tool_calls`, `function_call_output` items `tool` messages.
`text.format` (`json_schema`, `json_object`) becomes the chat route's
`response_format`: the same structured outputs.
The answer's output items (responses_output.py) are a `reasoning` item (with
--reasoning-parser), a `message` item with one `output_text` part, and one
`function_call` item per call, in the order generated; their texts are the chat
route's reasoning_content / content / tool_calls for the same request. A response
that stopped at `max_output_tokens` (or the context limit) has `status:
"incomplete"` and `incomplete_details.reason: "max_output_tokens"`.

Streaming sends OpenAI's typed events, each as `event: <type>` plus `data: <json>`
with a `sequence_number` counting from 0: response.created, response.in_progress,
then per output item response.output_item.added, its content events
(response.content_part.added, response.output_text.delta or
response.reasoning_text.delta per delta, their .done, response.content_part.done; for
a call response.function_call_arguments.delta per fragment and .done),
response.output_item.done; then response.completed (or response.incomplete). A
failure after the stream started ends it with response.failed (status "failed",
`error`). There is no `data: [DONE]`; OpenAI's Responses streams end with their last
event.
"""

from __future__ import annotations

import re
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
from flowengine.entrypoints.openai.chat_tools import chat_message
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import engine_error
from flowengine.entrypoints.openai.logprobs import chat_logprobs
from flowengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)
from flowengine.entrypoints.openai.protocol_responses import (
    INCLUDE_LOGPROBS,
    RESPONSES_UNSUPPORTED_FIELDS,
    InputContentPart,
    InputItem,
    ResponsesRequest,
    TextFormat,
)
from flowengine.entrypoints.openai.responses_output import Event, ResponseOutput
from flowengine.entrypoints.openai.responses_store import ResponseStore
from flowengine.entrypoints.openai.sse import HEADERS

# Chat field names in 400s -> this API's names.
PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}
# Content part types that carry text: user/system/developer input, replayed assistant output.
TEXT_PART_TYPES = ("input_text", "output_text")
# The chat route names a tool's fields `tools[i].function.<field>`; here they are flat.
_CHAT_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")


def responses_param(param: str) -> str:
    """This API's name of a chat request field named in a 400."""
    return PARAM_NAMES.get(param) or _CHAT_TOOL_FIELD.sub(r"tools[\1].", param)


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
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(
                f"tool type {tool.type!r} is not supported by this server; only function "
                "tools ({'type': 'function', 'name': ..., 'parameters': ...}) are",
                f"tools[{i}].type",
            )
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice.get("name")
        if req.tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'name': <one of the tools>}",
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
    fmt = text_format(req)
    if fmt.type == "json_schema" and fmt.schema is None:
        raise bad_request(
            "text.format of type json_schema needs schema (a JSON schema object)",
            "text.format.schema",
        )
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported; use 'disabled' (an input over the "
            "context length is a 400)",
            "truncation",
        )


def _parts_text(parts: str | list[InputContentPart] | None, where: str) -> str:
    """Text content (a string, or text parts joined with newlines as the chat route
    joins them). Raises APIError(400) naming a non-text part."""
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PART_TYPES:
            raise bad_request(
                f"content part type {part.type!r} is not supported; send text parts "
                "({'type': 'input_text', 'text': ...})",
                f"{where}[{j}]",
            )
        if part.text is None:
            raise bad_request(
                f"a {part.type} content part needs its text ({{'type': {part.type!r}, "
                "'text': ...})",
                f"{where}[{j}].text",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _function_call(i: int, item: InputItem) -> dict[str, Any]:
    """A `function_call` input item as one of an assistant message's `tool_calls`."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(getattr(item, name), str) or not getattr(item, name):
            raise bad_request(
                f"input[{i}] is a function_call item and needs {name} (a non-empty string)",
                f"input[{i}].{name}",
            )
    assert item.arguments is not None
    try:
        arguments = orjson.loads(item.arguments)
    except orjson.JSONDecodeError as err:
        raise bad_request(
            f"the arguments of a function_call must be JSON text of an object: {err}",
            f"input[{i}].arguments",
        ) from None
    if not isinstance(arguments, dict):
        raise bad_request(
            "the arguments of a function_call must be JSON text of an object, got "
            f"{type(arguments).__name__}",
            f"input[{i}].arguments",
        )
    return {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip


def _known_call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(
    items: str | list[InputItem], history: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """`input` as chat messages: {"role", "content"} with text content (text parts of
    one message joined with newlines, as the chat route joins them); `function_call`
    items become the `tool_calls` of an assistant message (consecutive calls, and the
    assistant message just before them, form one turn), `function_call_output` items
    {"role": "tool", "tool_call_id", "content"}; `reasoning` items are dropped.
    `history`: the stored conversation before `input` (its calls may be answered).

    Raises APIError(400) naming the item: a message without a role, non-text content
    parts (images, files), a function_call without call_id/name/arguments or with
    arguments that are not a JSON object or a call_id of an earlier function_call, a
    function_call_output without call_id or whose call_id answers no earlier
    function_call, other item types.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    known = _known_call_ids(history or [])
    for i, item in enumerate(items):
        if item.type == "reasoning":
            continue  # an earlier turn's reasoning: templates do not render it
        if item.type == "function_call":
            call = _function_call(i, item)
            if any(c["id"] == call["id"] for m in messages for c in m.get("tool_calls") or ()):
                # Two calls under one call_id: an output could not say which it answers.
                raise bad_request(
                    f"input[{i}] repeats call_id {call['id']!r} of an earlier function_call item; "
                    "each call needs its own call_id",
                    f"input[{i}].call_id",
                )
            known.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if item.type == "function_call_output":
            if not isinstance(item.call_id, str) or not item.call_id:
                raise bad_request(
                    f"input[{i}] is a function_call_output item and needs call_id (the "
                    "call_id of the function_call it answers)",
                    f"input[{i}].call_id",
                )
            if item.call_id not in known:
                raise bad_request(
                    f"input[{i}] answers call_id {item.call_id!r}, but no function_call "
                    "with that call_id comes before it (in input or the "
                    "previous_response_id's conversation)",
                    f"input[{i}].call_id",
                )
            output = _parts_text(item.output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            continue
        if item.type != "message":
            raise bad_request(
                f"input[{i}] has type {item.type!r}; supported items are message, "
                "function_call, function_call_output and reasoning",
                f"input[{i}].type",
            )
        if item.role is None:
            raise bad_request(
                f"input[{i}] needs a role: user, assistant, system or developer",
                f"input[{i}].role",
            )
        text = _parts_text(item.content, f"input[{i}].content")
        messages.append({"role": item.role, "content": text})
    return messages


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Log-probabilities are computed only when `include` asks for them (OpenAI's and
    vLLM's rule; `top_logprobs` alone changes nothing)."""
    return INCLUDE_LOGPROBS in (req.include or ())


def chat_tools(req: ResponsesRequest) -> tuple[list[ChatCompletionTool] | None, Any]:
    """The request's tools and tool_choice as the chat route's. A tool_choice of "auto"
    or "none" without tools means no tools (OpenAI accepts it)."""
    if not req.tools:
        if req.tool_choice in (None, "auto", "none"):
            return ([] if req.tools is not None else None), None
        return None, _chat_tool_choice(req.tool_choice)
    tools = [
        ChatCompletionTool(function=FunctionDefinition(
            name=t.name or "", description=t.description, parameters=t.parameters,
            strict=t.strict,
        ))
        for t in req.tools
    ]  # fmt: skip
    return tools, _chat_tool_choice(req.tool_choice)


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return NamedToolChoice(function=NamedFunction(name=choice["name"]))
    return choice


def text_format(req: ResponsesRequest) -> TextFormat:
    """The request's `text.format` (plain text when unset)."""
    if req.text is None or req.text.format is None:
        return TextFormat()
    return req.text.format


def response_format(req: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` as the chat route's `response_format` (None for plain text)."""
    fmt = text_format(req)
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict,
    ))  # fmt: skip


def chat_request(
    req: ResponsesRequest, messages: list[dict[str, Any]], model: str
) -> ChatCompletionRequest:
    """The chat route's request for this Responses request (same sampling fields,
    tools, tool choice and structured output)."""
    logprobs = wants_logprobs(req)
    tools, tool_choice = chat_tools(req)
    return ChatCompletionRequest(
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        messages=[chat_message(m) for m in messages],
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
        tools=tools or None,
        tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req),
    )


def _tools_echo(run: ChatRun) -> list[dict[str, Any]]:
    """The request's function tools as checked, in the Responses shape."""
    out = []
    for tool in run.setup.choice.tools or ():
        fn = tool["function"]
        out.append({"type": "function", "name": fn["name"],
                    "description": fn.get("description"), "parameters": fn["parameters"],
                    "strict": fn.get("strict")})  # fmt: skip
    return out


def _text_format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = text_format(req)
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": fmt.type, "name": fmt.name, "description": fmt.description,
            "schema": fmt.schema, "strict": fmt.strict}  # fmt: skip


def _tool_choice_echo(req: ResponsesRequest) -> str | dict[str, str]:
    if isinstance(req.tool_choice, dict):
        return {"type": "function", "name": req.tool_choice["name"]}
    return req.tool_choice or "auto"


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
        self.output = ResponseOutput(plain=not run.is_parsed, message_id=f"msg_{uuid.uuid4().hex}")
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
            "parallel_tool_calls": run.setup.choice.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": run.params.temperature,
            "top_p": run.params.top_p,
            "text": {"format": _text_format_echo(req)},
            "tool_choice": _tool_choice_echo(req),
            "tools": _tools_echo(run),
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

    async def events(self) -> AsyncIterator[Event]:
        """Run the request to its end: the output items' events (responses_output.py),
        then the final body is ready (`finish`)."""
        for event in self.output.start():
            yield event
        async for delta in self.run.deltas():
            lps = self.token_logprobs(delta.token_ids, delta.logprobs)
            for event in self.output.feed(delta, lps):
                yield event
        for event in self.output.finish(self.status()):
            yield event

    def status(self) -> str:
        return "completed" if self.run.finish_reason == "stop" else "incomplete"

    def finish(self) -> dict[str, Any]:
        """The final body once the run finished: status, output, usage."""
        run = self.run
        status = self.status()
        if run.finish_reason == "length":
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        self.body["status"] = status
        self.body["completed_at"] = int(time.time())
        self.body["output"] = self.output.final or []
        self.body["usage"] = {
            "input_tokens": run.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": run.num_cached_tokens},
            "output_tokens": run.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": run.num_reasoning_tokens},
            "total_tokens": run.num_prompt_tokens + run.num_output_tokens,
        }
        return self.body

    def turn(self) -> list[dict[str, Any]]:
        """The assistant turn as chat messages (the next request's history): its text
        and its calls, under their call_ids."""
        message: dict[str, Any] = {"role": "assistant", "content": self.run.text}
        calls = [
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in self.output.final or () if item["type"] == "function_call"
        ]  # fmt: skip
        if calls:
            message["tool_calls"] = calls
        return [message]

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
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = previous.conversation()
    conversation = [*history, *input_messages(req.input, history)]
    if not conversation:
        raise bad_request("input is empty; send a string or at least one message", "input")
    messages = conversation
    if req.instructions:  # "" is none, as vLLM takes it: the template's default applies
        messages = [{"role": "system", "content": req.instructions}, *conversation]
    response_id = f"resp_{uuid.uuid4().hex}"
    run = await ChatRun.open(
        ctx,
        chat_request(req, messages, model),
        response_id,
        kind="responses",
        param_names=responses_param,
    )
    resp = _Response(ctx, req, run, model, response_id)

    def keep(body: dict[str, Any]) -> None:
        if req.store:
            store.put(dict(body), conversation, run.text, resp.turn())

    if req.stream:
        events = _Events()
        return StreamingResponse(
            _stream(resp, events, keep),
            cleanup=run.aclose,
            headers=HEADERS,
            error_event=lambda err: events("response.failed", response=resp.fail(err)),
        )
    try:
        async for _ in resp.events():
            pass
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
    try:
        yield ev("response.created", response=resp.snapshot())
        yield ev("response.in_progress", response=resp.snapshot())
        async for type, fields in resp.events():
            yield ev(type, **fields)
        body = resp.finish()
        keep(body)
        last = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield ev(last, response=body)
    except Exception as err:
        yield ev("response.failed", response=resp.fail(engine_error(err)))
    finally:
        await resp.run.aclose()


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


async def cancel_response(
    ctx: ServingContext, store: ResponseStore, request: APIRequest
) -> Response:
    """POST /v1/responses/{response_id}/cancel: OpenAI cancels only background
    responses, and this server runs none (`background: true` is a 400), so a stored
    response is a 400 with vLLM's message and an unknown id a 404. Raises APIError."""
    response_id = request.path_params["response_id"]
    if response_id not in store:
        raise _not_found(response_id, "response_id")
    raise bad_request(
        "Cannot cancel a synchronous response. (Only background responses can be "
        "cancelled; this server runs none.)",
        "response_id",
    )
