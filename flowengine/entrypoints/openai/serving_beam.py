"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's extra field).

The beam width is the request's `n` (completions: `best_of` when set, returning the
best `n` of them); `length_penalty` and `early_stopping` are transformers' (see
flowengine/beam_search.py). The search runs through `async_engine.beam_search` on the
engine's `submit`, so the event loop keeps serving other requests.

Streaming does what vLLM does: the search yields its result only at the end, so the
stream carries each choice's whole text in one chunk (with its finish_reason), then
usage if asked, then `[DONE]`. Fields that would change the output of a sampled
request but that beam search cannot honour (stop strings, logprobs, structured
outputs, penalties, ...) are refused with a 400 naming the field, as is a width over
`--max-n` or one whose 2W log-probabilities per step exceed `--max-logprobs`.

A search passes the server's admission as every other request does: its first step
holds a seat of `--max-queue-len` until its first output, so a full queue answers 429
`queue_full`. Each step request is an engine request, so the latency histograms count
it as any other (vLLM's beam search over `generate` does the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from flowengine.beam_search import BeamSearchOutput, BeamSearchParams, num_candidates
from flowengine.entrypoints.async_engine import beam_search
from flowengine.entrypoints.openai import sse
from flowengine.entrypoints.openai.asgi import Response, StreamingResponse, json_response
from flowengine.entrypoints.openai.context import ServingContext, log_request, usage
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import Admission, engine_error
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from flowengine.entrypoints.openai.sampling import check_limits
from flowengine.outputs import RequestOutput
from flowengine.sampling_params import RequestOutputKind, SamplingParams

# (field, is it set) pairs of fields beam search cannot honour.
_NOT_WITH_BEAMS = (
    ("stop", lambda r: bool(r.stop)),
    ("stop_token_ids", lambda r: bool(r.stop_token_ids)),
    ("logit_bias", lambda r: bool(r.logit_bias)),
    ("allowed_token_ids", lambda r: r.allowed_token_ids is not None),
    ("bad_words", lambda r: bool(r.bad_words)),
    ("min_tokens", lambda r: r.min_tokens > 0),
    ("prompt_logprobs", lambda r: r.prompt_logprobs is not None),
    ("top_p", lambda r: r.top_p is not None and r.top_p != 1.0),
    ("top_k", lambda r: r.top_k is not None and r.top_k not in (0, -1)),
    ("min_p", lambda r: r.min_p is not None and r.min_p != 0.0),
    ("presence_penalty", lambda r: bool(r.presence_penalty)),
    ("frequency_penalty", lambda r: bool(r.frequency_penalty)),
    ("repetition_penalty", lambda r: r.repetition_penalty not in (None, 1.0)),
)


def beam_params(
    ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest,
    params: SamplingParams,
) -> tuple[BeamSearchParams, int, bool]:
    """(BeamSearchParams, number of sequences to return, fit max_tokens to the
    context the prompt leaves: always) of a use_beam_search request; `params` are its already checked SamplingParams.
    Raises APIError(400) naming the field."""
    for name, is_set in _NOT_WITH_BEAMS:
        if is_set(req):
            raise bad_request(f"{name} cannot be used with use_beam_search", name)
    if params.structured_outputs is not None:
        raise bad_request("structured outputs (response_format, structured_outputs, "
                          "guided_*, tool_choice required or named) cannot be used with "
                          "use_beam_search", "use_beam_search")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            raise bad_request("logprobs cannot be used with use_beam_search", "logprobs")
        if req.echo:
            raise bad_request("echo cannot be used with use_beam_search", "echo")
        width = req.best_of if req.best_of is not None else req.n
        if req.n > width:
            raise bad_request(f"n={req.n} is more than best_of={width}, the beam width",
                              "best_of")
        width_field = "best_of" if req.best_of is not None else "n"
    else:
        if req.logprobs:
            raise bad_request("logprobs cannot be used with use_beam_search", "logprobs")
        width, width_field = req.n, "n"
    if width > ctx.limits.max_n:
        raise bad_request(
            f"{width_field} is {width}, over this server's limit of {ctx.limits.max_n} "
            "beams (--max-n sets it)", width_field)
    # Each step asks the engine for the top 2W log-probabilities of every beam: the
    # server's limit on log-probabilities per token bounds the width.
    needed = num_candidates(width, 1)
    if ctx.limits.max_logprobs != -1 and needed > ctx.limits.max_logprobs:
        raise bad_request(
            f"{width_field}={width} beams need the top {needed} log-probabilities per step, "
            f"over this server's limit of {ctx.limits.max_logprobs} (--max-logprobs); "
            f"ask for at most {ctx.limits.max_logprobs // 2} beams", width_field)
    # As for a sampled request (vLLM's get_max_tokens): max_tokens unset or over the
    # context the prompt leaves is lowered to that context, not refused.
    max_model_len = ctx.engine.max_model_len
    try:
        beam = BeamSearchParams(
            beam_width=width,
            max_tokens=(max_model_len if params.max_tokens is None
                        else min(params.max_tokens, max_model_len)),
            ignore_eos=req.ignore_eos,
            temperature=params.temperature,
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            early_stopping=False if req.early_stopping is None else req.early_stopping,
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None
    return beam, req.n, True


class _AdmittedEngine:
    """The engine as one search sees it: the first `submit` (the prompt's step) passes
    `admission` and holds its seat until that step's first output, as `EngineStream`
    does for other requests. Every other attribute is the engine's (each step request
    is an engine request, so the frontend's RequestStats count its latencies, as
    vLLM's beam search over `generate`)."""

    def __init__(self, engine: Any, admission: Admission) -> None:
        self._engine = engine
        self._admission = admission
        self._num_submits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, prompt: Any, params: SamplingParams, request_id: str | None = None, *,
               priority: int = 0, output_kind: RequestOutputKind | None = None,
               ) -> AsyncIterator[RequestOutput]:
        self._num_submits += 1
        return self._step(self._num_submits == 1, prompt, params, request_id, priority,
                          output_kind)

    async def _step(self, is_first: bool, prompt: Any, params: SamplingParams,
                    request_id: str | None, priority: int,
                    output_kind: RequestOutputKind | None) -> AsyncIterator[RequestOutput]:
        pending = False
        if is_first:
            self._admission.enter()  # APIError(429) when the server's queue is full
            pending = True
        try:
            outputs = self._engine.submit(prompt, params, request_id, priority=priority,
                                          output_kind=output_kind)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if pending:
                        pending = False
                        self._admission.leave()
                    yield out
        finally:
            if pending:
                self._admission.leave()


async def _search(ctx: ServingContext, prompt: Any, beam: BeamSearchParams, fit: bool,
                  priority: int, truncate_prompt_tokens: int | None,
                  ) -> tuple[BeamSearchOutput, int]:
    engine = _AdmittedEngine(ctx.engine, ctx.admission)
    try:
        return await beam_search(engine, prompt, beam, priority=priority,
                                 fit_max_tokens=fit,
                                 truncate_prompt_tokens=truncate_prompt_tokens)
    except Exception as err:
        raise engine_error(err) from None


async def _search_all(ctx: ServingContext, prompts: list[Any], beam: BeamSearchParams,
                      fit: bool, priority: int, truncate_prompt_tokens: int | None,
                      ) -> list[tuple[BeamSearchOutput, int]]:
    """Every prompt's search at once; the first failure cancels the others (their
    step requests are aborted) and is raised."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_search(ctx, p, beam, fit, priority, truncate_prompt_tokens))
                     for p in prompts]
    except* Exception as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def beam_completion(
    ctx: ServingContext, req: CompletionRequest, params: SamplingParams,
    prompts: list[Any], base: dict[str, Any],
) -> Response:
    """The completions response of a use_beam_search request (choice i * n + j:
    sequence j of prompt i, best first). Raises APIError."""
    beam, n, fit = beam_params(ctx, req, params)
    if beam.beam_width > n:
        # The search runs best_of beams: --max-request-tokens counts them, not the n kept.
        check_limits(ctx.limits, msgspec.structs.replace(params, n=beam.beam_width),
                     len(prompts), ctx.engine.max_model_len, n_field="best_of")
    start = time.monotonic()
    results = await _search_all(ctx, prompts, beam, fit, req.priority,
                                params.truncate_prompt_tokens)
    choices = [
        {"index": i * n + j, "text": seq.text, "logprobs": None,
         "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        for i, (out, _) in enumerate(results) for j, seq in enumerate(out.sequences[:n])
    ]
    use = _usage(ctx, results, n)
    _log("completion", base["id"], use, [c["finish_reason"] for c in choices], start)
    if not req.stream:
        return json_response({**base, "choices": choices, "usage": use})
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return _stream_response(_events(base, choices, use, include_usage))


async def beam_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, params: SamplingParams,
    prompt: Any, base: dict[str, Any],
) -> Response:
    """The chat response of a use_beam_search request: n choices, best first, each
    a plain assistant message (no tool-call or reasoning parsing). Raises APIError."""
    beam, n, fit = beam_params(ctx, req, params)
    start = time.monotonic()
    result = await _search(ctx, prompt, beam, fit, req.priority, params.truncate_prompt_tokens)
    seqs = result[0].sequences[:n]
    use = _usage(ctx, [result], n)
    _log("chat", base["id"], use, [s.finish_reason for s in seqs], start)
    if not req.stream:
        choices = [
            {"index": j, "message": {"role": "assistant", "content": s.text},
             "logprobs": None, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
            for j, s in enumerate(seqs)
        ]
        return json_response({**base, "choices": choices, "usage": use})
    chunks: list[dict[str, Any]] = []
    for j, s in enumerate(seqs):
        chunks.append({"index": j, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None})
        chunks.append({"index": j, "delta": {"content": s.text}, "logprobs": None,
                       "finish_reason": s.finish_reason, "stop_reason": s.stop_reason})
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return _stream_response(_events(base, chunks, use, include_usage))


def _usage(ctx: ServingContext, results: list[tuple[BeamSearchOutput, int]], n: int
           ) -> dict[str, Any]:
    num_prompt = sum(num for _, num in results)
    num_generated = sum(len(s.output_token_ids) for out, _ in results
                        for s in out.sequences[:n])
    return usage(ctx, num_prompt, num_generated, 0)


def _stream_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, headers=sse.HEADERS, error_event=sse.error_event,
                             done_event=sse.DONE)


async def _events(base: dict[str, Any], choices: list[dict[str, Any]], use: dict[str, Any],
                  include_usage: bool) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    for choice in choices:
        yield sse.event({**base, "choices": [choice], **extra})
    if include_usage:
        yield sse.event({**base, "choices": [], "usage": use})
    yield sse.DONE


def _log(kind: str, request_id: str, use: dict[str, Any], reasons: list[Any],
         start: float) -> None:
    log_request(kind, request_id, use["prompt_tokens"], use["completion_tokens"], reasons,
                None, time.monotonic() - start, "ok")
