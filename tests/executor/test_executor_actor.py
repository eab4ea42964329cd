"""The Executor actor's launcher and resolver (flowengine/actors/executor.py).

A scripted executor hands out handles that stay unresolved until the test releases
them, as a CudaModelRunner's do while the device runs: the actor must launch step N+1
before step N's tokens are on the host, send results in launch order, and turn every
failure into an error result for that step only.
"""

from __future__ import annotations

import threading

import anyio

from flowengine.actors.executor import ExecutorActor
from flowengine.executor.executor import CompletedStep
from flowengine.messages import SampledTokens, Shutdown, StepPlan, StepResult
from flowengine.shm.inproc import InprocChannel


class _Tp:
    rank = 0
    world_size = 1


class _Handle:
    """Unresolved until `release()`; result() then gives one token per plan."""

    def __init__(self, step_id: int, log: list[str]) -> None:
        self.step_id = step_id
        self._released = threading.Event()
        self._log = log

    def release(self) -> None:
        self._released.set()

    def done(self) -> bool:
        return self._released.is_set()

    def result(self) -> StepResult:
        self._released.wait(timeout=30)
        self._log.append(f"resolved {self.step_id}")
        return StepResult(self.step_id, [SampledTokens("r", [100 + self.step_id])])


class _ScriptedExecutor:
    """device_events: step id -> the (start, end) timing events its handle carries
    (FLOWENGINE_DEVICE_TIMERS); other steps' handles carry none."""

    def __init__(self, fail_launch: set[int], fail_result: set[int],
                 device_events: dict[int, tuple] | None = None) -> None:
        self.runner = self
        self.tp = _Tp()
        self.log: list[str] = []
        self.handles: dict[int, _Handle] = {}
        self._fail_launch = fail_launch
        self._fail_result = fail_result
        self._device_events = device_events or {}

    def launch(self, plan: StepPlan):
        self.log.append(f"launched {plan.step_id}")
        if plan.step_id in self._fail_launch:
            raise RuntimeError(f"forward of step {plan.step_id} failed")
        if plan.step_id in self._fail_result:
            handle = _FailingHandle(plan.step_id)
            return handle
        handle = self.handles[plan.step_id] = _Handle(plan.step_id, self.log)
        if plan.step_id in self._device_events:
            handle.device_events = self._device_events[plan.step_id]
        return handle


class _FailingHandle:
    def __init__(self, step_id: int) -> None:
        self.step_id = step_id

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        raise RuntimeError("device fault")


async def _inline(fn, *args):
    return fn(*args)


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id=step_id, new_reqs=[], cached_reqs=[], num_scheduled_tokens=[],
                    finished_req_ids=[])


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.001)


def test_step_n_plus_1_is_launched_before_step_n_resolves() -> None:
    anyio.run(_test_step_n_plus_1_is_launched_before_step_n_resolves)


async def _test_step_n_plus_1_is_launched_before_step_n_resolves() -> None:
    executor = _ScriptedExecutor(set(), set())
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await steps.send_async(_plan(0))
        await steps.send_async(_plan(1))
        await _wait_for(lambda: "launched 1" in executor.log)
        assert executor.log == ["launched 0", "launched 1"]  # nothing resolved yet
        assert results.try_recv() is None
        # Step 1 completes on the device first; its result still waits for step 0's.
        executor.handles[1].release()
        await anyio.sleep(0.05)
        assert results.try_recv() is None
        executor.handles[0].release()
        with anyio.fail_after(30):
            first, second = await results.recv_async(), await results.recv_async()
        assert [first.step_id, second.step_id] == [0, 1]
        assert [s.token_ids for s in first.sampled] == [[100]]
        assert [s.token_ids for s in second.sampled] == [[101]]
        assert executor.log == ["launched 0", "launched 1", "resolved 0", "resolved 1"]
        await steps.send_async(Shutdown())
    assert actor.num_waited == 1  # step 0 was waited for; step 1 was done by then


def test_a_failed_launch_or_resolution_fails_that_step_only() -> None:
    anyio.run(_test_a_failed_launch_or_resolution_fails_that_step_only)


async def _test_a_failed_launch_or_resolution_fails_that_step_only() -> None:
    executor = _ScriptedExecutor(fail_launch={1}, fail_result={2})
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        for step_id in range(4):
            await steps.send_async(_plan(step_id))
        await _wait_for(lambda: "launched 3" in executor.log)
        executor.handles[0].release()
        executor.handles[3].release()
        with anyio.fail_after(30):
            got = [await results.recv_async() for _ in range(4)]
        await steps.send_async(Shutdown())
    assert [r.step_id for r in got] == [0, 1, 2, 3]
    assert [r.error for r in got] == [
        None,
        "RuntimeError: forward of step 1 failed",
        "RuntimeError: device fault",
        None,
    ]
    assert [s.token_ids for s in got[3].sampled] == [[103]]


def test_shutdown_resolves_the_launched_steps_first() -> None:
    anyio.run(_test_shutdown_resolves_the_launched_steps_first)


async def _test_shutdown_resolves_the_launched_steps_first() -> None:
    executor = _ScriptedExecutor(set(), set())
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await steps.send_async(_plan(0))
        await steps.send_async(Shutdown())
        await _wait_for(lambda: "launched 0" in executor.log)
        executor.handles[0].release()
    # run() returned only after step 0's result went out.
    result = results.try_recv()
    assert result is not None and result.step_id == 0 and result.error is None


def test_a_launch_that_only_enqueues_device_work_runs_on_the_loop() -> None:
    anyio.run(_test_a_launch_that_only_enqueues_device_work_runs_on_the_loop)


async def _test_a_launch_that_only_enqueues_device_work_runs_on_the_loop() -> None:
    async def no_thread(fn, *args):
        raise AssertionError("a device launch must not go through a worker thread")

    executor = _ScriptedExecutor(set(), set())
    executor.launches_on_device = True  # type: ignore[attr-defined]
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=no_thread)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await steps.send_async(_plan(0))
        await _wait_for(lambda: 0 in executor.handles)
        executor.handles[0].release()
        with anyio.fail_after(30):
            result = await results.recv_async()
        await steps.send_async(Shutdown())
    assert result.step_id == 0 and result.error is None
    assert executor.log == ["launched 0", "resolved 0"]


def test_completed_step_handle_is_done_at_once() -> None:
    handle = CompletedStep(StepResult(7, []))
    assert handle.done() and handle.step_id == 7 and handle.result() == StepResult(7, [])


def test_a_small_host_step_runs_inline_and_a_prefill_chunk_in_the_worker() -> None:
    anyio.run(_test_a_small_host_step_runs_inline_and_a_prefill_chunk_in_the_worker)


async def _test_a_small_host_step_runs_inline_and_a_prefill_chunk_in_the_worker() -> None:
    # A CPU launch computes the step before returning. Up to INLINE_STEP_TOKENS scheduled
    # tokens (one decode row) it runs on the loop; a larger one (more rows, a prefill
    # chunk) through `blocking`, so the loop keeps serving while it computes.
    from flowengine.actors.executor import INLINE_STEP_TOKENS

    through_blocking: list[int] = []

    async def recording(fn, *args):
        through_blocking.append(args[0].step_id)
        return fn(*args)

    executor = _ScriptedExecutor(set(), set())
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=recording)
    sizes = {0: [1] * INLINE_STEP_TOKENS, 1: [INLINE_STEP_TOKENS], 2: [INLINE_STEP_TOKENS, 1],
             3: [512]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        for step_id, tokens in sizes.items():
            plan = _plan(step_id)
            plan.num_scheduled_tokens = tokens
            await steps.send_async(plan)
            await _wait_for(lambda s=step_id: s in executor.handles)
            executor.handles[step_id].release()
            with anyio.fail_after(30):
                assert (await results.recv_async()).step_id == step_id
        await steps.send_async(Shutdown())
    assert through_blocking == [2, 3]


class _FakeEvent:
    """A CUDA timing event's stand-in: a time on the device's clock (ms)."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.t_ms - self.t_ms


def _spans(spans: dict[int, tuple[float, float]]) -> dict[int, tuple[_FakeEvent, _FakeEvent]]:
    return {step: (_FakeEvent(a), _FakeEvent(b)) for step, (a, b) in spans.items()}


async def _run_steps(executor: _ScriptedExecutor, steps: InprocChannel,
                     results: InprocChannel, step_ids: range) -> None:
    """Send the plans of `step_ids`, each launched while the ones before are in flight,
    then release them all and check their results arrive in order."""
    for step_id in step_ids:
        await steps.send_async(_plan(step_id))
    await _wait_for(lambda: f"launched {step_ids[-1]}" in executor.log)
    for step_id in step_ids:
        executor.handles[step_id].release()
    with anyio.fail_after(30):
        assert [(await results.recv_async()).step_id for _ in step_ids] == list(step_ids)


def test_device_timers_sum_device_time_and_the_gaps_between_steps_in_flight() -> None:
    anyio.run(_test_device_timers)


async def _test_device_timers() -> None:
    # Device timeline (ms): step 0 [0, 2], step 1 [2.5, 4.5], step 2 [4.6, 6.6], step 3 (no
    # events: untimed), step 4 [7, 9] (its gap follows an untimed step: not counted),
    # then, launched with nothing in flight, step 5 [100, 102] (a lull, not counted).
    spans = {0: (0.0, 2.0), 1: (2.5, 4.5), 2: (4.6, 6.6), 4: (7.0, 9.0), 5: (100.0, 102.0)}
    executor = _ScriptedExecutor(set(), set(), _spans(spans))
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await _run_steps(executor, steps, results, range(5))
        await _run_steps(executor, steps, results, range(5, 6))  # nothing in flight now
        await steps.send_async(Shutdown())
    timers = actor.timers()
    assert timers["timed_steps"] == 5  # steps 0, 1, 2, 4, 5
    assert abs(timers["device_us_per_step"] - 2000.0) < 1e-6
    assert abs(timers["gap_us_per_step"] - (500.0 + 100.0) / 2) < 1e-6  # steps 1 and 2


def test_timers_without_device_events_report_no_device_time() -> None:
    anyio.run(_test_timers_untimed)


async def _test_timers_untimed() -> None:
    executor = _ScriptedExecutor(set(), set())
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await _run_steps(executor, steps, results, range(1))
        await steps.send_async(Shutdown())
    timers = actor.timers()
    assert timers["steps"] == 1
    assert "device_us_per_step" not in timers and "gap_us_per_step" not in timers


class _FailedEvent(_FakeEvent):
    def elapsed_time(self, end: _FakeEvent) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_device_timers_count_no_gap_across_a_step_that_failed_on_the_device() -> None:
    anyio.run(_test_device_timers_failed_step)


async def _test_device_timers_failed_step() -> None:
    # Step 0 [0, 1]; step 1 failed on the device (its events cannot be read); step 2
    # [50, 51]: the gap before it would include step 1's work and is not counted.
    events = _spans({0: (0.0, 1.0), 2: (50.0, 51.0)})
    events[1] = (_FailedEvent(1.5), _FakeEvent(5.0))
    executor = _ScriptedExecutor(set(), set(), events)
    steps, results = InprocChannel(), InprocChannel()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await _run_steps(executor, steps, results, range(3))
        await steps.send_async(Shutdown())
    timers = actor.timers()
    assert timers["timed_steps"] == 2  # steps 0 and 2
    assert abs(timers["device_us_per_step"] - 1000.0) < 1e-6
    assert "gap_us_per_step" not in timers  # no gap between two measured steps in a row


def test_a_result_too_large_for_the_ring_fails_that_step_only() -> None:
    anyio.run(_test_a_result_too_large_for_the_ring_fails_that_step_only)


async def _test_a_result_too_large_for_the_ring_fails_that_step_only() -> None:
    """A step result no record of the results ring can hold (prompt_logprobs=-1 over a
    long prefill chunk): that step fails with the error. It used to end the executor
    process; the restart recomputed the same request and failed again, 20 times, and
    the engine was dead for every caller."""
    from flowengine.messages import TokenLogprobs
    from flowengine.shm.errors import RecordTooLargeError

    class _BigHandle(_Handle):
        def result(self) -> StepResult:
            lp = TokenLogprobs(list(range(1000)), [0.0] * 1000, 0.0, 1)
            return StepResult(self.step_id, [SampledTokens("r", [7], prompt_logprobs=[lp])])

    class _BigStepExecutor(_ScriptedExecutor):
        def launch(self, plan: StepPlan):
            if plan.step_id != 1:
                return super().launch(plan)
            self.log.append("launched 1")
            handle = self.handles[1] = _BigHandle(1, self.log)
            return handle

    class _SmallRing(InprocChannel):
        async def send_async(self, msg) -> None:
            if any(s.prompt_logprobs for s in msg.sampled):
                raise RecordTooLargeError("record of 99 MB exceeds the largest record ring "
                                          "/results can hold (8 MB)")
            await super().send_async(msg)

    executor = _BigStepExecutor(set(), set())
    steps, results = InprocChannel(), _SmallRing()
    actor = ExecutorActor(executor, steps, results, blocking=_inline)
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        for step_id in range(3):
            await steps.send_async(_plan(step_id))
        await _wait_for(lambda: "launched 2" in executor.log)
        for step_id in range(3):
            executor.handles[step_id].release()
        with anyio.fail_after(30):
            got = [await results.recv_async() for _ in range(3)]
        await steps.send_async(Shutdown())
    assert [r.step_id for r in got] == [0, 1, 2]
    assert got[1].sampled == [] and "too large for the results ring" in got[1].error
    assert "prompt_logprobs" in got[1].error
    assert [s.token_ids for s in got[2].sampled] == [[102]]
