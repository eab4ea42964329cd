"""Executor and Sampler actors: step plans in, sampled tokens out (DESIGN.md §1, §6).

One Executor actor per device (tensor-parallel rank). Rank 0 also runs the Sampler
actor, which turns the step's logits into tokens, broadcasts them to the other ranks
and writes the `results` channel. The two actors live in one process and one event
loop: logits are device tensors. The other ranks run the same forward (their
collectives meet rank 0's) and receive the sampled tokens, so every rank's requests
hold the same tokens for the next step.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from flowengine.actors.base import Channel, run_blocking
from flowengine.executor.executor import Executor
from flowengine.messages import Shutdown, StepPlan, StepResult

logger = logging.getLogger(__name__)


class SamplerActor:
    """Samples each step's logits (rank 0) and sends the `StepResult`."""

    def __init__(
        self,
        executor: Executor,
        results: Channel,
        blocking: Callable[..., Awaitable[Any]] = run_blocking,
    ) -> None:
        self.executor = executor
        self.results = results
        self._blocking = blocking
        send, recv = anyio.create_memory_object_stream[tuple[StepPlan, Any, anyio.Event] | None](1)
        self.inbox = send
        self._recv = recv
        self.busy_s = 0.0  # time sampling

    async def run(self) -> None:
        async with self._recv:
            async for item in self._recv:
                if item is None:
                    return
                plan, model_output, done = item
                start = time.perf_counter()
                try:
                    result = await self._blocking(self.executor.sample, plan, model_output)
                except Exception as exc:
                    logger.error("sampling step %d failed: %s", plan.step_id, traceback.format_exc())
                    result = StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}")
                self.busy_s += time.perf_counter() - start
                done.set()  # the runner holds the new tokens: the next step may start
                await self.results.send_async(result)


class ExecutorActor:
    """Runs each `StepPlan` through the model.

    Args:
        executor: model runner + sampler for this device.
        steps: inbox of `StepPlan | Shutdown` (this rank's reader of the broadcast).
        sampler: the Sampler actor on rank 0, None on other ranks.
        results: where a failed forward's error goes when there is no sampler (rank 0).
    """

    def __init__(
        self,
        executor: Executor,
        steps: Channel,
        sampler: SamplerActor | None,
        results: Channel | None = None,
        blocking: Callable[..., Awaitable[Any]] = run_blocking,
    ) -> None:
        self.executor = executor
        self.steps = steps
        self.sampler = sampler
        self.results = results
        self._blocking = blocking
        self.busy_s = 0.0  # time in the model forward

    async def run(self) -> None:
        try:
            while True:
                msg = await self.steps.recv_async()
                if isinstance(msg, Shutdown):
                    return
                await self._step(msg)
        finally:
            if self.sampler is not None:
                await self.sampler.inbox.send(None)

    async def _step(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        tensor_parallel = self.executor.runner.tp.world_size > 1
        try:
            output = await self._blocking(self.executor.runner.execute_model, plan)
            if self.sampler is None and tensor_parallel and not await self._blocking(
                    self.executor.receive_sampled, plan, output):
                logger.error("step %d: rank 0 failed to sample it", plan.step_id)
        except Exception as exc:
            if tensor_parallel and not isinstance(exc, ValueError):
                # Only an invalid plan (ValueError, raised on every rank before any
                # collective) leaves the ranks in step; after anything else the group
                # must restart (the supervisor recomputes the requests in flight).
                raise
            logger.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            if self.results is not None:
                error = f"{type(exc).__name__}: {exc}"
                await self.results.send_async(StepResult(plan.step_id, [], error=error))
            return
        finally:
            self.busy_s += time.perf_counter() - start
        if self.sampler is None:
            return
        done = anyio.Event()
        await self.sampler.inbox.send((plan, output, done))
        await done.wait()
