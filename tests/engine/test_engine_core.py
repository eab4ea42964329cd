"""EngineCore: requests in as core methods, step() = schedule, execute, update, and the
one pending-delta list that the Scheduler actor and LLM share."""

from __future__ import annotations

import pytest

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.engine.engine_core import EngineCore
from flowengine.messages import (
    AbortRequest,
    NewRequest,
    RequestDelta,
    SampledTokens,
    StepPlan,
    StepResult,
)
from flowengine.sampling_params import SamplingParams


class _CountingExecutor:
    """Samples token 7 + step id for every request whose tokens reach the last one."""

    def __init__(self, fail_steps: set[int] | None = None) -> None:
        self.num_tokens: dict[str, int] = {}
        self.plans: list[StepPlan] = []
        self.fail_steps = fail_steps or set()

    def execute_model(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if plan.step_id in self.fail_steps:
            raise RuntimeError("the device fell over")
        for new in plan.new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
        computed = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
        computed.update({r.req_id: r.num_computed_tokens for r in plan.cached_reqs})
        sampled = []
        for rid, n in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True):
            if computed[rid] + n >= self.num_tokens[rid]:
                self.num_tokens[rid] += 1
                sampled.append(SampledTokens(rid, [7 + plan.step_id]))
        return StepResult(plan.step_id, sampled)


def _core(executor=None, max_model_len: int = 64) -> EngineCore:
    scheduler = Scheduler(SchedulerConfig(4, 64, max_model_len), CacheConfig(4, 32))
    return EngineCore(scheduler, executor, max_model_len)


def _msg(rid: str, num_prompt: int = 3, max_tokens: int = 2) -> NewRequest:
    return NewRequest(rid, list(range(1, num_prompt + 1)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def test_step_runs_requests_to_the_end_with_exact_tokens() -> None:
    executor = _CountingExecutor()
    core = _core(executor)
    core.add_request(_msg("a", max_tokens=3))
    steps = []
    while core.has_unfinished_requests():
        steps.append([(d.req_id, d.new_token_ids, d.finish_reason) for d in core.step()])
    assert steps == [[("a", [7], None)], [("a", [8], None)], [("a", [9], "length")]]
    assert [p.step_id for p in executor.plans] == [0, 1, 2]
    assert core.num_steps == 3


def test_add_request_raises_but_handle_turns_bad_input_into_an_error_delta() -> None:
    core = _core(_CountingExecutor(), max_model_len=8)
    with pytest.raises(ValueError, match="empty"):
        core.add_request(NewRequest("e", [], SamplingParams(), 0.0))
    assert not core.has_unfinished_requests()
    core.handle(_msg("long", num_prompt=9))
    assert core.has_pending_outputs
    (delta,) = core.take_outputs()
    assert (delta.req_id, delta.new_token_ids, delta.finish_reason) == ("long", [], "error")
    assert "max_model_len" in (delta.error or "")
    assert not core.has_pending_outputs and core.take_outputs() == []


def test_a_live_request_resent_is_kept_once() -> None:
    executor = _CountingExecutor()
    core = _core(executor)
    core.handle(_msg("a"))
    core.handle(_msg("a"))  # resubmitted after a restart and also sent directly
    assert not core.has_pending_outputs
    assert core.scheduler.num_waiting == 1
    assert [d.new_token_ids for d in core.step()] == [[7]]


def test_aborts_lead_the_next_step_and_free_blocks() -> None:
    executor = _CountingExecutor()
    core = _core(executor)
    core.add_request(_msg("a", max_tokens=5))
    core.add_request(_msg("b", max_tokens=5))
    assert [d.req_id for d in core.step()] == ["a", "b"]
    core.handle(AbortRequest(["a", "unknown"]))
    deltas = core.step()
    assert deltas[0] == RequestDelta("a", [], finish_reason="abort")
    assert [(d.req_id, d.new_token_ids) for d in deltas[1:]] == [("b", [8])]
    assert executor.plans[-1].finished_req_ids == ["a"]
    assert core.scheduler.get_request("a") is None
    core.abort_requests(["b"])
    assert core.step() == [RequestDelta("b", [], finish_reason="abort")]
    assert core.scheduler.num_free_blocks == 32 and not core.has_unfinished_requests()


def test_schedule_and_update_are_the_two_halves_of_step() -> None:
    core = _core(None)  # the engine process: the executor runs elsewhere
    core.add_request(_msg("a"))
    plan = core.schedule()
    assert plan is not None and plan.scheduled_req_ids == ["a"]
    assert core.schedule() is None  # "a" waits for its result (no async scheduling)
    with pytest.raises(RuntimeError, match="no executor"):
        core.execute(plan)
    core.abort_requests(["nobody"])
    deltas = core.update(plan, StepResult(plan.step_id, [SampledTokens("a", [42])]))
    assert [(d.req_id, d.new_token_ids) for d in deltas] == [("a", [42])]


def test_an_executor_exception_fails_only_that_step() -> None:
    executor = _CountingExecutor(fail_steps={1})
    core = _core(executor)
    core.add_request(_msg("a", max_tokens=4))
    assert [d.new_token_ids for d in core.step()] == [[7]]
    (failed,) = core.step()
    assert (failed.req_id, failed.finish_reason) == ("a", "error")
    assert failed.error == "RuntimeError: the device fell over"
    core.add_request(_msg("b", max_tokens=1))
    assert [(d.req_id, d.new_token_ids, d.finish_reason) for d in core.step()] == [
        ("b", [9], "length")
    ]


def test_a_step_interrupted_by_ctrl_c_is_retired_and_the_core_keeps_serving() -> None:
    """KeyboardInterrupt during the forward (Ctrl-C in `LLM.generate`, in process): the
    step's requests finish with an error and their blocks are freed; the interrupted
    plan used to stay in flight, so every later step failed ("result of step N
    applied, but the oldest step in flight is N-1") and its blocks were never freed."""

    class _InterruptedExecutor(_CountingExecutor):
        def execute_model(self, plan: StepPlan) -> StepResult:
            if plan.step_id == 1:
                raise KeyboardInterrupt
            return super().execute_model(plan)

    core = _core(_InterruptedExecutor())
    core.add_request(_msg("a", max_tokens=4))
    assert [d.new_token_ids for d in core.step()] == [[7]]
    with pytest.raises(KeyboardInterrupt):
        core.step()
    (failed,) = core.step()  # the interrupted step's outcome comes with the next step
    assert (failed.req_id, failed.finish_reason) == ("a", "error")
    assert failed.error == "the step was interrupted (KeyboardInterrupt)"
    assert core.scheduler.num_free_blocks == 32 and not core.has_unfinished_requests()
    core.add_request(_msg("b", max_tokens=1))
    assert [(d.req_id, d.new_token_ids, d.finish_reason) for d in core.step()] == [
        ("b", [9], "length")
    ]
