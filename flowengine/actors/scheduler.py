"""Scheduler actor: requests in, step plans out, results in, outputs out (DESIGN.md §1, §5).

Drives an `EngineCore` (flowengine/engine/engine_core.py), the same object the
in-process `LLM` steps: requests-channel messages go to `core.handle`, plans come from
`core.schedule()` and results are applied by `core.update()`. With
`max_steps_in_flight=2` it turns on the scheduler's async scheduling and plans step N+1
while step N executes, decodes included: the executor keeps step N's sampled tokens on
its side, so step N+1 needs no round trip through this actor (the executor contract is
in `StepPlan`'s docstring). A plan with constrained sampling rows goes out without
its grammar bitmask (`Scheduler.defer_grammar_bitmask`); the bitmask (`GrammarOutput`)
follows on the steps channel ahead of the next plan: filled right after the plan was
sent (the executor launches the forward meanwhile), or, when those requests sample on
placeholder tokens, as soon as the result before it was applied.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import anyio

from flowengine.actors.base import Channel
from flowengine.engine import step_trace
from flowengine.engine.engine_core import EngineCore
from flowengine.messages import (
    AbortRequest,
    EngineOutputs,
    NewRequest,
    RequestDelta,
    SchedulerStats,
    Shutdown,
    StepPlan,
    StepResult,
    join_step_result,
)

logger = logging.getLogger(__name__)

# Constrained rows of a result from which the Scheduler actor advances their matchers
# and fills the next bitmask in a worker thread (below it the thread hand-off costs
# more than the work): FLOWENGINE_GRAMMAR_OFFLOAD_ROWS, 0 for never. In process only:
# there the frontend's detokenizer runs on the same loop meanwhile. In an engine
# process of its own nothing else waits for the loop, and the thread only adds its
# hand-offs to the chain the next step's sampling waits for: on the H200 (batch 128,
# JSON schema, docs/benchmarks.md session 32) inline gave 0.917-0.956 of unconstrained
# throughput against 0.796-0.888 with the thread, 3 alternated pairs. So the engine
# process passes default=None (inline) unless the variable is set.
GRAMMAR_OFFLOAD_ROWS = 32


def grammar_offload_rows(default: int | None = GRAMMAR_OFFLOAD_ROWS) -> int | None:
    """FLOWENGINE_GRAMMAR_OFFLOAD_ROWS if set, else `default`; None for never."""
    env = os.environ.get("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS")
    value = (default or 0) if not env else int(env)
    if value < 0:
        raise ValueError(f"FLOWENGINE_GRAMMAR_OFFLOAD_ROWS must be >= 0, got {env!r}")
    return value or None


class SchedulerActor:
    """Drives the engine loop over channels.

    Args:
        core: the engine core (its scheduler owns `Request`s and the KV cache manager;
            its executor, if any, is not used: steps run on the executor actors).
        requests: inbox of `NewRequest | AbortRequest | Shutdown`.
        steps: outbox of `StepPlan | Shutdown` (broadcast to every executor rank).
        results: inbox of `StepResult` from executor rank 0.
        outputs: outbox of `EngineOutputs`.
        max_steps_in_flight: 1 = plan after each result; 2 = overlap, with
            `scheduler.async_scheduling` turned on (DESIGN.md §5); pipeline
            parallelism: its size, with async_scheduling False.
        async_scheduling: plan on placeholder tokens; None: when
            max_steps_in_flight > 1.
        generation: the engine restart count, stamped on every EngineOutputs.
        offload_grammar: whether results with many constrained rows advance their
            matchers in a worker thread (`grammar_offload_rows`); False: inline, unless
            FLOWENGINE_GRAMMAR_OFFLOAD_ROWS says otherwise (the engine process).

    Raises ValueError when max_steps_in_flight < 1.
    """

    def __init__(
        self,
        core: EngineCore,
        requests: Channel,
        steps: Channel,
        results: Channel,
        outputs: Channel,
        *,
        max_steps_in_flight: int = 1,
        async_scheduling: bool | None = None,
        generation: int = 0,
        offload_grammar: bool = True,
    ) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.requests = requests
        self.steps = steps
        self.results = results
        self.outputs = outputs
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight
        # Planning on placeholders is what lets decodes overlap; with one step in flight
        # the two modes make the same plans.
        # Pipeline parallelism keeps several steps in flight without it
        # (async_scheduling=False): each request in one of them at a time.
        self.scheduler.async_scheduling = (max_steps_in_flight > 1 if async_scheduling is None
                                           else async_scheduling)
        # Plans with constrained rows go out without their bitmask, filled while the
        # executor launches the forward (sent right after the plan, see _loop). Not
        # under pipeline parallelism (several steps in flight without async
        # scheduling): its stages take whole plans.
        self.scheduler.defer_grammar_bitmask = not (
            max_steps_in_flight > 1 and not self.scheduler.async_scheduling)
        # A result with many constrained rows: their matchers advance and the next
        # bitmask is filled in a worker thread while this loop sends the step's outputs
        # on (in-process, the detokenizer runs on this loop meanwhile); see _apply.
        self.scheduler.grammar_offload_rows = grammar_offload_rows(
            GRAMMAR_OFFLOAD_ROWS if offload_grammar else None)
        self.generation = generation
        self.busy_s = 0.0  # time in schedule() and update()
        self._in_flight: deque[StepPlan] = deque()
        self._stopping = False
        self._last_stats: SchedulerStats | None = None
        self.stopped = anyio.Event()

    async def run(self) -> None:
        try:
            await self._loop()
        finally:
            self.stopped.set()

    async def _loop(self) -> None:
        core = self.core
        while True:
            self._drain_requests()
            if core.has_pending_outputs:
                await self._emit(core.take_outputs())
            idle = not core.has_unfinished_requests() and not self._in_flight
            if idle and self._stopping:
                break
            if idle:
                await self._emit_stats_if_changed()  # e.g. blocks freed after the last step
                self._handle(await self.requests.recv_async())
                continue
            while len(self._in_flight) < self.max_steps_in_flight:
                start = time.perf_counter()
                plan = core.schedule()
                self.busy_s += time.perf_counter() - start
                if plan is None:
                    break  # nothing to run; its finished ids go with the next plan
                await self.steps.send_async(plan)
                if step_trace.ENABLED:
                    step_trace.mark("sc_plan_sent", plan.step_id)
                self._in_flight.append(plan)
                if plan.pending_structured_output_tokens:
                    # Let the executor launch the forward first (in-process it is a task
                    # of this loop, woken by the send), then fill the bitmask while the
                    # device runs it; the bitmask follows before the next plan.
                    await anyio.sleep(0)
                    start = time.perf_counter()
                    grammar_outputs = core.fill_grammar_bitmasks()
                    self.busy_s += time.perf_counter() - start
                    for grammar_output in grammar_outputs:
                        await self.steps.send_async(grammar_output)
                        if step_trace.ENABLED:
                            step_trace.mark("sc_grammar_sent", grammar_output.step_id)
            if not self._in_flight:
                # Unfinished requests but nothing schedulable: wait for news, or, while
                # grammars compile (in worker threads), look again soon.
                if core.num_compiling_grammars:
                    with anyio.move_on_after(0.005):
                        self._handle(await self.requests.recv_async())
                    continue
                self._handle(await self.requests.recv_async())
                continue
            await self._apply(await self._recv_result())
        await self.steps.send_async(Shutdown())

    async def _recv_result(self) -> StepResult:
        """The next step's result, its parts joined when it came in several."""
        result = await self.results.recv_async()
        if not result.more:
            return result
        rest = []
        while True:
            part = await self.results.recv_async()
            rest.append(part)
            if not part.more:
                return join_step_result(result, rest)

    async def _apply(self, result: StepResult) -> None:
        plan = self._in_flight.popleft()
        if result.step_id != plan.step_id:
            raise RuntimeError(f"result of step {result.step_id} arrived for step {plan.step_id}")
        if step_trace.ENABLED:
            step_trace.mark("sc_result", plan.step_id)
        start = time.perf_counter()
        deltas = self.core.update(plan, result)
        if step_trace.ENABLED:
            step_trace.mark("sc_updated", plan.step_id)
        work = self.core.take_grammar_work()
        if work is not None:
            # The step's outputs go first (processed while the matchers advance in a
            # worker thread; the grammar library releases the GIL), then the bitmask.
            self.busy_s += time.perf_counter() - start
            await self._emit(deltas)
            if step_trace.ENABLED:
                step_trace.mark("sc_outputs_sent", plan.step_id)
            outcome = await anyio.to_thread.run_sync(work)
            if step_trace.ENABLED:
                step_trace.mark("sc_grammar_done", plan.step_id)
            start = time.perf_counter()
            deltas = self.core.finish_grammar_work(outcome)  # refused tokens' failures
        grammar_outputs = self.core.take_grammar_outputs()
        self.busy_s += time.perf_counter() - start
        # First the bitmasks that the executor waits for to sample the next step (its
        # forward already runs), then the outputs; both before the next plan.
        for grammar_output in grammar_outputs:
            await self.steps.send_async(grammar_output)
            if step_trace.ENABLED:
                step_trace.mark("sc_grammar_sent", grammar_output.step_id)
        await self._emit(deltas)

    async def _emit(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            self._last_stats = self.scheduler.make_stats()
            await self.outputs.send_async(
                EngineOutputs(deltas, time.time(), self._last_stats, self.generation)
            )

    async def _emit_stats_if_changed(self) -> None:
        stats = self.scheduler.make_stats()
        if stats != self._last_stats:
            self._last_stats = stats
            await self.outputs.send_async(EngineOutputs([], time.time(), stats, self.generation))

    def _drain_requests(self) -> None:
        while (msg := self.requests.try_recv()) is not None:
            self._handle(msg)

    def _handle(self, msg: NewRequest | AbortRequest | Shutdown) -> None:
        if isinstance(msg, Shutdown):
            self._stopping = True
        else:
            self.core.handle(msg)
