"""Executor actor: step plans in, sampled tokens out (DESIGN.md §1, §5, §6).

One Executor actor per device (tensor-parallel rank). On rank 0 it has two tasks:

- the *launcher* takes each `StepPlan` off the `steps` channel and calls
  `Executor.launch(plan)`: forward, sampling and the sampled ids' copy to the host,
  all enqueued on the device (with a CudaModelRunner at TP = 1 nothing waits for the
  device), and passes the returned handle on. It then takes the next plan at once, so
  step N+1 is launched before step N's tokens have reached the host: the sampled ids
  stay on the device and feed step N+1 there (flowengine/executor/cuda_runner.py);
- the *resolver* takes the handles in launch order, waits for each one's tokens (in a
  worker thread while the device still runs; inline when they are there already) and
  writes its `StepResult` to the `results` channel.

The sampler runs inside the launch, not as a second actor: there is no handshake per
step. On the CPU (and with any runner that computes a step before `launch` returns)
the handle is complete at once and the resolver sends it without waiting: the same path.

A plan with `pending_structured_output_tokens` is launched in two halves: its forward
at once, its sampling when its `GrammarOutput` (the grammar bitmask, filled by the
scheduler once the previous step's tokens arrived) comes next on the steps channel.
The resolver sends the previous step's result meanwhile, so nothing waits in a cycle.

Under tensor parallelism rank 0 forwards, samples and broadcasts the sampled ids; the
other ranks (`results=None`) run the same forward (their collectives meet rank 0's)
and receive the ids, so every rank's requests hold the same tokens for the next step.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from flowengine.actors.base import Channel, run_blocking
from flowengine.engine import step_trace
from flowengine.executor.executor import CompletedStep, Executor, StepHandle
from flowengine.messages import (
    GrammarOutput,
    Shutdown,
    StepPlan,
    StepResult,
    split_step_result,
)
from flowengine.shm.errors import RecordTooLargeError

logger = logging.getLogger(__name__)

# Handles launched and not yet taken by the resolver. The scheduler keeps at most two
# steps in flight (DESIGN.md §5), so this bound is never what stops the launcher; it
# only keeps a runaway sender from queueing device work without end.
MAX_UNRESOLVED_STEPS = 4

# A step that computes on the host (a CPU forward) of at most this many tokens runs
# inline on the event loop rather than through `blocking`. Measured on the 2-core
# development CPU through `flowengine serve` (docs/benchmarks.md, session 30), inline
# against a worker thread: one stream, median TPOT 8.8 against 9.35 ms (13 of 18
# alternated pairs faster: the thread hop's wake-ups, and the loop's work competing
# with the forward's threads for the cores, cost more than doing that work after the
# step); 4 streams even (2 pairs: 203.7 / 215.2 against 198.8 / 230.6 output tok/s);
# 16 streams slower (293.6 / 279.9 against 303.5 / 304.0), where the loop's work per
# step grows with the streams and overlapping it with the forward pays. So only a
# one-token step (one decode row) runs inline; prefill chunks always take the thread,
# so the server stays responsive during them.
INLINE_STEP_TOKENS = 1


def _error_result(plan: StepPlan, exc: BaseException) -> StepResult:
    return StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}")


class ExecutorActor:
    """Runs each `StepPlan` through the model; rank 0 also writes its `StepResult`.

    Args:
        executor: model runner + sampler for this device.
        steps: inbox of `StepPlan | Shutdown` (this rank's reader of the broadcast).
        results: outbox of `StepResult` on rank 0 (the channel's one writer); None on
            the other tensor-parallel ranks.
        blocking: runs a launch that computes on the host (a CPU forward) off the event
            loop: a worker thread in the in-process placement, inline in an executor
            process. A launch that only enqueues device work
            (`executor.launches_on_device`) runs inline on the loop in any placement:
            a worker thread would only add a thread hop and GIL hand-overs per step.
        wait: runs the resolution of a step whose tokens are still on the device;
            defaults to a worker thread (the wait releases the GIL, so the launcher
            keeps launching meanwhile).
        inline_step_tokens: a host-computed launch of at most this many scheduled
            tokens runs inline instead of through `blocking` (INLINE_STEP_TOKENS; 0:
            never).

    A failed step becomes a StepResult with `error` set (its requests finish with
    "error", the engine keeps serving). Under tensor parallelism only an invalid plan
    (ValueError, raised on every rank before any collective) is survivable: after any
    other failure of the forward the ranks may be out of step, so the actor raises and
    the supervisor restarts the group (the requests in flight are recomputed).
    """

    def __init__(
        self,
        executor: Executor,
        steps: Channel,
        results: Channel | None,
        blocking: Callable[..., Awaitable[Any]] = run_blocking,
        wait: Callable[..., Awaitable[Any]] = run_blocking,
        inline_step_tokens: int = INLINE_STEP_TOKENS,
    ) -> None:
        self.executor = executor
        self.inline_step_tokens = inline_step_tokens
        self.steps = steps
        self.results = results
        self._blocking = blocking
        self._wait = wait
        # Ranks that must stay in step (tensor- or pipeline-parallel peers).
        pp = getattr(executor.runner, "pp", None)
        self._tensor_parallel = (executor.runner.tp.world_size > 1
                                 or (pp is not None and pp.size > 1))
        self._launch_inline = bool(getattr(executor, "launches_on_device", False))
        self.busy_s = 0.0  # time launching steps (forward + sampling on the CPU)
        self.resolve_s = 0.0  # time resolving handles (waits for the device included)
        self.num_waited = 0  # handles whose tokens were not on the host yet
        # Step timers (`timers()`): steps launched, their rows, the first and last
        # launch times (their span / steps is the served step's wall time).
        self.num_launched = 0
        self.rows_launched = 0
        self._first_launch = 0.0
        self._last_launch = 0.0
        # With FLOWENGINE_DEVICE_TIMERS (CUDA): the device's own time per step, from
        # each step's timing events (after its inputs' copy -> after its tokens' copy),
        # and the device's idle gap before each step (the previous step's end -> this
        # step's start), summed over the timed steps.
        self.num_timed = 0
        self.device_s = 0.0
        self.gap_s = 0.0
        self.num_gaps = 0
        self._prev_end: Any = None
        # Steps launched while no other step was in flight: the device's gap before
        # them is a lull in the work, not host time, and is not counted.
        self._in_flight = 0
        self._from_idle: set[int] = set()

    def timers(self) -> dict[str, float]:
        """This actor's step timers: steps, mean rows, wall per step between the first
        and the last launch, host time launching and resolving per step (us), and the
        share of steps whose tokens the resolver had to wait for (device-bound); with
        FLOWENGINE_DEVICE_TIMERS on CUDA also the device's time per timed step
        (device_us_per_step: from the step's inputs on the device to its tokens copied
        out) and its idle gap before a step (gap_us_per_step: the device waiting for
        the host; not counted before a step launched with none in flight, nor after an
        untimed step; `gaps` says how many were, and neither key is there when none
        was). Steps that sample nothing are not timed."""
        n = max(self.num_launched, 1)
        span = self._last_launch - self._first_launch
        out = {"steps": self.num_launched, "mean_rows": self.rows_launched / n,
               "wall_us_per_step": 1e6 * span / max(self.num_launched - 1, 1),
               "launch_us_per_step": 1e6 * self.busy_s / n,
               "resolve_us_per_step": 1e6 * self.resolve_s / n,
               "waited_share": self.num_waited / n}
        if self.num_timed:
            out["timed_steps"] = self.num_timed
            out["device_us_per_step"] = 1e6 * self.device_s / self.num_timed
        if self.num_gaps:  # none measured (e.g. one step in flight at a time): no figure
            out["gaps"] = self.num_gaps
            out["gap_us_per_step"] = 1e6 * self.gap_s / self.num_gaps
        return out

    def _time_device(self, handle: StepHandle) -> None:
        """Add a resolved step's device time and the gap before it (DEVICE_TIMERS)."""
        from_idle = handle.step_id in self._from_idle
        self._from_idle.discard(handle.step_id)
        events = getattr(handle, "device_events", None)
        if events is None:  # an untimed step: the next gap would include its work
            self._prev_end = None
            return
        start, end = events
        try:
            device_s = start.elapsed_time(end) / 1e3
            gap_s = (None if self._prev_end is None or from_idle
                     else max(self._prev_end.elapsed_time(start), 0.0) / 1e3)
        except RuntimeError:  # e.g. a step that failed on the device: not timed
            self._prev_end = None
            return
        self.num_timed += 1
        self.device_s += device_s
        if gap_s is not None:
            self.num_gaps += 1
            self.gap_s += gap_s
        self._prev_end = end

    async def run(self) -> None:
        if self.results is None:
            await self._follow()
            return
        send, recv = anyio.create_memory_object_stream[StepHandle](MAX_UNRESOLVED_STEPS)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._resolve, recv, name="resolver")
                await self._launch_all(send)
        finally:
            if self.num_launched:
                logger.info("executor timers: %s", " ".join(
                    f"{k}={v:.4g}" for k, v in self.timers().items()))

    # ------------------------------------------------------------------ rank 0
    async def _launch_all(self, handles: MemoryObjectSendStream[StepHandle]) -> None:
        async with handles:  # closing it lets the resolver finish the last handles
            while True:
                msg = await self.steps.recv_async()
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, GrammarOutput):
                    raise RuntimeError(f"the grammar bitmask of step {msg.step_id} arrived "
                                       "without its plan")
                if step_trace.ENABLED:
                    step_trace.mark("ex_plan", msg.step_id, len(msg.num_scheduled_tokens))
                now = time.perf_counter()
                if not self._in_flight:
                    self._from_idle.add(msg.step_id)
                self._in_flight += 1
                if not self.num_launched:
                    self._first_launch = now
                self._last_launch = now
                self.num_launched += 1
                self.rows_launched += len(msg.scheduled_req_ids)
                if msg.pending_structured_output_tokens:
                    handle = await self._launch_pending(msg)
                    if handle is None:
                        return  # Shutdown while the step waited for its bitmask
                else:
                    handle = await self._launch(msg, self.executor.launch, msg)
                if step_trace.ENABLED:
                    step_trace.mark("ex_launched", msg.step_id)
                await handles.send(handle)

    async def _launch_pending(self, plan: StepPlan) -> StepHandle | None:
        """A plan whose grammar bitmask follows it: its forward is launched now, while
        the step before it finishes and its tokens reach the scheduler, which then
        fills and sends this step's `GrammarOutput`; sampling waits for that (the
        resolver keeps sending results meanwhile). None on Shutdown."""
        forward = await self._launch(plan, self.executor.launch_forward, plan)
        if step_trace.ENABLED:
            step_trace.mark("ex_forward_launched", plan.step_id)
        grammar = await self.steps.recv_async()
        if isinstance(grammar, Shutdown):
            return None
        if step_trace.ENABLED:
            step_trace.mark("ex_grammar", grammar.step_id)
        if not isinstance(grammar, GrammarOutput) or grammar.step_id != plan.step_id:
            raise RuntimeError(f"step {plan.step_id} waits for its grammar bitmask, got "
                               f"{type(grammar).__name__} {getattr(grammar, 'step_id', '')}")
        if isinstance(forward, CompletedStep):
            return forward  # the forward failed: its error is the step's result
        return await self._launch(plan, self.executor.launch_sampling, forward, grammar)

    async def _launch(self, plan: StepPlan, launch: Callable[..., Any], *args: Any) -> Any:
        """`launch(*args)` (a launch of `plan`, or one of its halves), inline or off the
        loop (see `blocking`); a failure becomes a CompletedStep with the error."""
        start = time.perf_counter()
        try:
            if self._launch_inline or sum(plan.num_scheduled_tokens) <= self.inline_step_tokens:
                return launch(*args)
            return await self._blocking(launch, *args)
        except Exception as exc:
            if self._tensor_parallel and not isinstance(exc, ValueError):
                raise  # the group must restart (class docstring)
            logger.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            return CompletedStep(_error_result(plan, exc))
        finally:
            self.busy_s += time.perf_counter() - start

    async def _resolve(self, handles: MemoryObjectReceiveStream[StepHandle]) -> None:
        assert self.results is not None
        async with handles:
            async for handle in handles:
                start = time.perf_counter()
                try:
                    if handle.done():
                        result = handle.result()
                    else:
                        # The device still runs it: wait (GIL released) off the loop.
                        self.num_waited += 1
                        result = await self._wait(handle.result)
                except Exception as exc:  # e.g. a device fault surfacing at the copy
                    logger.error("step %d failed: %s", handle.step_id, traceback.format_exc())
                    result = StepResult(handle.step_id, [],
                                        error=f"{type(exc).__name__}: {exc}")
                self.resolve_s += time.perf_counter() - start
                self._in_flight -= 1
                self._time_device(handle)
                if step_trace.ENABLED:
                    step_trace.mark("ex_resolved", handle.step_id)
                try:
                    await self.results.send_async(result)
                except RecordTooLargeError as exc:
                    await self._send_in_parts(result, exc)

    async def _send_in_parts(self, result: StepResult, exc: RecordTooLargeError) -> None:
        """Send a result too large for one record of the results ring as several (each
        at most half the ring, so the scheduler reads one while the next goes in); if
        one request's part alone is too large, the step fails, not the process: a
        restart would recompute the same requests and fail again until the engine
        gives up."""
        assert self.results is not None
        max_bytes = getattr(getattr(self.results, "ring", None), "max_payload_bytes", 0)
        parts = split_step_result(result, max_bytes // 2) if max_bytes else None
        if parts is not None:
            for part in parts:
                await self.results.send_async(part)
            return
        logger.error("step %d: %s", result.step_id, exc)
        await self.results.send_async(StepResult(
            result.step_id, [],
            error="the step's result is too large for the results ring; ask "
                  "for fewer logprobs or prompt_logprobs"))

    # ------------------------------------------------------------------ ranks 1..N-1
    async def _follow(self) -> None:
        while True:
            msg = await self.steps.recv_async()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, GrammarOutput):
                continue  # rank 0 samples: the grammar bitmask is its business
            start = time.perf_counter()
            try:
                if not await self._blocking(self.executor.follow, msg):
                    logger.error("step %d: rank 0 failed to sample it", msg.step_id)
            except ValueError:
                # An invalid plan: every rank refused it before any collective, and rank
                # 0 reports it on the results channel.
                logger.error("step %d failed: %s", msg.step_id, traceback.format_exc())
            finally:
                self.busy_s += time.perf_counter() - start
