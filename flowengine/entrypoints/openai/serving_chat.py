"""POST /v1/chat/completions: OpenAI's chat completion, whole or streamed as SSE.

Streaming follows OpenAI's chunk sequence: one chunk per choice with
`delta: {"role": "assistant", "content": ""}` first, then content deltas, the
`finish_reason` on a choice's last chunk, with `stream_options.include_usage` a final
chunk with `choices: []` and `usage` (and `usage: null` on every earlier chunk), then
`data: [DONE]`. The response starts once the engine produced its first output, so
input errors still get a 4xx status (see generation.py).

Tool calling and reasoning (chat_parsing.py): `tools` reach the chat template;
`tool_choice` required / a named function constrain the output with a JSON schema
(tool_parsers/request.py), `auto` is parsed by the server's `--tool-call-parser`;
with `--reasoning-parser` the text before `</think>` becomes `reasoning_content`.
Streamed, each choice's text runs through its own `ChoiceParser`, so deltas carry
`reasoning_content`, `content` and OpenAI's `tool_calls` pieces (index, id, type,
name, argument fragments), and the last one finish_reason `tool_calls` after calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from flowengine.entrypoints.openai import sse
from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.chat_parsing import ChoiceDelta, ChoiceParser, join_choice
from flowengine.entrypoints.openai.context import ServingContext, log_request, usage
from flowengine.entrypoints.openai.errors import bad_request
from flowengine.entrypoints.openai.generation import EngineStream, engine_error
from flowengine.entrypoints.openai.logprobs import (
    ALL_LOGPROBS,
    chat_logprobs,
    prompt_logprobs_json,
)
from flowengine.entrypoints.openai.multi_stream import open_streams
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest
from flowengine.entrypoints.openai.sampling import chat_messages, chat_params, check_limits
from flowengine.entrypoints.openai.tool_parsers.request import (
    ToolChoice,
    resolve_tool_choice,
    tool_choice_schema,
)
from flowengine.outputs import CompletionOutput, RequestOutput
from flowengine.reasoning import ThinkReasoningParser, get_reasoning_parser
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams

# Makes a choice's parser from the prompt text; None: plain content.
ParserFactory = Callable[[str | None], ChoiceParser] | None


def _usage(ctx: ServingContext, stream: EngineStream) -> dict[str, Any]:
    return usage(
        ctx, stream.num_prompt_tokens, stream.num_generated_tokens, stream.num_cached_tokens
    )


async def create_chat_completion(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle one chat completion request. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, ChatCompletionRequest)
    model = ctx.resolve_model(req.model)
    params = chat_params(req, ctx.engine.default_sampling_params)
    check_limits(ctx.limits, params, 1, ctx.engine.max_model_len, "top_logprobs")
    parsing = ctx.chat_parsing
    choice = resolve_tool_choice(
        req.tools, req.tool_choice, req.parallel_tool_calls, auto_enabled=parsing.auto_enabled
    )
    params = _tool_params(params, choice, parsing.tool_parser_class(choice))
    if parsing.reasoning_parser is not None:
        params = _after_reasoning(params, get_reasoning_parser(parsing.reasoning_parser))
    make_parser = parsing.parser_factory(choice)
    messages = chat_messages(req)
    # The plain conversation, or {"messages": ..., options} when an option is not the
    # default (the engine's Tokenizer renders it: input_processor.CHAT_OPTIONS).
    options: dict[str, Any] = {}
    if choice.tools is not None and not (
        choice.mode == "none" and parsing.exclude_tools_when_tool_choice_none
    ):
        options["tools"] = choice.tools
    if req.cache_salt is not None:
        options["cache_salt"] = req.cache_salt
    if req.chat_template_kwargs:
        options["chat_template_kwargs"] = req.chat_template_kwargs
    if req.chat_template is not None:
        if not ctx.trust_request_chat_template:
            # vLLM's rule and message: a template is code the server would run.
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template.",
                "chat_template",
            )
        options["chat_template"] = req.chat_template
    if not req.add_generation_prompt:
        options["add_generation_prompt"] = False
    if req.continue_final_message:
        options["continue_final_message"] = True
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    [stream] = await open_streams(
        ctx.engine,
        [{"messages": messages, **options} if options else messages],
        params,
        request_id,
        priority=req.priority,
        admission=ctx.admission,
        metrics=ctx.metrics,
    )
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    if num_top == -1:  # the whole vocabulary
        num_top = ALL_LOGPROBS
    base = {
        "id": request_id,
        "object": "chat.completion.chunk" if req.stream else "chat.completion",
        "created": int(time.time()),
        "model": model,
    }
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = _chat_events(ctx, stream, base, params.n, num_top, include_usage, make_parser)
        return StreamingResponse(
            events,
            cleanup=stream.aclose,
            headers=sse.HEADERS,
            error_event=sse.error_event,
            done_event=sse.DONE,
        )
    # The engine's DELTA outputs folded by the one fold (RequestOutput.add); the
    # stream stays DELTA for the per-output TTFT/ITL metrics (generation.py).
    total = RequestOutput(request_id, None, [])
    outcome = "aborted"
    try:
        async for out in stream:
            if total.prompt is None:
                total.prompt = out.prompt
            total.add(out, aggregate=True)
        outcome = "ok"
    finally:
        await stream.aclose()
        choices = _final_choices(total, params.n)
        _log(stream, [c.finish_reason for c in choices], outcome)
    prompt, prompt_logprobs = total.prompt, total.prompt_logprobs
    return json_response(
        {
            **base,
            "choices": [
                _choice_body(ctx, i, ch, num_top, make_parser and make_parser(prompt))
                for i, ch in enumerate(choices)
            ],
            "usage": _usage(ctx, stream),
            # vLLM's field: the prompt's logprobs when prompt_logprobs was asked for.
            **({"prompt_logprobs": prompt_logprobs_json(prompt_logprobs)}
               if params.prompt_logprobs is not None else {}),
        }
    )


def _final_choices(total: RequestOutput, n: int) -> list[CompletionOutput]:
    """The n completions of a folded output, in index order (empty where none came)."""
    by_index = {c.index: c for c in total.outputs}
    return [by_index.get(i) or CompletionOutput(i, "", []) for i in range(n)]


def _tool_params(
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


def _after_reasoning(
    params: SamplingParams, parser_cls: type[ThinkReasoningParser]
) -> SamplingParams:
    """With a reasoning parser, a JSON constraint (response_format json_schema or
    json_object, a tool choice's schema) applies only after the think block: it becomes
    the structural tag of `ThinkReasoningParser.gated_structural_tag`. Other kinds
    (regex, choice, grammar, structural_tag) apply from the first token."""
    constraint = params.structured_outputs
    if constraint is None or constraint.kind not in ("json", "json_object"):
        return params
    schema = orjson.loads(constraint.spec) if constraint.kind == "json" else {"type": "object"}
    tag = parser_cls.gated_structural_tag(schema)
    return params.clone(structured_outputs=StructuredOutputsParams(structural_tag=tag))


def _choice_body(
    ctx: ServingContext,
    index: int,
    ch: CompletionOutput,
    num_top: int | None,
    parser: ChoiceParser | None,
) -> dict[str, Any]:
    logprobs = None
    if num_top is not None:
        content = chat_logprobs(ch.token_ids, ch.logprobs or [], num_top, ctx.tokenizer)
        logprobs = {"content": content, "refusal": None}
    finish_reason = ch.finish_reason
    if parser is None:
        message: dict[str, Any] = {"role": "assistant", "content": ch.text}
    else:
        message = join_choice([parser.feed(ch.text), parser.finish()])
        finish_reason = parser.finish_reason(finish_reason)
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": ch.stop_reason,
    }


async def _chat_events(
    ctx: ServingContext,
    stream: EngineStream,
    base: dict[str, Any],
    n: int,
    num_top: int | None,
    include_usage: bool,
    make_parser: ParserFactory = None,
) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    choice: dict[str, Any]
    finish_reasons: list[str | None] = [None] * n
    parsers: list[ChoiceParser] | None = None
    outcome = "aborted"
    try:
        for i in range(n):
            role = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            yield sse.event({**base, "choices": [choice], **extra})
        async for out in stream:
            if make_parser is not None and parsers is None:
                parsers = [make_parser(out.prompt) for _ in range(n)]
            for c in out.outputs:
                finish_reason = c.finish_reason
                if parsers is None:
                    delta: dict[str, Any] = {"content": c.text} if c.text else {}
                else:
                    parsed = parsers[c.index].feed(c.text) if c.text else ChoiceDelta()
                    if finish_reason is not None:
                        parsed.extend(parsers[c.index].finish())
                        finish_reason = parsers[c.index].finish_reason(finish_reason)
                    delta = parsed.delta_json()
                has_logprobs = num_top is not None and bool(c.token_ids)
                if not delta and finish_reason is None and not has_logprobs:
                    continue  # nothing to show yet (held back for a stop string, partial UTF-8)
                if num_top is not None and not delta:
                    delta = {"content": ""}
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
                if num_top is not None and c.token_ids and c.logprobs:
                    choice["logprobs"] = {
                        "content": chat_logprobs(c.token_ids, c.logprobs, num_top, ctx.tokenizer),
                        "refusal": None,
                    }
                if finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                    finish_reasons[c.index] = finish_reason
                yield sse.event({**base, "choices": [choice], **extra})
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": _usage(ctx, stream)})
        outcome = "ok"
    except Exception as err:
        outcome = "error"
        yield sse.error_event(engine_error(err))
    finally:
        await stream.aclose()
        _log(stream, finish_reasons, outcome)
    yield sse.DONE


def _log(stream: EngineStream, finish_reasons: list[str | None], outcome: str) -> None:
    log_request(
        "chat",
        stream.request_id,
        stream.num_prompt_tokens,
        stream.num_generated_tokens,
        finish_reasons,
        stream.ttft_s,
        stream.elapsed_s,
        outcome,
    )
