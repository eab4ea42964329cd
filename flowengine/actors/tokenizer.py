"""Tokenizer actor: chat template, encode, length checks, fan-out of `n` (DESIGN.md §1).

Requests come in with a future; the actor answers it with the `ProcessedPrompt` or
the validation error, registers the request with the Detokenizer, and only then
sends the `NewRequest`s to the engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from flowengine.actors.base import Channel
from flowengine.actors.detokenizer import DetokenizerActor
from flowengine.engine.input_processor import InputProcessor
from flowengine.sampling_params import SamplingParams
from flowengine.shm.inproc import InprocChannel


@dataclass
class TokenizeJob:
    request_id: str
    # text, token ids, {"prompt"|"prompt_token_ids": ..., "cache_salt": ...}, a
    # conversation, or {"messages": conversation, "cache_salt": ..., <CHAT_OPTIONS>}
    prompt: Any
    params: SamplingParams | None  # None: the model's defaults
    priority: int
    future: asyncio.Future


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
            except (ValueError, TypeError) as exc:
                job.future.set_exception(exc)
                continue
            finally:
                self.busy_s += time.perf_counter() - start
            self.detokenizer.register(processed)
            for child in processed.children:
                await self.requests.send_async(child)
            job.future.set_result(processed)

    def _process(self, job: TokenizeJob):
        ip = self.input_processor
        prompt = job.prompt
        # No SamplingParams given: the model's defaults (generation_config.json).
        params = ip.default_params() if job.params is None else job.params
        if is_conversation(prompt):
            prompt = {"messages": prompt}
        if isinstance(prompt, dict) and "messages" in prompt:
            # {"messages": [...], "cache_salt": ..., "chat_template_kwargs": ..., ...}
            text, ids = ip.chat_request(prompt)
            return ip.process(job.request_id, text, params, priority=job.priority,
                              prompt_token_ids=ids, cache_salt=prompt.get("cache_salt"))
        return ip.process(job.request_id, prompt, params, priority=job.priority)
