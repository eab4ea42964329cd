"""Other APIs' generation requests, run exactly as the chat route runs them.

The OpenAI Responses route and the Anthropic Messages route translate their request
into the chat route's own `ChatCompletionRequest`, so sampling defaults (the model's
generation_config included), validation, the server's per-request limits and the
messages given to the chat template are the chat route's (`chat_params`,
`check_limits`, `chat_messages`), and a greedy request gives the chat route's text.
Tools, tool choice and reasoning are the chat route's too (chat_tools.py): the
translated request carries chat `tools` / `tool_choice` / `parallel_tool_calls`, the
server's `--tool-call-parser` / `--reasoning-parser` parse the output.
`ChatRun` then opens the same `EngineStream` (admission, metrics, abort when closed
unfinished) and reads its outputs as parsed deltas of one completion (`n` = 1):
reasoning text, content text and tool-call pieces, with the token ids and
log-probabilities when asked for. Nothing here knows an API's wire format.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowengine.entrypoints.openai.chat_parsing import ChoiceDelta, ChoiceParser, join_choice
from flowengine.entrypoints.openai.chat_tools import ChatOutputSetup, setup_chat_output
from flowengine.entrypoints.openai.context import ServingContext, log_request
from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.generation import EngineStream
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest
from flowengine.entrypoints.openai.sampling import (
    chat_max_tokens_check,
    chat_messages,
    chat_params,
    check_limits,
    with_max_tokens_check,
)
from flowengine.entrypoints.openai.tool_parsers import ToolCallDelta
from flowengine.outputs import SampleLogprobs
from flowengine.sampling_params import SamplingParams

# Renames a chat field name (as an APIError's `param`) to the calling API's.
ParamNames = Mapping[str, str] | Callable[[str], str]


@dataclass(frozen=True)
class Delta:
    """New output of a run: content text (may be empty when only tokens with
    log-probabilities arrived, the text held back for a stop string or a marker),
    reasoning text (with --reasoning-parser), tool-call pieces (each call's first
    piece has its id and name, later ones argument fragments), the new token ids, and
    their log-probabilities (one dict per token) if the run asked for them, else None."""

    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def renamed(param: str, param_names: ParamNames) -> str:
    """The calling API's name of the chat field `param`."""
    return param_names(param) if callable(param_names) else param_names.get(param, param)


def rename_param(err: APIError, param_names: ParamNames) -> APIError:
    """`err` with its `param` renamed to the calling API's field name."""
    if err.param is not None:
        err.param = renamed(err.param, param_names)
    return err


def chat_request_params(
    ctx: ServingContext, req: ChatCompletionRequest, param_names: ParamNames
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
        raise rename_param(err, param_names) from None
    return params


def chat_output_setup(
    ctx: ServingContext, req: ChatCompletionRequest, param_names: ParamNames
) -> ChatOutputSetup:
    """The chat route's tool and reasoning set-up of `req` (params checked as
    `chat_request_params`). Raises APIError(400) naming the calling API's field."""
    params = chat_request_params(ctx, req, param_names)
    try:
        return setup_chat_output(
            ctx.chat_parsing, params, req.tools, req.tool_choice, req.parallel_tool_calls
        )
    except APIError as err:
        raise rename_param(err, param_names) from None


class ChatRun:
    """One chat-style generation of a front door: its engine stream and folded output.

    Attributes:
        request_id: the engine request id (the API's own response id).
        params: the SamplingParams it runs with.
        setup: its tool choice and output parsing (chat_tools.py).
        text: the content generated so far (all deltas joined; the whole text when
            no parser runs).
        reasoning: the reasoning text so far ("" without --reasoning-parser).
        tool_calls: the calls parsed so far, OpenAI's chat form ({"id", "type",
            "function": {"name", "arguments"}}).
        num_reasoning_tokens: tokens generated before the end of the think block
            (the tag included), 0 when the output did not reason.
        token_ids, logprobs: every generated token id and, if asked for, its
            log-probabilities (one dict per token).
        finish_reason: "stop", "length" or "abort" once finished, else None (the
            engine's: a run that called tools and stopped says "stop").
        stop_reason: the stop string or stop token id that ended it (None for EOS or
            length), as `CompletionOutput.stop_reason`.
    """

    def __init__(
        self, stream: EngineStream, setup: ChatOutputSetup, kind: str
    ) -> None:
        self.stream = stream
        self.request_id = stream.request_id
        self.setup = setup
        self.params = setup.params
        self.kind = kind
        self._deltas: list[ChoiceDelta] = []
        self._parser: ChoiceParser | None = None
        self._raw: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs = []
        self.num_reasoning_tokens = 0
        self._pending_reasoning_tokens = 0
        self._saw_reasoning = False
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
        param_names: ParamNames,
        check_max_tokens: bool = True,
    ) -> ChatRun:
        """Validate `req` as the chat route does (sampling, limits, tools), submit it
        and wait for the first output (so input errors are answered with a status
        code). `kind` names the route in the request log. check_max_tokens: a cap
        the client sent must fit the context with the prompt (400 otherwise, as
        vLLM's chat route); False caps it at the context left. Raises APIError
        (400/404/429/500/503)."""
        setup = chat_output_setup(ctx, req, param_names)
        try:
            messages = chat_messages(req)
        except APIError as err:
            raise rename_param(err, param_names) from None
        # The chat route's options, sent only when not the default (the engine's
        # Tokenizer renders {"messages": ..., options}: input_processor.CHAT_OPTIONS).
        options: dict[str, Any] = {}
        if setup.template_tools is not None:
            options["tools"] = setup.template_tools
        if req.cache_salt is not None:
            options["cache_salt"] = req.cache_salt
        if req.chat_template_kwargs:
            options["chat_template_kwargs"] = req.chat_template_kwargs
        if not req.add_generation_prompt:
            options["add_generation_prompt"] = False
        if req.continue_final_message:
            options["continue_final_message"] = True
        prompt: Any = {"messages": messages, **options} if options else messages
        # A cap the client sent must fit the context with the prompt (400 naming the
        # calling API's field, as vLLM).
        check = chat_max_tokens_check(req) if check_max_tokens else None
        if check is not None:
            check["param"] = renamed(check["param"], param_names)
        prompt = with_max_tokens_check(prompt, check)
        stream = await EngineStream.open(
            ctx.engine,
            prompt,
            setup.params,
            request_id,
            priority=req.priority,
            admission=ctx.admission,
        )
        return cls(stream, setup, kind)

    @property
    def is_parsed(self) -> bool:
        """The output goes through a tool or reasoning parser (else it is plain text)."""
        return self.setup.make_parser is not None

    @property
    def text(self) -> str:
        if not self.is_parsed:
            return "".join(self._raw)
        return "".join(d.content for d in self._deltas)

    @property
    def reasoning(self) -> str:
        return "".join(d.reasoning for d in self._deltas)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return join_choice(self._deltas).get("tool_calls", [])

    @property
    def num_prompt_tokens(self) -> int:
        return self.stream.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.stream.num_generated_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.stream.num_cached_tokens

    def _parse(self, prompt: str | None, text: str, num_tokens: int, final: bool) -> ChoiceDelta:
        if self._parser is None:
            assert self.setup.make_parser is not None
            self._parser = self.setup.make_parser(prompt)
        parser = self._parser
        thinking = parser.reasoning is not None and not parser.reasoning.is_reasoning_end
        parsed = parser.feed(text) if text else ChoiceDelta()
        if final:
            parsed.extend(parser.finish())
        if thinking:
            # Tokens before `</think>` are reasoning tokens once reasoning text showed.
            self._pending_reasoning_tokens += num_tokens
            self._saw_reasoning = self._saw_reasoning or bool(parsed.reasoning)
            if self._saw_reasoning:
                self.num_reasoning_tokens += self._pending_reasoning_tokens
                self._pending_reasoning_tokens = 0
        self._deltas.append(parsed)
        return parsed

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield each new output until the request finishes (then `finish_reason` is
        set): a delta has text, reasoning or tool-call pieces, or, when
        log-probabilities were asked for, new tokens. Raises APIError for an engine
        failure mid-stream."""
        with_logprobs = self.params.logprobs is not None
        try:
            async for out in self.stream:
                for c in out.outputs:  # n = 1: only index 0
                    self.token_ids.extend(c.token_ids)
                    if c.logprobs:
                        self.logprobs.extend(c.logprobs)
                    logprobs = list(c.logprobs or []) if with_logprobs else None
                    has_tokens = with_logprobs and bool(c.token_ids)
                    final = c.finish_reason is not None
                    if final:
                        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
                    if not self.is_parsed:
                        if c.text or has_tokens:
                            self._raw.append(c.text)
                            yield Delta(c.text, list(c.token_ids), logprobs)
                        continue
                    parsed = self._parse(out.prompt, c.text, len(c.token_ids), final)
                    if parsed.content or parsed.reasoning or parsed.tool_calls or has_tokens:
                        yield Delta(
                            parsed.content, list(c.token_ids), logprobs,
                            parsed.reasoning, list(parsed.tool_calls),
                        )  # fmt: skip
            if self.is_parsed and self._parser is not None and self.finish_reason is None:
                # Ended without a finish reason: what the parsers held back is output.
                rest = self._parser.finish()
                self._deltas.append(rest)
                if rest.content or rest.reasoning or rest.tool_calls:
                    yield Delta(rest.content, [], None, rest.reasoning, list(rest.tool_calls))
        except Exception:
            self._outcome = "error"
            raise
        self._outcome = "ok"

    async def collect(self) -> str:
        """Read the stream to its end and return the whole content (see `deltas`)."""
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
