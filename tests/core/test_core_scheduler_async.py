"""Async scheduling (DESIGN.md §5): step N+1 planned on the tokens step N samples.

Exact plans for a decode, the speculative token after a stop and the blocks it keeps,
no speculative token past max_tokens or max_len, aborts and preemptions with steps in
flight, and results applied out of order.
"""

from __future__ import annotations

from collections import deque

import pytest
from core_sim_executor import (
    Finished,
    collect,
    executor_for,
    make_request,
    make_scheduler,
    run_to_completion,
)

from flowengine.core.scheduler import Scheduler
from flowengine.messages import RequestDelta, SampledTokens, StepPlan, StepResult
from flowengine.request import RequestStatus


def scheduled(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True))


def sample(plan: StepPlan, **token_ids: int) -> StepResult:
    """The result of `plan` that samples the given token for each named request."""
    return StepResult(plan.step_id, [SampledTokens(r, [t]) for r, t in token_ids.items()])


def free_block_ids(scheduler: Scheduler) -> list[int]:
    return scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids()


def new_tokens(deltas: list[RequestDelta]) -> list[tuple[str, list[int], str | None]]:
    return [(d.req_id, d.new_token_ids, d.finish_reason) for d in deltas]


def test_decode_runs_in_consecutive_steps_on_the_executors_token() -> None:
    scheduler = make_scheduler(block_size=4, async_scheduling=True)
    executor = executor_for(scheduler)
    request = make_request("a", [1, 2, 3, 4], max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    plans = [scheduler.schedule()]
    results = [executor.execute(plans[0])]
    outputs: dict[str, Finished] = {}
    for step in range(4):
        # Plan step+1 while step `step` is in flight, then apply step `step`.
        plans.append(scheduler.schedule())
        if plans[-1].num_scheduled_tokens:
            results.append(executor.execute(plans[-1]))
        if step == 0:
            # Index 4 is the token step 0 samples: only the executor holds it so far.
            assert request.output_token_ids == []
            assert executor.requests["a"].token_ids[4] == results[0].sampled[0].token_ids[0]
        collect(scheduler.update_from_output(plans[step], results[step]), outputs)
    assert [scheduled(p) for p in plans] == [{"a": 4}, {"a": 1}, {"a": 1}, {"a": 1}, {}]
    assert plans[0].new_reqs[0].block_ids == [0]
    cached = [p.cached_reqs[0] for p in plans[1:4]]
    assert [c.num_computed_tokens for c in cached] == [4, 5, 6]
    assert [c.new_block_ids for c in cached] == [[1], [], []]
    # The 4th token is in flight when step 4 is planned: max_tokens is surely reached,
    # so no speculative token is scheduled.
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.num_total_blocks

    reference = make_scheduler(block_size=4)
    expected = run_to_completion(
        reference,
        executor_for(reference),
        {0: [make_request("a", [1, 2, 3, 4], max_tokens=4, ignore_eos=True)]},
    )
    assert outputs == expected and len(outputs["a"].token_ids) == 4


def test_stopped_request_keeps_its_blocks_until_the_speculative_step_completes() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], eos_token_id=0))
    step0 = scheduler.schedule()
    step1 = scheduler.schedule()  # speculative: a's token at index 3 is not known yet
    assert (scheduled(step0), scheduled(step1)) == ({"a": 3}, {"a": 1})
    assert step0.new_reqs[0].block_ids == [0] and step1.cached_reqs[0].num_computed_tokens == 3

    deltas = scheduler.update_from_output(step0, sample(step0, a=0))  # EOS
    assert new_tokens(deltas) == [("a", [0], "stop")]
    assert not scheduler.has_unfinished_requests()
    # Step 1 still writes slot 3 of block 0: the block is not free, nor handed out.
    assert free_block_ids(scheduler) == [1, 2, 3] and scheduler.num_free_blocks == 3
    scheduler.add_request(make_request("b", [7] * 12, arrival_time=1.0))
    step2 = scheduler.schedule()
    assert step2.new_reqs[0].block_ids == [1, 2, 3] and step2.finished_req_ids == ["a"]

    # The speculative token is dropped, and only now does block 0 come free.
    assert scheduler.update_from_output(step1, sample(step1, a=9)) == []
    assert free_block_ids(scheduler) == [0]
    deltas = scheduler.update_from_output(step2, sample(step2, b=5))
    assert new_tokens(deltas) == [("b", [5], None)]


@pytest.mark.parametrize(
    ("max_tokens", "max_model_len", "finish"), [(2, 100, "length"), (16, 5, "length")]
)
def test_no_speculative_token_past_max_tokens_or_max_len(
    max_tokens: int, max_model_len: int, finish: str
) -> None:
    scheduler = make_scheduler(block_size=4, max_model_len=max_model_len, async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=max_tokens))
    step0 = scheduler.schedule()
    step1 = scheduler.schedule()
    assert scheduled(step1) == {"a": 1}
    assert new_tokens(scheduler.update_from_output(step0, sample(step0, a=5))) == [
        ("a", [5], None)
    ]
    # Its 2nd token is in flight and is its last one: nothing more is scheduled.
    step2 = scheduler.schedule()
    assert scheduled(step2) == {}
    assert new_tokens(scheduler.update_from_output(step1, sample(step1, a=6))) == [
        ("a", [6], finish)
    ]
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


def test_min_tokens_and_stop_ids_are_exact_with_placeholders() -> None:
    """EOS before min_tokens is kept; a stop id ends the request with one token dropped."""
    scheduler = make_scheduler(block_size=4, async_scheduling=True)
    scheduler.add_request(
        make_request("a", [1, 2], eos_token_id=0, min_tokens=2, stop_token_ids=[8])
    )
    script = iter([0, 0, 8, 4])
    in_flight: deque[StepPlan] = deque([scheduler.schedule()])
    got: list[tuple[str, list[int], str | None]] = []
    while in_flight:
        plan = scheduler.schedule()
        if plan.num_scheduled_tokens:
            in_flight.append(plan)
        done = in_flight.popleft()
        got += new_tokens(scheduler.update_from_output(done, sample(done, a=next(script))))
    assert got == [("a", [0], None), ("a", [0], None), ("a", [8], "stop")]
    assert list(script) == []  # 4 was sampled in the speculative step, never delivered


def test_abort_with_steps_in_flight_defers_the_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5]))
    step0 = scheduler.schedule()
    scheduler.update_from_output(step0, sample(step0, a=7))
    step1 = scheduler.schedule()
    step2 = scheduler.schedule()
    assert (scheduled(step1), scheduled(step2)) == ({"a": 1}, {"a": 1})
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    # a's blocks 0 and 1 stay taken until step 2, its last step in flight, completes.
    assert scheduler.num_free_blocks == 2
    assert scheduler.update_from_output(step1, sample(step1, a=8)) == []
    assert scheduler.num_free_blocks == 2
    assert scheduler.update_from_output(step2, sample(step2, a=9)) == []
    assert free_block_ids(scheduler) == [2, 3, 1, 0]
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_preemption_with_a_step_in_flight() -> None:
    """The victim keeps the token its in-flight step samples, its blocks stay taken until
    that step completes, and the request that needed them waits a step instead of
    preempting itself."""
    scheduler = make_scheduler(
        num_blocks=3, block_size=4, max_model_len=12, async_scheduling=True
    )
    executor = executor_for(scheduler)
    a = make_request("a", [1] * 4, max_tokens=6, arrival_time=0.0, ignore_eos=True)
    b = make_request("b", [2] * 5, max_tokens=6, arrival_time=1.0, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step0 = scheduler.schedule()
    result0 = executor.execute(step0)
    assert scheduled(step0) == {"a": 4, "b": 5}
    assert [r.block_ids for r in step0.new_reqs] == [[0], [1, 2]]
    # a's placeholder needs a 2nd block: b is preempted, but step 0 still writes b's.
    step1 = scheduler.schedule()
    assert scheduled(step1) == {} and step1.finished_req_ids == ["b"]
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
    assert free_block_ids(scheduler) == []
    outputs: dict[str, Finished] = {}
    collect(scheduler.update_from_output(step0, result0), outputs)
    b_token = next(s.token_ids for s in result0.sampled if s.req_id == "b")
    assert b.output_token_ids == b_token and outputs["b"].token_ids == b_token
    assert free_block_ids(scheduler) == [2, 1]

    in_flight: deque[tuple[StepPlan, StepResult]] = deque()
    resumed_tokens = []
    while in_flight or scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        for new in plan.new_reqs:  # b again, with exactly the tokens delivered so far
            resumed_tokens.append(new.token_ids)
            assert new.token_ids == [2] * 5 + outputs["b"].token_ids
        if plan.num_scheduled_tokens:
            in_flight.append((plan, executor.execute(plan)))
        if len(in_flight) == 2 or not plan.num_scheduled_tokens:
            collect(scheduler.update_from_output(*in_flight.popleft()), outputs)
    assert len(resumed_tokens) == 1
    executor.execute(scheduler.schedule())
    assert executor.requests == {} and scheduler.num_free_blocks == 3

    reference = make_scheduler(num_blocks=100, block_size=4, max_model_len=12)
    expected = run_to_completion(
        reference,
        executor_for(reference),
        {
            0: [
                make_request(r.request_id, r.prompt_token_ids, max_tokens=6, ignore_eos=True)
                for r in (a, b)
            ]
        },
    )
    assert outputs == expected


def test_results_must_be_applied_once_in_plan_order() -> None:
    scheduler = make_scheduler(block_size=4, async_scheduling=True)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    step0, step1 = scheduler.schedule(), scheduler.schedule()
    with pytest.raises(ValueError, match="oldest step in flight is 0"):
        scheduler.update_from_output(step1, sample(step1, a=5))
    scheduler.update_from_output(step0, sample(step0, a=5))
    with pytest.raises(ValueError, match="apply each step's result once"):
        scheduler.update_from_output(step0, sample(step0, a=5))
    assert scheduler.num_steps_in_flight == 1

