"""A deterministic `EngineClient` for the server tests: bytes as tokens, echo as model.

Tokenizer: UTF-8 bytes are token ids 0..255, 256 is EOS. Chat template: one
"role: content" line per message, then "assistant:".
Model: greedy sample i of a request emits token `prompt[(i + step) % len(prompt)]`
(an echo of the prompt, from the sample's index on); with temperature > 0 it draws
lowercase letters from `random.Random(seed)` (seed + index for n > 1, like the real
engine). One token per sample per step of `step_s` seconds. Log-probabilities: the
sampled token has rank 1 and logprob -0.25; rank r is token (sampled + r - 1) % 256
with logprob -0.25 * r.

Per-request statistics (TTFT, inter-token and end-to-end latencies, ...) come from a
real `RequestStats` fed with one `RequestDelta` per sample per step, as the real
engine's Detokenizer feeds it, and reach /metrics through `get_stats().histograms`.

It records what the server did: `submitted` (request id, prompt, params), `aborted`
(ids whose iterator was closed or cancelled before finishing), `abort_calls`,
`peak_running` (the most requests generating at once).
Used in-process by the fixtures and from a subprocess through the server's
FLOWENGINE_TEST_ENGINE=openai_fake_engine:make_engine hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from flowengine.config import EngineArgs
from flowengine.engine.input_processor import (
    REQUESTED_MAX_TOKENS,
    check_max_tokens_fit,
    check_priority,
)
from flowengine.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
)
from flowengine.engine.request_stats import RequestStats
from flowengine.errors import RequestValidationError
from flowengine.messages import RequestDelta
from flowengine.outputs import CompletionOutput, Logprob, RequestOutput
from flowengine.sampling_params import RequestOutputKind, SamplingParams

EOS = 256
LOGPROB_STEP = -0.25


class ByteTokenizer:
    """The Hugging Face tokenizer methods the server calls, over UTF-8 bytes."""

    eos_token_id = EOS
    name_or_path = "fake-bytes"
    chat_template = "role: content lines, then 'assistant:'"

    def __len__(self) -> int:  # the 256 bytes and EOS
        return EOS + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if any(not 0 <= i <= EOS for i in ids):
            raise ValueError(f"token ids must be in [0, {EOS}]")
        text = bytes(i for i in ids if i < EOS).decode("utf-8", "replace")
        return text if skip_special_tokens else text + "</s>" * ids.count(EOS)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["</s>" if i == EOS else bytes([i]).decode("latin-1") for i in ids]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
    ) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        return text + ("assistant:" if add_generation_prompt else "")


class _Sample:
    def __init__(self, index: int, rng: random.Random | None) -> None:
        self.index = index
        self.rng = rng
        self.token_ids: list[int] = []
        self.visible: list[int] = []  # tokens that make text (stop token ids excluded)
        self.emitted = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


def _without_max_tokens_check(prompt: Any) -> tuple[Any, dict[str, Any] | None]:
    """(the prompt as the route built it, its REQUESTED_MAX_TOKENS check or None):
    `submitted` records prompts without the check, which the routes attach last."""
    if not isinstance(prompt, dict) or REQUESTED_MAX_TOKENS not in prompt:
        return prompt, None
    rest = {k: v for k, v in prompt.items() if k != REQUESTED_MAX_TOKENS}
    check = prompt[REQUESTED_MAX_TOKENS]
    if len(rest) == 1 and next(iter(rest)) in ("prompt", "prompt_token_ids", "messages"):
        return next(iter(rest.values())), check
    return rest, check


class FakeEngine:
    """Implements `flowengine.engine.protocol.EngineClient` (see the module docstring)."""

    def __init__(
        self,
        model_name: str = "fake-model",
        max_model_len: int = 512,
        step_s: float = 0.001,
        max_running: int | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.model_name = model_name
        # The real InputProcessor's priority rule (a non-zero priority needs "priority").
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len
        self.default_sampling_params: dict[str, Any] = {}
        self.step_s = step_s
        self.max_running = max_running
        self.tokenizer = ByteTokenizer()
        self.submitted: list[tuple[str, Any, SamplingParams]] = []
        self.aborted: list[str] = []
        self.abort_calls: list[str] = []
        self.running: set[str] = set()
        self.peak_running = 0
        self.dead = False
        self.shutdown_calls = 0
        self.fail_after_tokens: int | None = None  # raise RuntimeError mid-stream
        self.submit_error: Exception | None = None  # raised before any output
        self.first_output_error: str | None = None  # first output carries this error
        self.stats = EngineStats()
        self.request_stats = RequestStats(max_model_len)
        self._seq = itertools.count()

    def get_tokenizer(self) -> ByteTokenizer:
        return self.tokenizer

    def submit(
        self,
        prompt: str | list[int] | list[dict[str, Any]],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
    ) -> AsyncIterator[RequestOutput]:
        prompt, check = _without_max_tokens_check(prompt)
        if check is not None:  # the real InputProcessor's rule (a RequestFieldError)
            num_prompt_tokens = len(self._prompt_ids(prompt)[1])
            if 0 < num_prompt_tokens < self.max_model_len:  # (else _generate refuses it)
                check_max_tokens_fit(num_prompt_tokens, self.max_model_len, check)
        deltas = self._generate(prompt, sampling_params, request_id or "fake", priority)
        kind = sampling_params.output_kind if output_kind is None else output_kind
        return deltas if kind == RequestOutputKind.DELTA else self._fold(deltas, kind)

    @staticmethod
    async def _fold(deltas: Any, kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
        """CUMULATIVE / FINAL_ONLY outputs from the fake's deltas (RequestOutput.add)."""
        total: RequestOutput | None = None
        async with contextlib.aclosing(deltas):
            async for out in deltas:
                if total is None:
                    total = RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                          [], error=out.error)
                total.add(out, aggregate=True)
                if kind == RequestOutputKind.CUMULATIVE or total.finished:
                    yield RequestOutput(
                        total.request_id, total.prompt, total.prompt_token_ids,
                        [CompletionOutput(c.index, c.text, list(c.token_ids),
                                          c.cumulative_logprob,
                                          None if c.logprobs is None else list(c.logprobs),
                                          c.finish_reason, c.stop_reason)
                         for c in total.outputs],
                        total.finished, total.num_cached_tokens, total.error,
                        total.prompt_logprobs)

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # {"prompt" | "prompt_token_ids" | "messages", "cache_salt"}
            for key in ("prompt", "prompt_token_ids", "messages"):
                if key in prompt:
                    return self._prompt_ids(prompt[key])
            raise RequestValidationError(
                f"a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages': {prompt}"
            )
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(prompt)
            return text, self.tokenizer.encode(text)
        if any(not 0 <= t < EOS for t in prompt):
            raise RequestValidationError(f"token ids must be in [0, {EOS})")
        return None, list(prompt)

    async def _generate(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int
    ) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("the fake engine is dead")
        if self.submit_error is not None:
            raise self.submit_error
        check_priority(priority, self.scheduling_policy)
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise RequestValidationError("the prompt is empty; give at least one character or token")
        if len(ids) >= self.max_model_len:
            raise RequestValidationError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "and at least one token must be generated; shorten the prompt or raise "
                "max_model_len"
            )
        if self.max_running is not None and len(self.running) >= self.max_running:
            raise EngineOverloadedError("the fake engine's queue is full", retry_after_s=2.0)
        self.submitted.append((request_id, prompt, params))
        self.running.add(request_id)
        self.peak_running = max(self.peak_running, len(self.running))
        self.stats.prompt_tokens_total += len(ids)
        limit = self.max_model_len - len(ids)
        max_new = min(params.max_tokens or limit, limit)
        samples = [_Sample(i, self._rng(params, i)) for i in range(params.n)]
        key = f"{request_id}#{next(self._seq)}"  # the engine-side ids of the samples
        children = [f"{key}/{i}" for i in range(params.n)]
        self.request_stats.add_request(children, len(ids), params.n, params.max_tokens,
                                       time.monotonic())
        finished = False
        try:
            if self.first_output_error is not None:
                finished = True
                self.request_stats.on_step([
                    RequestDelta(c, [], finish_reason="error", error=self.first_output_error)
                    for c in children])
                yield RequestOutput(request_id, text, ids, [], True, error=self.first_output_error)
            while not finished:
                await asyncio.sleep(self.step_s)
                outs = [self._step(s, ids, params, max_new) for s in samples if not s.finish_reason]
                self.request_stats.on_step([
                    RequestDelta(children[o.index], o.token_ids, finish_reason=o.finish_reason)
                    for o in outs])
                finished = all(s.finish_reason for s in samples)
                yield RequestOutput(request_id, text, ids, outs, finished=finished)
        finally:
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)
                self.request_stats.forget(children)

    @staticmethod
    def _rng(params: SamplingParams, index: int) -> random.Random | None:
        if params.is_greedy:
            return None
        if params.seed is None:
            return random.Random()
        return random.Random(params.seed + index if params.n > 1 else params.seed)

    def _step(
        self, s: _Sample, prompt: list[int], params: SamplingParams, max_new: int
    ) -> CompletionOutput:
        position = len(s.token_ids)
        if self.fail_after_tokens is not None and position >= self.fail_after_tokens:
            raise RuntimeError("fake engine failure")
        if s.rng is None:
            tok = prompt[(s.index + position) % len(prompt)]
        else:
            tok = s.rng.choice(b"abcdefghijklmnopqrstuvwxyz")
        s.token_ids.append(tok)
        self.stats.generation_tokens_total += 1
        stop_ids = params.stop_token_ids or []
        if tok in stop_ids and len(s.token_ids) > params.min_tokens:
            s.finish_reason, s.stop_reason = "stop", tok
        else:
            s.visible.append(tok)
        full = self.tokenizer.decode(s.visible)
        for stop in params.stop_strings if s.finish_reason is None else []:
            at = full.find(stop)
            if at != -1:
                full = full[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                s.finish_reason, s.stop_reason = "stop", stop
                break
        if s.finish_reason is None and len(s.token_ids) >= max_new:
            s.finish_reason = "length"
        visible = full
        if s.finish_reason is None:
            # Hold back what could start a stop string, and a partial UTF-8 character.
            hold = max((len(x) for x in params.stop_strings), default=1) - 1
            hold = max(hold, 1) if full.endswith("\ufffd") else hold
            visible = full[: max(0, len(full) - hold)]
        delta, s.emitted = visible[len(s.emitted) :], visible
        if s.finish_reason is not None:
            reasons = self.stats.finished_by_reason
            reasons[s.finish_reason] = reasons.get(s.finish_reason, 0) + 1
        return CompletionOutput(
            index=s.index,
            text=delta,
            token_ids=[tok],
            logprobs=None if params.logprobs is None else [self._logprobs(tok, params.logprobs)],
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    def _logprobs(self, tok: int, num_top: int) -> dict[int, Logprob]:
        entry = {}
        for r in range(1, max(num_top, 1) + 1):
            t = (tok + r - 1) % EOS
            entry[t] = Logprob(LOGPROB_STEP * r, r, self.tokenizer.decode([t]))
        return entry

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("the fake engine is dead")

    def get_stats(self) -> EngineStats:
        self.stats.num_running = len(self.running)
        self.stats.histograms = self.request_stats.snapshot()
        return self.stats

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self.shutdown_calls += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self.running and loop.time() < deadline:
            await asyncio.sleep(0.01)


def make_engine(args: EngineArgs) -> FakeEngine:
    """Factory for the server's FLOWENGINE_TEST_ENGINE hook (subprocess tests)."""
    return FakeEngine(
        model_name=args.served_model_name[0] if args.served_model_name else "fake-model",
        max_model_len=args.max_model_len or 512,
        step_s=float(os.environ.get("FAKE_ENGINE_STEP_S", "0.001")),
    )


def make_broken_engine(args: EngineArgs) -> FakeEngine:
    """Factory that fails like a model that cannot be loaded (exit code test)."""
    raise ValueError("cannot load model 'missing': no such file; give a model path")
