"""Scheduler actor: requests in, step plans out, results in, outputs out (DESIGN.md §1, §5).

Wraps the pure `Scheduler`. With `max_steps_in_flight=2` it turns on the scheduler's
async scheduling and plans step N+1 while step N executes, decodes included: the
executor keeps step N's sampled tokens on its side, so step N+1 needs no round trip
through this actor (the executor contract is in `StepPlan`'s docstring).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import anyio

from flowengine.actors.base import Channel
from flowengine.core.scheduler import Scheduler
from flowengine.engine.engine_core import abort_requests, request_from_msg
from flowengine.messages import (
    AbortRequest,
    EngineOutputs,
    NewRequest,
    RequestDelta,
    SchedulerStats,
    Shutdown,
    StepPlan,
    StepResult,
)

logger = logging.getLogger(__name__)


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    """Snapshot of the scheduler's gauges and counters."""
    return SchedulerStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_cache_usage=scheduler.kv_cache_usage,
        num_free_blocks=scheduler.num_free_blocks,
        num_total_blocks=scheduler.num_total_blocks,
        num_preemptions_total=scheduler.num_preemptions,
        prefix_cache_queries_total=scheduler.prefix_cache_queries,
        prefix_cache_hits_total=scheduler.prefix_cache_hits,
    )


class SchedulerActor:
    """Drives the engine loop over channels.

    Args:
        scheduler: the pure scheduler (owns `Request`s and the KV cache manager).
        max_model_len: caps each request's max_tokens.
        requests: inbox of `NewRequest | AbortRequest | Shutdown`.
        steps: outbox of `StepPlan | Shutdown` (broadcast to every executor rank).
        results: inbox of `StepResult` from executor rank 0.
        outputs: outbox of `EngineOutputs`.
        max_steps_in_flight: 1 = plan after each result; 2 = overlap, with
            `scheduler.async_scheduling` turned on (DESIGN.md §5).

    Raises ValueError when max_steps_in_flight < 1.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        max_model_len: int,
        requests: Channel,
        steps: Channel,
        results: Channel,
        outputs: Channel,
        *,
        max_steps_in_flight: int = 1,
        generation: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.requests = requests
        self.steps = steps
        self.results = results
        self.outputs = outputs
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight
        # Planning on placeholders is what lets decodes overlap; with one step in flight
        # the two modes make the same plans.
        scheduler.async_scheduling = max_steps_in_flight > 1
        self.generation = generation
        self.busy_s = 0.0  # time in schedule() and update_from_output()
        self._in_flight: deque[StepPlan] = deque()
        self._pending: list[RequestDelta] = []
        self._stopping = False
        self._last_stats: SchedulerStats | None = None
        self.stopped = anyio.Event()

    async def run(self) -> None:
        try:
            await self._loop()
        finally:
            self.stopped.set()

    async def _loop(self) -> None:
        while True:
            self._drain_requests()
            if self._pending:
                await self._emit([])
            idle = not self.scheduler.has_unfinished_requests() and not self._in_flight
            if idle and self._stopping:
                break
            if idle:
                await self._emit_stats_if_changed()  # e.g. blocks freed after the last step
                self._handle(await self.requests.recv_async())
                continue
            while len(self._in_flight) < self.max_steps_in_flight:
                start = time.perf_counter()
                plan = self.scheduler.schedule()
                self.busy_s += time.perf_counter() - start
                if not plan.num_scheduled_tokens:
                    # Nothing to run; its finished ids are repeated in the next plan.
                    break
                await self.steps.send_async(plan)
                self._in_flight.append(plan)
            if not self._in_flight:
                # Unfinished requests but nothing schedulable: wait for news.
                self._handle(await self.requests.recv_async())
                continue
            result = await self.results.recv_async()
            await self._apply(result)
        await self.steps.send_async(Shutdown())

    async def _apply(self, result: StepResult) -> None:
        plan = self._in_flight.popleft()
        if result.step_id != plan.step_id:
            raise RuntimeError(f"result of step {result.step_id} arrived for step {plan.step_id}")
        if plan.num_scheduled_tokens:
            start = time.perf_counter()
            deltas = self.scheduler.update_from_output(plan, result)
            self.busy_s += time.perf_counter() - start
            await self._emit(deltas)

    async def _emit(self, deltas: list[RequestDelta]) -> None:
        deltas = self._pending + deltas
        self._pending = []
        if deltas:
            self._last_stats = scheduler_stats(self.scheduler)
            await self.outputs.send_async(
                EngineOutputs(deltas, time.time(), self._last_stats, self.generation)
            )

    async def _emit_stats_if_changed(self) -> None:
        stats = scheduler_stats(self.scheduler)
        if stats != self._last_stats:
            self._last_stats = stats
            await self.outputs.send_async(EngineOutputs([], time.time(), stats, self.generation))

    def _drain_requests(self) -> None:
        while (msg := self.requests.try_recv()) is not None:
            self._handle(msg)

    def _handle(self, msg: NewRequest | AbortRequest | Shutdown) -> None:
        if isinstance(msg, NewRequest):
            known = self.scheduler.get_request(msg.request_id)
            if known is not None and not known.is_finished:
                return  # resubmitted after a restart and also sent directly: keep one
            try:
                self.scheduler.add_request(request_from_msg(msg, self.max_model_len))
            except ValueError as exc:
                # The frontend validates first; this is the last line, never silence.
                self._pending.append(RequestDelta(msg.request_id, [], finish_reason="error",
                                                  error=str(exc)))
        elif isinstance(msg, AbortRequest):
            self._pending.extend(abort_requests(self.scheduler, msg.request_ids))
        elif isinstance(msg, Shutdown):
            self._stopping = True
