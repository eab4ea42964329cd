"""Engine loops for gpu_bench.py, instrumented per step.

`run_overlapped` is the Scheduler actor's loop run in place: up to two steps launched
(async scheduling), step N+1 enqueued on the GPU before step N's tokens are read
(DESIGN.md §5). `run_sync` is `EngineCore.step()`, one step at a time (what `LLM`
runs today). Both record, per step, its shape, host times and CUDA events around its
launch, from which the GPU idle time between steps follows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flowengine.engine.engine_core import EngineCore
from flowengine.messages import StepPlan


@dataclass
class StepLog:
    """One step: requests and tokens scheduled, host time (perf_counter s) when its
    result was known, and CUDA events recorded before and after its launch."""

    num_reqs: int
    num_tokens: int
    done_s: float = 0.0
    start: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))
    end: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event(enable_timing=True))

    @property
    def is_decode(self) -> bool:
        return self.num_reqs == self.num_tokens


def _log(plan: StepPlan) -> StepLog:
    return StepLog(len(plan.num_scheduled_tokens), plan.total_num_scheduled_tokens)


def run_overlapped(engine: EngineCore, max_in_flight: int = 2,
                   until: Callable[[list[StepLog]], bool] | None = None) -> list[StepLog]:
    """Run the added requests with up to max_in_flight launched steps: to completion,
    or until `until(logs)` holds (then the launched steps are drained and the rest of
    the requests stay in the scheduler for a later call)."""
    scheduler, executor = engine.scheduler, engine.executor
    scheduler.async_scheduling = max_in_flight > 1
    logs: list[StepLog] = []
    in_flight: deque = deque()
    try:
        while scheduler.has_unfinished_requests() or in_flight:
            stopping = until is not None and until(logs)
            if stopping and not in_flight:
                break
            while not stopping and len(in_flight) < max_in_flight:
                plan = scheduler.schedule()
                if not plan.num_scheduled_tokens:
                    break  # its finished ids come again in the next plan
                log = _log(plan)
                log.start.record()
                handle = executor.launch(plan)
                log.end.record()
                in_flight.append((plan, handle, log))
            if not in_flight:
                raise RuntimeError("unfinished requests but nothing schedulable")
            plan, handle, log = in_flight.popleft()
            result = handle.result()
            log.done_s = time.perf_counter()
            if result.error is not None:
                raise RuntimeError(f"step {plan.step_id} failed: {result.error}")
            if plan.num_scheduled_tokens:
                logs.append(log)
                scheduler.update_from_output(plan, result)
    finally:
        scheduler.async_scheduling = False
    torch.cuda.synchronize()
    return logs


class _TimedExecutor:
    """Wraps an executor so that EngineCore.step() records its step's events."""

    def __init__(self, executor: object, logs: list[StepLog]) -> None:
        self.executor = executor
        self.logs = logs

    def execute_model(self, plan: StepPlan):  # noqa: ANN201 - StepResult
        log = _log(plan)
        log.start.record()
        handle = self.executor.launch(plan)  # type: ignore[attr-defined]
        log.end.record()
        result = handle.result()
        log.done_s = time.perf_counter()
        self.logs.append(log)
        return result


def run_sync(engine: EngineCore) -> list[StepLog]:
    """Run every added request to completion through EngineCore.step()."""
    logs: list[StepLog] = []
    executor = engine.executor
    engine.executor = _TimedExecutor(executor, logs)
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.error is not None:
                    raise RuntimeError(f"request {delta.req_id} failed: {delta.error}")
    finally:
        engine.executor = executor
    torch.cuda.synchronize()
    return logs


def steady_decode(logs: list[StepLog], num_reqs: int, skip: int = 4) -> list[StepLog]:
    """The decode steps of exactly num_reqs requests in a row, minus the first `skip`
    (warm-up); raises RuntimeError if fewer than 8 remain."""
    steps = [s for s in logs if s.is_decode and s.num_reqs == num_reqs][skip:]
    if len(steps) < 8:
        raise RuntimeError(f"only {len(steps)} steady decode steps of {num_reqs} requests; "
                           "raise --steps")
    return steps


def step_time_ms(steps: list[StepLog]) -> float:
    """Median interval between consecutive results (ms): the engine's time per step."""
    gaps = sorted(1e3 * (b.done_s - a.done_s) for a, b in zip(steps, steps[1:], strict=False))
    return gaps[len(gaps) // 2]


def idle_between_steps(steps: list[StepLog]) -> float:
    """Fraction of GPU time between the first and last step spent waiting for the host
    to enqueue the next step: sum of elapsed(end of launch N, start of launch N+1) over
    the total. An event completes when the stream reaches it, so the gap is zero when
    the host enqueued step N+1 before the GPU finished step N."""
    total = steps[0].start.elapsed_time(steps[-1].end)
    idle = sum(a.end.elapsed_time(b.start) for a, b in zip(steps, steps[1:], strict=False))
    return idle / total


def busy_and_wall(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by the union of the sorted, non-empty (start, end) `spans`, time
    from the first start to the last end), in the spans' unit: a profile's kernel
    busy time and the wall time it spans."""
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, max(e for _, e in spans) - spans[0][0]


def profiler_idle(run_window: Callable[[], object]) -> float | None:
    """Fraction of wall time between the first kernel start and the last kernel end
    with no kernel running, from torch.profiler over `run_window()`; None when the
    profiler recorded no kernels (e.g. no CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_window()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0)
    if not spans:
        return None
    busy, wall = busy_and_wall(spans)
    return 1.0 - busy / wall
