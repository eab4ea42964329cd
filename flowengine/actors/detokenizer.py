"""Detokenizer actor: engine outputs → text deltas, stop strings (DESIGN.md §1, §7)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio

from flowengine.actors.base import Channel
from flowengine.actors.streamer import StreamerActor
from flowengine.engine.input_processor import ProcessedPrompt
from flowengine.engine.output_processor import OutputProcessor
from flowengine.engine.request_stats import RequestStats
from flowengine.messages import AbortRequest, EngineOutputs, SchedulerStats


class DetokenizerActor:
    """Wraps an `OutputProcessor` (each request gets the outputs of its `output_kind`).

    Args:
        output_processor: per-request detokenizer and stop-string state.
        outputs: inbox of `EngineOutputs` from the scheduler.
        requests: where stop-string matches go, as `AbortRequest`s (frees blocks).
        streamer: where each step's `RequestOutput`s go (`StreamerActor.route`, a call).
        on_new_generation: an API server without the supervisor (`--api-server-count`
            > 1): awaited when outputs of a newer engine generation arrive (its ready
            message comes first), after adopting it, to resubmit this frontend's live
            requests. None: only `expect_generation` changes the generation.

    `register` and `forget` apply at once: the request path (actors/tokenizer.py) and
    aborts run on this actor's event loop, between its batches, and a request is
    registered before its `NewRequest`s are sent, so it is known before its first token.
    """

    def __init__(
        self,
        output_processor: OutputProcessor,
        outputs: Channel,
        requests: Channel,
        streamer: StreamerActor,
        max_model_len: int = 1 << 20,
        on_new_generation: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.processor = output_processor
        self.on_new_generation = on_new_generation
        self.outputs = outputs
        self.requests = requests
        self.streamer = streamer
        self.stats = SchedulerStats()
        self.prompt_tokens_total = 0  # every prompt token, cached or computed
        # vLLM's per-request metrics (prompt tokens computed, timings, histograms).
        self.request_stats = RequestStats(max_model_len)
        self.generation_tokens_total = 0
        self.finished_by_reason: Counter[str] = Counter()
        # Engine generation whose outputs are current; older ones are dropped (their
        # tokens are recomputed by the restarted engine).
        self.busy_s = 0.0  # time spent detokenizing (for `flowengine bench pipeline`)
        self.generation = 0
        self._generation_ready: anyio.Event | None = None
        self.last_output_t = time.monotonic()  # when the engine's last message came

    def expect_generation(self, generation: int) -> anyio.Event:
        """From now on drop outputs of older engine generations; the event is set when
        the first output of `generation` (its ready message) arrives."""
        self.generation = generation
        self._generation_ready = anyio.Event()
        return self._generation_ready

    def register(self, processed: ProcessedPrompt) -> None:
        """Know a request from now on (its outputs, its statistics).

        Raises ValueError for a request id already in use."""
        self.processor.add_request(processed)
        self.prompt_tokens_total += len(processed.prompt_token_ids)
        params = processed.sampling_params
        self.request_stats.add_request(
            [c.request_id for c in processed.children], len(processed.prompt_token_ids),
            params.n, params.max_tokens, processed.children[0].arrival_time,
        )

    def forget(self, request_id: str) -> None:
        """Drop a request whose caller is gone (no-op for an unknown id)."""
        self.request_stats.forget(self.processor.abort(request_id))

    async def run(self) -> None:
        while True:
            msg: EngineOutputs = await self.outputs.recv_async()
            self.last_output_t = time.monotonic()
            if msg.generation != self.generation:
                if self.on_new_generation is None or msg.generation < self.generation:
                    continue  # from an engine that was replaced; its requests are recomputed
                self.generation = msg.generation
                await self.on_new_generation()
            if self._generation_ready is not None:
                self._generation_ready.set()
                self._generation_ready = None
            if msg.stats is not None:
                self.stats = msg.stats
            num_tokens = 0
            for delta in msg.outputs:
                num_tokens += len(delta.new_token_ids)
                if delta.finish_reason is not None:
                    self.finished_by_reason[delta.finish_reason] += 1
            self.generation_tokens_total += num_tokens
            self.request_stats.on_step(msg.outputs)
            start = time.perf_counter()
            outs, to_stop = self.processor.process(msg.outputs)
            self.busy_s += time.perf_counter() - start
            if outs:
                self.streamer.route(outs)
            if to_stop:
                await self.requests.send_async(AbortRequest(to_stop))
