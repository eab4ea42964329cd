"""Ingress: admission limits and request ids, then the Tokenizer call (DESIGN.md §1).

`admit` runs in the caller's task: it opens the caller's stream, tokenizes, registers
and sends the request (actors/tokenizer.py) and returns; no other task is involved
until the engine's first output.
"""

from __future__ import annotations

import uuid
from typing import Any

from flowengine.actors.streamer import RequestStream, StreamerActor
from flowengine.actors.tokenizer import TokenizeJob, TokenizerActor
from flowengine.engine.protocol import EngineOverloadedError
from flowengine.sampling_params import RequestOutputKind, SamplingParams


class IngressActor:
    """Admits a request: checks the queue limit, opens its stream, tokenizes and sends it.

    Args:
        max_queue_len: most requests in flight (running + waiting) before new ones
            are refused with `EngineOverloadedError` (HTTP 429/503 with Retry-After).
        request_logger: logs each admitted request (`--enable-log-requests`), or None.
    """

    def __init__(
        self, tokenizer: TokenizerActor, streamer: StreamerActor, max_queue_len: int,
        request_logger: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.streamer = streamer
        self.max_queue_len = max_queue_len
        self.request_logger = request_logger
        self.accepting = True

    async def admit(
        self, prompt: Any, params: SamplingParams | None, request_id: str | None, priority: int,
        pooling_params: Any = None,
    ) -> tuple[str, RequestStream, list[str]]:
        """Validate and enqueue; returns (request id, stream, engine-side child ids).
        pooling_params: an embedding request (flowengine.pooling.PoolingParams).

        Raises ValueError/TypeError for bad input, EngineOverloadedError when full or
        draining."""
        if not self.accepting:
            raise EngineOverloadedError("the engine is shutting down", retry_after_s=5.0)
        if len(self.streamer) >= self.max_queue_len:
            raise EngineOverloadedError(
                f"{len(self.streamer)} requests in flight (max_queue_len "
                f"{self.max_queue_len}); retry later",
                retry_after_s=1.0,
            )
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError("request_id must be a string")
        rid = request_id or uuid.uuid4().hex
        # Pending DELTA outputs are concatenated, CUMULATIVE ones replaced (the kind is
        # known here: AsyncEngine.submit resolves it before admission).
        stream = self.streamer.open(rid, isinstance(params, SamplingParams)
                                    and params.output_kind == RequestOutputKind.DELTA)
        try:
            processed = await self.tokenizer.submit(
                TokenizeJob(rid, prompt, params, priority, pooling_params))
        except BaseException:
            self.streamer.close(rid)
            raise
        if self.request_logger is not None:
            self.request_logger.log_inputs(rid, processed)
        return rid, stream, [c.request_id for c in processed.children]
