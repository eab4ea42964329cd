"""Tokenizer: chat template, encode, length checks, fan-out of `n` (DESIGN.md §1).

A call in the caller's own task (`IngressActor.admit` → `TokenizerActor.submit`), not
an actor with an inbox: a request is tokenized, registered once with the Detokenizer's
output processor and sent to the engine before `admit` returns, with no future to
answer and no task switch in between (vLLM's `AsyncLLM.add_request` does the same);
only a prompt longer than THREAD_PROMPT_CHARS is encoded in a worker thread, which the
caller's task awaits.
Registration happens before the `NewRequest`s are sent, and both run on the event
loop that also runs the Detokenizer, so a request is always known before its first
output arrives.

NOTE: whatever goes wrong with one request (a validation error, MemoryError from an
absurd `n`, a message the ring cannot encode such as an int above 2**64-1) fails that
request only, with the error raised to its caller, and leaves nothing behind (what
was registered is forgotten, children already sent are aborted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import msgspec

from flowengine.actors.base import Channel
from flowengine.actors.detokenizer import DetokenizerActor
from flowengine.engine.input_processor import (
    REQUESTED_MAX_TOKENS,
    InputProcessor,
    ProcessedPrompt,
)
from flowengine.engine.protocol import EngineDeadError
from flowengine.errors import RequestValidationError
from flowengine.messages import AbortRequest
from flowengine.sampling_params import SamplingParams
from flowengine.shm.errors import ChannelClosedError

logger = logging.getLogger(__name__)


@dataclass
class TokenizeJob:
    request_id: str
    # text, token ids, {"prompt"|"prompt_token_ids": ..., "cache_salt": ...}, a
    # conversation, or {"messages": conversation, "cache_salt": ..., <CHAT_OPTIONS>}
    prompt: Any
    params: SamplingParams | None  # None: the model's defaults
    priority: int
    pooling_params: Any = None  # an embedding request (PoolingParams)


# Prompts longer than this many characters are tokenized in a worker thread: at ~2
# MB/s (SmolLM2's tokenizer on this project's CI machine) a text this long blocks the
# event loop, and every other request of the process, for a few milliseconds inline,
# where a 10 MB prompt would block it for seconds. Shorter ones stay inline: the
# thread hop (~0.1 ms) would cost more than their encoding.
THREAD_PROMPT_CHARS = 8192


def is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_chars(prompt: Any) -> int:
    """Characters of text in a TokenizeJob's prompt (a text, {"prompt": text}, a
    conversation or {"messages": ...}); 0 for token ids and unknown shapes."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict):
        if "messages" in prompt:
            prompt = prompt["messages"]
        else:
            text = prompt.get("prompt")
            return len(text) if isinstance(text, str) else 0
    if not is_conversation(prompt):
        return 0
    total = 0
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    total += len(text)
    return total


class TokenizerActor:
    """The frontend's tokenizer stage, called in each request's path.

    Args:
        input_processor: tokenizes and validates (engine/input_processor.py).
        detokenizer: where a request is registered before it is sent.
        requests: the engine's requests channel (ring **requests**, or the DP router).
    """

    def __init__(
        self,
        input_processor: InputProcessor,
        detokenizer: DetokenizerActor | None,
        requests: Channel | None,
    ) -> None:
        self.input_processor = input_processor
        self.detokenizer = detokenizer
        self.requests = requests
        self.busy_s = 0.0  # time tokenizing and validating
        # One worker thread for long prompts (vLLM's tokenizer executor has one too).
        self._thread_limiter = anyio.CapacityLimiter(1)

    async def submit(self, job: TokenizeJob) -> ProcessedPrompt:
        """Tokenize and validate `job`, register it with the Detokenizer and send its
        `NewRequest`s to the engine. Returns the `ProcessedPrompt`.

        Raises RequestValidationError for bad input (nothing registered or sent; a plain
        ValueError of the input processor becomes one), any other exception of the input
        processor (logged by type only, no prompt text),
        EngineDeadError when the engine's channel is closed. Cancelled while sending:
        what was registered is forgotten and the children already sent are aborted.
        """
        start = time.perf_counter()
        try:
            if prompt_chars(job.prompt) > THREAD_PROMPT_CHARS:
                # A long text: tokenized in the worker thread (the fast tokenizers
                # release the GIL while encoding), so the event loop keeps serving.
                processed = await anyio.to_thread.run_sync(
                    self._process, job, limiter=self._thread_limiter)
                # Cancelled while the thread ran (anyio defers it until the thread is
                # done): stop here, before anything is registered or sent.
                await anyio.lowlevel.checkpoint_if_cancelled()
            else:
                processed = self._process(job)
        except RequestValidationError:
            raise
        except ValueError as exc:
            # NOTE: this stage validates the request: a plain ValueError here comes from
            # a check of its input (pooling dimensions, a field's range, ...) that does
            # not raise the dedicated type; the client gets it as its fault (400), as
            # before RequestValidationError existed.
            raise RequestValidationError(str(exc), getattr(exc, "param", None)) from exc
        except Exception as exc:
            # Not a validation error: worth a log line (type only, no prompt text).
            logger.warning("request %s failed in the tokenizer: %s",
                           job.request_id, type(exc).__name__)
            raise
        finally:
            self.busy_s += time.perf_counter() - start
        assert self.detokenizer is not None and self.requests is not None
        self.detokenizer.register(processed)
        await self._send(processed)
        return processed

    async def _send(self, processed: ProcessedPrompt) -> None:
        """Send the request's children to the engine; on failure undo what was sent and
        raise the error for the caller."""
        num_sent = 0
        try:
            for child in processed.children:
                await self.requests.send_async(child)
                num_sent += 1
            return
        except BaseException as exc:
            error = exc
        # Encoding fails before anything of that child is written (Channel encodes
        # first), so the ring holds whole messages only: abort the children already
        # sent and forget the request, so it leaves no trace in either process.
        self.detokenizer.forget(processed.request_id)
        closed = isinstance(error, ChannelClosedError)
        if num_sent and not closed:
            sent = [c.request_id for c in processed.children[:num_sent]]
            with anyio.CancelScope(shield=True):
                try:
                    await self.requests.send_async(AbortRequest(sent))
                except ChannelClosedError:
                    closed = True
        if not isinstance(error, Exception):
            raise error  # cancelled: the caller is gone
        if closed:
            raise EngineDeadError("the engine's request channel is closed") from error
        logger.warning("request %s could not be sent to the engine: %s",
                       processed.request_id, type(error).__name__)
        if isinstance(error, (OverflowError, msgspec.EncodeError)):
            raise RequestValidationError(
                f"the request cannot be encoded for the engine: {error}") from error
        raise error

    def _process(self, job: TokenizeJob) -> ProcessedPrompt:
        ip = self.input_processor
        prompt = job.prompt
        # No SamplingParams given: the model's defaults (generation_config.json).
        params = ip.default_params() if job.params is None else job.params
        if job.pooling_params is not None or ip.pooler_config is not None:
            # An embedding request, or a generation request the pooling model refuses.
            if job.pooling_params is not None and (
                    is_conversation(prompt) or (isinstance(prompt, dict) and "messages" in prompt)):
                raise RequestValidationError(
                    "embedding inputs are texts or token ids, not messages")
            return ip.process(job.request_id, prompt, params, priority=job.priority,
                              pooling_params=job.pooling_params)
        if is_conversation(prompt):
            prompt = {"messages": prompt}
        if isinstance(prompt, dict) and "messages" in prompt:
            # {"messages": [...], "cache_salt": ..., "chat_template_kwargs": ..., ...}
            text, ids = ip.chat_request(prompt)
            return ip.process(job.request_id, text, params, priority=job.priority,
                              prompt_token_ids=ids, cache_salt=prompt.get("cache_salt"),
                              requested_max_tokens=prompt.get(REQUESTED_MAX_TOKENS))
        return ip.process(job.request_id, prompt, params, priority=job.priority)
