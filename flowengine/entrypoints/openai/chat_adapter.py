"""Other APIs' generation requests, run exactly as the chat route runs them.

The OpenAI Responses route and the Anthropic Messages route translate their request
into the chat route's own `ChatCompletionRequest`, so sampling defaults (the model's
generation_config included), validation, the server's per-request limits and the
messages given to the chat template are the chat route's (`chat_params`,
`check_limits`, `chat_messages`), and a greedy request gives the chat route's text.
`ChatRun` then opens the same `EngineStream` (admission, metrics, abort when closed
unfinished) and reads its outputs as deltas of one completion (`n` = 1): text, with
the token ids and log-probabilities when asked for. Nothing here knows an API's wire
format.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from flowengine.entrypoints.openai.context import ServingContext, log_request
from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.generation import EngineStream
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest
from flowengine.entrypoints.openai.sampling import chat_messages, chat_params, check_limits
from flowengine.outputs import SampleLogprobs
from flowengine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Delta:
    """New output of a run: text (may be empty when only tokens with log-probabilities
    arrived, the text held back for a stop string), the new token ids, and their
    log-probabilities (one dict per token) if the run asked for them, else None."""

    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None


def chat_request_params(
    ctx: ServingContext, req: ChatCompletionRequest, param_names: Mapping[str, str]
) -> SamplingParams:
    """The chat route's SamplingParams for `req`, checked against the server's limits.

    `param_names` maps chat field names to the calling API's (e.g. "max_tokens" ->
    "max_output_tokens"), so a 400's `param` names the field the client sent.
    Raises APIError(400).
    """
    try:
        params = chat_params(req, ctx.engine.default_sampling_params)
        check_limits(ctx.limits, params, 1, ctx.engine.max_model_len, "top_logprobs")
    except APIError as err:
        if err.param is not None:
            err.param = param_names.get(err.param, err.param)
        raise
    return params


class ChatRun:
    """One chat-style generation of a front door: its engine stream and folded output.

    Attributes:
        request_id: the engine request id (the API's own response id).
        params: the SamplingParams it runs with.
        text: the text generated so far (all deltas joined).
        token_ids, logprobs: every generated token id and, if asked for, its
            log-probabilities (one dict per token).
        finish_reason: "stop", "length" or "abort" once finished, else None.
        stop_reason: the stop string or stop token id that ended it (None for EOS or
            length), as `CompletionOutput.stop_reason`.
    """

    def __init__(self, stream: EngineStream, params: SamplingParams, kind: str) -> None:
        self.stream = stream
        self.request_id = stream.request_id
        self.params = params
        self.kind = kind
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._outcome = "aborted"
        self._logged = False

    @classmethod
    async def open(
        cls,
        ctx: ServingContext,
        req: ChatCompletionRequest,
        request_id: str,
        *,
        kind: str,
        param_names: Mapping[str, str],
    ) -> ChatRun:
        """Validate `req` as the chat route does, submit it and wait for the first
        output (so input errors are answered with a status code). `kind` names the
        route in the request log. Raises APIError (400/404/429/500/503)."""
        params = chat_request_params(ctx, req, param_names)
        messages = chat_messages(req)
        # The chat route's options, sent only when not the default (the engine's
        # Tokenizer renders {"messages": ..., options}: input_processor.CHAT_OPTIONS).
        options: dict[str, Any] = {}
        if req.cache_salt is not None:
            options["cache_salt"] = req.cache_salt
        if not req.add_generation_prompt:
            options["add_generation_prompt"] = False
        if req.continue_final_message:
            options["continue_final_message"] = True
        prompt: Any = {"messages": messages, **options} if options else messages
        stream = await EngineStream.open(
            ctx.engine,
            prompt,
            params,
            request_id,
            priority=req.priority,
            admission=ctx.admission,
            metrics=ctx.metrics,
        )
        return cls(stream, params, kind)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def num_prompt_tokens(self) -> int:
        return self.stream.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.stream.num_generated_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.stream.num_cached_tokens

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield each new output until the request finishes (then `finish_reason` is
        set): a delta has text, or, when log-probabilities were asked for, new tokens.
        Raises APIError for an engine failure mid-stream."""
        with_logprobs = self.params.logprobs is not None
        try:
            async for out in self.stream:
                for c in out.outputs:  # n = 1: only index 0
                    self.token_ids.extend(c.token_ids)
                    if c.logprobs:
                        self.logprobs.extend(c.logprobs)
                    if c.text or (with_logprobs and c.token_ids):
                        self._parts.append(c.text)
                        logprobs = list(c.logprobs or []) if with_logprobs else None
                        yield Delta(c.text, list(c.token_ids), logprobs)
                    if c.finish_reason is not None:
                        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        except Exception:
            self._outcome = "error"
            raise
        self._outcome = "ok"

    async def collect(self) -> str:
        """Read the stream to its end and return the whole text (see `deltas`)."""
        async for _ in self.deltas():
            pass
        return self.text

    async def aclose(self) -> None:
        """Release the stream (aborting an unfinished request) and log the request
        once: ids, counts, timings, never text. Idempotent."""
        await self.stream.aclose()
        if self._logged:
            return
        self._logged = True
        log_request(
            self.kind,
            self.request_id,
            self.num_prompt_tokens,
            self.num_output_tokens,
            [self.finish_reason],
            self.stream.ttft_s,
            self.stream.elapsed_s,
            self._outcome,
        )
