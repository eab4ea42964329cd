"""POST /v1/completions: OpenAI's legacy completions, whole or streamed as SSE.

`prompt` may hold several prompts (strings or token-id lists); each runs as its own
engine request, concurrently, and choice `i * n + j` is sample j of prompt i (the
order OpenAI and vLLM use). `echo` prepends the prompt text to each choice; with
`max_tokens` 0 a choice is the prompt alone (its one generated token dropped, as vLLM).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flowengine.entrypoints.openai import sse
from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    Response,
    StreamingResponse,
    json_response,
)
from flowengine.entrypoints.openai.context import ServingContext, log_request, usage
from flowengine.entrypoints.openai.errors import bad_request
from flowengine.entrypoints.openai.generation import EngineStream, engine_error
from flowengine.entrypoints.openai.logprobs import (
    ALL_LOGPROBS,
    completion_logprobs,
    echo_completion_logprobs,
    extend_completion_logprobs,
    prompt_logprobs_json,
)
from flowengine.entrypoints.openai.multi_stream import close_streams, merge_streams, open_streams
from flowengine.entrypoints.openai.protocol import CompletionRequest, StreamOptions
from flowengine.entrypoints.openai.sampling import (
    check_limits,
    completion_max_tokens_check,
    completion_params,
    with_max_tokens_check,
)
from flowengine.outputs import RequestOutput
from flowengine.sampling_params import RequestOutputKind


def split_prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The prompts of a request. Raises APIError(400) for an empty or mixed list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is an empty list; give at least one prompt", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists; do not mix these forms",
        "prompt",
    )


def _check_fits_queue(ctx: ServingContext, num_prompts: int) -> None:
    """Raise APIError(400) when the prompts alone outnumber the server's queue.

    Each prompt takes one seat of the queue until its first output; a request with
    more prompts than seats would get 429 on every retry (and fill the queue for
    everyone else on the way), so it is refused as it stands."""
    max_queue_len = ctx.admission.max_queue_len
    if max_queue_len is not None and num_prompts > max_queue_len:
        raise bad_request(
            f"the request has {num_prompts} prompts, over this server's queue of "
            f"{max_queue_len} requests; send at most {max_queue_len} prompts per request "
            "(the server's --max-queue-len sets the limit)",
            "prompt",
        )


def _usage(ctx: ServingContext, streams: Sequence[EngineStream]) -> dict[str, Any]:
    return usage(
        ctx,
        sum(s.num_prompt_tokens for s in streams),
        sum(s.num_generated_tokens for s in streams),
        sum(s.num_cached_tokens for s in streams),
    )


def _prompt_text(ctx: ServingContext, stream: EngineStream, truncated: bool) -> str:
    """The echoed prompt: the text of the prompt tokens the model saw (`truncated`:
    truncate_prompt_tokens was set, so the request's text may hold more)."""
    first = stream.first_output
    if first.prompt is not None and not truncated:
        return first.prompt
    return ctx.tokenizer.decode(first.prompt_token_ids)


async def create_completion(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle one completions request. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, CompletionRequest)
    model = ctx.resolve_model(req.model)
    params = completion_params(req, ctx.engine.default_sampling_params)
    prompts = split_prompts(req.prompt)
    check_limits(ctx.limits, params, len(prompts), ctx.engine.max_model_len)
    _check_fits_queue(ctx, len(prompts))
    if req.cache_salt is not None:
        prompts = [
            {
                "prompt" if isinstance(p, str) else "prompt_token_ids": p,
                "cache_salt": req.cache_salt,
            }
            for p in prompts
        ]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    if req.use_beam_search:  # (beam search checks that max_tokens fits itself)
        from flowengine.entrypoints.openai.serving_beam import beam_completion

        base = {"id": request_id, "object": "text_completion",
                "created": int(time.time()), "model": model}
        return await beam_completion(ctx, req, params, prompts, base)
    # A max_tokens the client sent must fit the context with each prompt (400, as
    # vLLM); the engine checks it once the prompt is tokenized.
    check = completion_max_tokens_check(req)
    streams = await open_streams(
        ctx.engine,
        [with_max_tokens_check(p, check) for p in prompts],
        params,
        request_id,
        priority=req.priority,
        admission=ctx.admission,
        # Non-streaming: one FINAL_ONLY output per prompt, nothing to join per step.
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
    )
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    handed_off = False
    try:
        state = _Choices(ctx, streams, params.n, req.echo, req.logprobs,
                         req.prompt_logprobs is not None, echo_only=req.max_tokens == 0,
                         truncated=params.truncate_prompt_tokens is not None)
        if req.stream:
            options = req.stream_options or StreamOptions()
            response = StreamingResponse(
                _completion_events(ctx, state, streams, base, *options.usage_flags()),
                cleanup=functools.partial(close_streams, streams),
                headers=sse.HEADERS,
                error_event=sse.error_event,
                done_event=sse.DONE,
            )
            handed_off = True
            return response
        return json_response(await _collect(ctx, state, streams, base))
    finally:
        if not handed_off:
            await close_streams(streams)


async def _collect(
    ctx: ServingContext,
    state: _Choices, streams: Sequence[EngineStream], base: dict[str, Any]
) -> dict[str, Any]:
    """The whole completion object, once every stream finished."""
    n = len(state.texts) // len(streams)
    # Each prompt's one FINAL_ONLY output (RequestOutput.add copies it into its
    # total), formatted once per choice (echo, text offsets).
    totals: list[RequestOutput | None] = [None] * len(streams)
    outcome = "aborted"
    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                total = totals[i]
                if total is None:
                    totals[i] = RequestOutput(out.request_id, out.prompt,
                                              out.prompt_token_ids)
                    total = totals[i]
                total.add(out, aggregate=True)
        outcome = "ok"
    finally:
        for i, total in enumerate(totals):
            for c in total.outputs if total is not None else []:
                if c.finish_reason is not None:
                    state.finish(i * n + c.index, c.finish_reason, c.stop_reason)
        _log(base["id"], streams, state.finish_reasons, outcome)
    for i, total in enumerate(totals):
        if total is not None:
            state.record_prompt_logprobs(i, total.prompt_logprobs)
            for c in total.outputs:
                state.add(i * n + c.index, c.text, c.token_ids, c.logprobs)
    choices = [
        {
            "index": k,
            "text": "".join(state.texts[k]),
            "logprobs": state.logprobs[k],
            "finish_reason": state.finish_reasons[k],
            "stop_reason": state.stop_reasons[k],
        }
        for k in range(len(state.texts))
    ]
    if state.want_prompt_logprobs:
        for k, choice in enumerate(choices):
            choice["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs[k // n])
    return {**base, "choices": choices, "usage": _usage(ctx, streams)}


class _Choices:
    """Per-choice text, logprobs and finish reasons; echo and text offsets."""

    def __init__(
        self,
        ctx: ServingContext,
        streams: Sequence[EngineStream],
        n: int,
        echo: bool,
        num_top: int | None,
        want_prompt_logprobs: bool = False,
        echo_only: bool = False,
        truncated: bool = False,
    ) -> None:
        self.ctx = ctx
        self.echo_only = echo_only  # echo with max_tokens 0: the generated token is dropped
        # -1 (the whole vocabulary) lists every token in top_logprobs.
        self.num_top = ALL_LOGPROBS if num_top == -1 else num_top
        num = len(streams) * n
        self.pending_echo: list[str] = [
            _prompt_text(ctx, streams[k // n], truncated) if echo else "" for k in range(num)
        ]
        self.texts: list[list[str]] = [[] for _ in range(num)]
        self.offsets = [len(e) for e in self.pending_echo]
        # Per prompt (stream): the engine's prompt logprobs, once its first output has them.
        self.streams = streams
        self.want_prompt_logprobs = want_prompt_logprobs
        self.prompt_logprobs: list[Any] = [None] * len(streams)
        # echo with logprobs: the prompt's tokens and logprobs lead the choice's lists.
        self.pending_echo_logprobs = [echo and num_top is not None] * num
        self.logprobs: list[dict[str, list[Any]] | None] = [
            None if num_top is None else {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
            }
            for _ in range(num)
        ]  # fmt: skip
        self.finish_reasons: list[str | None] = [None] * num
        self.stop_reasons: list[int | str | None] = [None] * num

    def add(
        self, k: int, text: str, token_ids: Sequence[int], logprobs: Any
    ) -> tuple[str, dict[str, list[Any]] | None]:
        """Record a delta of choice k; returns (text to show, its logprobs or None)."""
        if self.echo_only:
            text, token_ids, logprobs = "", (), ()
        text = self.pending_echo[k] + text
        self.pending_echo[k] = ""
        self.texts[k].append(text)
        delta_lp = None
        echo_now = self.echo_only and self.pending_echo_logprobs[k]
        if self.num_top is not None and (token_ids and logprobs or echo_now):
            delta_lp = completion_logprobs(
                token_ids, logprobs, self.num_top, self.ctx.tokenizer, self.offsets[k]
            )
            if self.pending_echo_logprobs[k]:
                self.pending_echo_logprobs[k] = False
                delta_lp = self._echoed(k, delta_lp)
            extend_completion_logprobs(self.logprobs[k], delta_lp)  # type: ignore[arg-type]
            self.offsets[k] = delta_lp["text_offset"][-1] + len(delta_lp["tokens"][-1])
        return text, delta_lp

    def record_prompt_logprobs(self, i: int, prompt_logprobs: Any) -> None:
        """Keep prompt i's logprobs (they come with its first output)."""
        if prompt_logprobs is not None and self.prompt_logprobs[i] is None:
            self.prompt_logprobs[i] = prompt_logprobs

    def _echoed(self, k: int, output_lp: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The prompt's lists followed by the output's, offsets re-based after the prompt."""
        n = len(self.texts) // len(self.streams)
        ids = self.streams[k // n].first_output.prompt_token_ids
        plps = self.prompt_logprobs[k // n]
        if plps is None:
            raise RuntimeError("the engine returned no prompt logprobs for an echo request")
        merged = echo_completion_logprobs(ids, plps, self.num_top or 0, self.ctx.tokenizer)
        shift = merged["text_offset"][-1] + len(merged["tokens"][-1]) - self.offsets[k]
        output_lp["text_offset"] = [o + shift for o in output_lp["text_offset"]]
        extend_completion_logprobs(merged, output_lp)
        return merged

    def finish(self, k: int, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reasons[k], self.stop_reasons[k] = reason, stop_reason


async def _completion_events(
    ctx: ServingContext,
    state: _Choices,
    streams: Sequence[EngineStream],
    base: dict[str, Any],
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    n = len(state.texts) // len(streams)
    num_tokens = [0] * len(state.texts)  # per choice, for continuous usage
    outcome = "aborted"
    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                state.record_prompt_logprobs(i, out.prompt_logprobs)
                for c in out.outputs:
                    k = i * n + c.index
                    num_tokens[k] += len(c.token_ids)
                    text, lp = state.add(k, c.text, c.token_ids, c.logprobs)
                    if not text and c.finish_reason is None and lp is None:
                        continue  # nothing to show yet (held back for a stop string)
                    choice: dict[str, Any] = {
                        "index": k,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                    if c.finish_reason is not None:
                        state.finish(k, c.finish_reason, c.stop_reason)
                        choice["stop_reason"] = c.stop_reason
                    if continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
                        stream = streams[i]
                        extra = {"usage": usage(ctx, stream.num_prompt_tokens, num_tokens[k],
                                                stream.num_cached_tokens)}
                    yield sse.event({**base, "choices": [choice], **extra})
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": _usage(ctx, streams)})
        outcome = "ok"
    except Exception as err:
        outcome = "error"
        yield sse.error_event(engine_error(err))
    finally:
        # merge_streams closed (and, if unfinished, aborted) every stream.
        _log(base["id"], streams, state.finish_reasons, outcome)
    yield sse.DONE


def _log(
    request_id: str, streams: Sequence[EngineStream], reasons: list[str | None], outcome: str
) -> None:
    ttfts = [s.ttft_s for s in streams if s.ttft_s is not None]
    log_request(
        "completion",
        request_id,
        sum(s.num_prompt_tokens for s in streams),
        sum(s.num_generated_tokens for s in streams),
        reasons,
        min(ttfts) if ttfts else None,
        max(s.elapsed_s for s in streams),
        outcome,
    )
