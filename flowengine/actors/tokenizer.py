"""Tokenizer actor: chat template, encode, length checks, fan-out of `n` (DESIGN.md §1).

Requests come in with a future; the actor answers it with the `ProcessedPrompt` or
the validation error, registers the request with the Detokenizer, and only then
sends the `NewRequest`s to the engine.

NOTE: whatever goes wrong with one request (a validation error, MemoryError from an
absurd `n`, a message the ring cannot encode such as an int above 2**64-1) fails that
request only, with the error raised to its caller; the actor keeps serving. Only the
engine's channel being closed (the engine is gone) ends the actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from flowengine.actors.base import Channel
from flowengine.actors.detokenizer import DetokenizerActor
from flowengine.engine.input_processor import InputProcessor
from flowengine.messages import AbortRequest
from flowengine.sampling_params import SamplingParams
from flowengine.shm.errors import ChannelClosedError
from flowengine.shm.inproc import InprocChannel

logger = logging.getLogger(__name__)


@dataclass
class TokenizeJob:
    request_id: str
    # text, token ids, {"prompt"|"prompt_token_ids": ..., "cache_salt": ...}, a
    # conversation, or {"messages": conversation, "cache_salt": ..., <CHAT_OPTIONS>}
    prompt: Any
    params: SamplingParams | None  # None: the model's defaults
    priority: int
    future: asyncio.Future
    pooling_params: Any = None  # an embedding request (PoolingParams)


def is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


class TokenizerActor:
    def __init__(
        self,
        input_processor: InputProcessor,
        detokenizer: DetokenizerActor,
        requests: Channel,
    ) -> None:
        self.input_processor = input_processor
        self.detokenizer = detokenizer
        self.requests = requests
        self.inbox = InprocChannel()
        self.busy_s = 0.0  # time tokenizing and validating

    async def run(self) -> None:
        while True:
            job: TokenizeJob = await self.inbox.recv_async()
            if job.future.cancelled():
                continue
            start = time.perf_counter()
            try:
                processed = self._process(job)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                if not isinstance(exc, (ValueError, TypeError)):
                    # Not a validation error: worth a log line (type only, no prompt text).
                    logger.warning("request %s failed in the tokenizer: %s",
                                   job.request_id, type(exc).__name__)
                _fail(job, exc)
                continue
            finally:
                self.busy_s += time.perf_counter() - start
            self.detokenizer.register(processed)
            error = await self._send(processed)
            if error is not None:
                _fail(job, error)
                continue
            if not job.future.done():  # the caller may have gone meanwhile
                job.future.set_result(processed)

    async def _send(self, processed: Any) -> Exception | None:
        """Send the request's children to the engine; on failure undo what was sent and
        return the error for the caller (None on success).

        Raises ChannelClosedError (the engine's channel is closed: nothing can be sent).
        """
        num_sent = 0
        try:
            for child in processed.children:
                await self.requests.send_async(child)
                num_sent += 1
            return None
        except ChannelClosedError:
            raise
        except Exception as exc:  # noqa: BLE001
            error = exc
        # Encoding failed before anything of that child was written (Channel encodes
        # first), so the ring holds whole messages only: abort the children already
        # sent and forget the request, so it leaves no trace in either process.
        self.detokenizer.forget(processed.request_id)
        if num_sent:
            sent = [c.request_id for c in processed.children[:num_sent]]
            await self.requests.send_async(AbortRequest(sent))
        logger.warning("request %s could not be sent to the engine: %s",
                       processed.request_id, type(error).__name__)
        if isinstance(error, (OverflowError, msgspec.EncodeError)):
            return ValueError(f"the request cannot be encoded for the engine: {error}")
        return error

    def _process(self, job: TokenizeJob):
        ip = self.input_processor
        prompt = job.prompt
        # No SamplingParams given: the model's defaults (generation_config.json).
        params = ip.default_params() if job.params is None else job.params
        if job.pooling_params is not None or ip.pooler_config is not None:
            # An embedding request, or a generation request the pooling model refuses.
            if job.pooling_params is not None and (
                    is_conversation(prompt) or (isinstance(prompt, dict) and "messages" in prompt)):
                raise ValueError("embedding inputs are texts or token ids, not messages")
            return ip.process(job.request_id, prompt, params, priority=job.priority,
                              pooling_params=job.pooling_params)
        if is_conversation(prompt):
            prompt = {"messages": prompt}
        if isinstance(prompt, dict) and "messages" in prompt:
            # {"messages": [...], "cache_salt": ..., "chat_template_kwargs": ..., ...}
            text, ids = ip.chat_request(prompt)
            return ip.process(job.request_id, text, params, priority=job.priority,
                              prompt_token_ids=ids, cache_salt=prompt.get("cache_salt"))
        return ip.process(job.request_id, prompt, params, priority=job.priority)


def _fail(job: TokenizeJob, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
