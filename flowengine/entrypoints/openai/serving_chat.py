"""POST /v1/chat/completions: OpenAI's chat completion, whole or streamed as SSE.

Streaming follows OpenAI's chunk sequence: one chunk per choice with
`delta: {"role": "assistant", "content": ""}` first, then content deltas, the
`finish_reason` on a choice's last chunk, with `stream_options.include_usage` a final
chunk with `choices: []` and `usage` (and `usage: null` on every earlier chunk; with
vLLM's `continuous_usage_stats` each chunk's choice's usage so far), then
`data: [DONE]`. The response starts once the engine produced its first output, so
input errors still get a 4xx status (see generation.py).

Tool calling and reasoning (chat_tools.py, shared with the Responses and Anthropic
routes; chat_parsing.py): `tools` reach the chat template;
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
from collections.abc import AsyncIterator
from typing import Any

from flowengine.entrypoints.openai import sse
from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.chat_parsing import ChoiceDelta, ChoiceParser, join_choice
from flowengine.entrypoints.openai.chat_tools import ParserFactory, setup_chat_output
from flowengine.entrypoints.openai.context import ServingContext, log_request, usage
from flowengine.entrypoints.openai.generation import EngineStream, engine_error
from flowengine.entrypoints.openai.logprobs import (
    ALL_LOGPROBS,
    chat_logprobs,
    prompt_logprobs_json,
)
from flowengine.entrypoints.openai.multi_stream import open_streams
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest, StreamOptions
from flowengine.entrypoints.openai.sampling import (
    chat_max_tokens_check,
    chat_messages,
    chat_params,
    check_limits,
    with_max_tokens_check,
)
from flowengine.outputs import CompletionOutput, RequestOutput
from flowengine.sampling_params import RequestOutputKind


def _usage(ctx: ServingContext, stream: EngineStream) -> dict[str, Any]:
    return usage(
        ctx, stream.num_prompt_tokens, stream.num_generated_tokens, stream.num_cached_tokens
    )


def _choice_usage(ctx: ServingContext, stream: EngineStream, num_tokens: int) -> dict[str, Any]:
    """A chunk's usage with continuous_usage_stats: its choice's tokens so far (vLLM's)."""
    return usage(ctx, stream.num_prompt_tokens, num_tokens, stream.num_cached_tokens)


async def create_chat_completion(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle one chat completion request. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, ChatCompletionRequest)
    model = ctx.resolve_model(req.model)
    params = chat_params(req, ctx.engine.default_sampling_params)
    check_limits(ctx.limits, params, 1, ctx.engine.max_model_len, "top_logprobs")
    setup = setup_chat_output(
        ctx.chat_parsing, params, req.tools, req.tool_choice, req.parallel_tool_calls
    )
    params, make_parser = setup.params, setup.make_parser
    messages = chat_messages(req)
    # The plain conversation, or {"messages": ..., options} when an option is not the
    # default (the engine's Tokenizer renders it: input_processor.CHAT_OPTIONS).
    options: dict[str, Any] = {}
    if setup.template_tools is not None:
        options["tools"] = setup.template_tools
    if req.cache_salt is not None:
        options["cache_salt"] = req.cache_salt
    if req.chat_template_kwargs:
        options["chat_template_kwargs"] = req.chat_template_kwargs
    if ctx.request_chat_template(req.chat_template) is not None:
        options["chat_template"] = req.chat_template
    if not req.add_generation_prompt:
        options["add_generation_prompt"] = False
    if req.continue_final_message:
        options["continue_final_message"] = True
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    if req.use_beam_search:
        from flowengine.entrypoints.openai.serving_beam import beam_chat_completion

        base = {"id": request_id, "created": int(time.time()), "model": model,
                "object": "chat.completion.chunk" if req.stream else "chat.completion"}
        prompt = {"messages": messages, **options} if options else messages
        return await beam_chat_completion(ctx, req, params, prompt, base)
    # A max_tokens the client sent must fit the context with the prompt (400, as vLLM).
    prompt = with_max_tokens_check({"messages": messages, **options} if options else messages,
                                   chat_max_tokens_check(req))
    [stream] = await open_streams(
        ctx.engine,
        [prompt],
        params,
        request_id,
        priority=req.priority,
        admission=ctx.admission,
        # Non-streaming: one FINAL_ONLY output, nothing to join per step.
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
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
        options = req.stream_options or StreamOptions()
        events = _chat_events(ctx, stream, base, params.n, num_top, *options.usage_flags(),
                              make_parser)
        return StreamingResponse(
            events,
            cleanup=stream.aclose,
            headers=sse.HEADERS,
            error_event=sse.error_event,
            done_event=sse.DONE,
        )
    # One FINAL_ONLY output (the engine's latency metrics are taken per engine
    # output in RequestStats); RequestOutput.add copies it into `total`.
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
    continuous_usage: bool = False,
    make_parser: ParserFactory = None,
) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    choice: dict[str, Any]
    finish_reasons: list[str | None] = [None] * n
    num_tokens = [0] * n  # per choice, for continuous usage
    parsers: list[ChoiceParser] | None = None
    outcome = "aborted"
    try:
        for i in range(n):
            role = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            if continuous_usage:
                extra = {"usage": _choice_usage(ctx, stream, 0)}
            yield sse.event({**base, "choices": [choice], **extra})
        async for out in stream:
            if make_parser is not None and parsers is None:
                parsers = [make_parser(out.prompt) for _ in range(n)]
            for c in out.outputs:
                num_tokens[c.index] += len(c.token_ids)
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
                if continuous_usage:
                    extra = {"usage": _choice_usage(ctx, stream, num_tokens[c.index])}
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
