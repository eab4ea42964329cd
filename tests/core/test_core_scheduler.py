"""Scheduler: budget and seats, chunked prefill, policy order, preemption, admission."""

from __future__ import annotations

import subprocess
import sys

import pytest
from core_sim_executor import (
    SimExecutor,
    collect,
    executor_for,
    make_request,
    make_scheduler,
    run_to_completion,
)

from flowengine.core.scheduler import Scheduler
from flowengine.messages import StepPlan
from flowengine.request import RequestStatus


def step(scheduler: Scheduler, executor: SimExecutor) -> StepPlan:
    plan = scheduler.schedule()
    if plan.num_scheduled_tokens:
        scheduler.update_from_output(plan, executor.execute(plan))
    return plan


def scheduled(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True))


def prompt(start: int, length: int) -> list[int]:
    """Distinct prompts for distinct `start`s (no accidental prefix sharing)."""
    return [(start * 7919 + i) % 50_000 for i in range(length)]


def test_chunked_prefill_exact_chunks_then_decode() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    executor = executor_for(scheduler)
    scheduler.add_request(make_request("a", prompt(1, 150), max_tokens=3))
    plans = [step(scheduler, executor)]
    assert scheduler.kv_cache_usage == 4 / 64 and scheduler.num_free_blocks == 60
    plans += [step(scheduler, executor) for _ in range(4)]
    assert [scheduled(p) for p in plans] == [{"a": 64}, {"a": 64}, {"a": 22}, {"a": 1}, {"a": 1}]
    first = plans[0].new_reqs[0]
    assert first.block_ids == [0, 1, 2, 3] and first.num_computed_tokens == 0
    assert first.token_ids == prompt(1, 150) and first.num_prompt_tokens == 150
    assert [p.new_reqs for p in plans[1:]] == [[], [], [], []]
    cached = [p.cached_reqs[0] for p in plans[1:]]
    assert [c.num_computed_tokens for c in cached] == [64, 128, 150, 151]
    assert [c.new_block_ids for c in cached] == [[4, 5, 6, 7], [8, 9], [], []]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


def test_running_first_then_waiting_share_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    executor = executor_for(scheduler)
    scheduler.add_request(make_request("a", prompt(1, 100), arrival_time=1.0))
    scheduler.add_request(make_request("b", prompt(2, 30), arrival_time=2.0))
    assert scheduled(step(scheduler, executor)) == {"a": 64}
    plan = step(scheduler, executor)
    assert scheduled(plan) == {"b": 28, "a": 36}  # new_reqs come first in a plan
    assert [r.req_id for r in plan.new_reqs] == ["b"]
    assert scheduled(step(scheduler, executor)) == {"a": 1, "b": 2}
    assert scheduled(step(scheduler, executor)) == {"a": 1, "b": 1}


def test_seat_limit() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    executor = executor_for(scheduler)
    for i, max_tokens in enumerate([2, 4, 4]):
        scheduler.add_request(
            make_request(f"r{i}", prompt(i, 10), max_tokens=max_tokens, arrival_time=i)
        )
    assert scheduled(step(scheduler, executor)) == {"r0": 10, "r1": 10}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    # r0 finishes after its 2nd token; r2 takes the seat in the next step.
    assert scheduled(step(scheduler, executor)) == {"r0": 1, "r1": 1}
    assert scheduled(step(scheduler, executor)) == {"r2": 10, "r1": 1}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 0)


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    expected = {
        False: [{"a": 40}, {"b": 30, "a": 1}],
        True: [{"a": 40, "b": 24}, {"a": 1, "b": 6}],
    }
    for chunked, steps in expected.items():
        scheduler = make_scheduler(
            max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=chunked
        )
        executor = executor_for(scheduler)
        scheduler.add_request(make_request("a", prompt(1, 40), arrival_time=1.0))
        scheduler.add_request(make_request("b", prompt(2, 30), arrival_time=2.0))
        assert [scheduled(step(scheduler, executor)) for _ in steps] == steps


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["a", "b", "c"]), ("priority", ["c", "b", "a"])]
)
def test_admission_order(policy: str, expected: list[str]) -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    executor = executor_for(scheduler)
    # Added in another order than they arrived; lower priority value runs first.
    scheduler.add_request(make_request("c", prompt(3, 5), arrival_time=3.0, priority=0))
    scheduler.add_request(make_request("a", prompt(1, 5), arrival_time=1.0, priority=2))
    scheduler.add_request(make_request("b", prompt(2, 5), arrival_time=2.0, priority=1))
    order = []
    while scheduler.has_unfinished_requests():
        order += [r.req_id for r in step(scheduler, executor).new_reqs]
    assert order == expected


def test_preemption_by_recompute() -> None:
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens each grow until they collide.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    executor = executor_for(scheduler)
    requests = [
        make_request(name, prompt(i, 8), max_tokens=12, arrival_time=i, ignore_eos=True)
        for i, name in enumerate(["a", "b"])
    ]
    for r in requests:
        scheduler.add_request(r)
    outputs = {}
    plans = []
    while scheduler.num_preemptions == 0:
        plan = scheduler.schedule()
        plans.append(plan)
        if scheduler.num_preemptions:
            break
        collect(scheduler.update_from_output(plan, executor.execute(plan)), outputs)
    # The later arrival (b) was preempted so that a could take its 4th block.
    b = requests[1]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduled(plan) == {"a": 1}
    assert plan.finished_req_ids == ["b"]
    assert scheduler.num_preemptions == 1 and b.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    tokens_b_so_far = b.all_token_ids
    collect(scheduler.update_from_output(plan, executor.execute(plan)), outputs)
    # b comes back in full: prompt + the outputs it had, recomputed.
    resumed = None
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        resumed = resumed or next((r for r in plan.new_reqs if r.req_id == "b"), None)
        collect(scheduler.update_from_output(plan, executor.execute(plan)), outputs)
    assert resumed is not None
    assert resumed.token_ids == tokens_b_so_far and resumed.num_prompt_tokens == 8
    assert scheduler.num_free_blocks == 6

    reference = make_scheduler(num_blocks=100, block_size=4, max_model_len=24)
    expected = run_to_completion(
        reference,
        executor_for(reference),
        {
            0: [
                make_request(r.request_id, r.prompt_token_ids, max_tokens=12, ignore_eos=True)
                for r in requests
            ]
        },
    )
    assert outputs == expected
    assert reference.num_preemptions == 0
    assert [len(outputs[n].token_ids) for n in "ab"] == [12, 12]


def test_priority_preempts_the_highest_priority_value() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, policy="priority")
    executor = executor_for(scheduler)
    # a arrived first but has the worse priority: it is the victim.
    scheduler.add_request(
        make_request("a", prompt(1, 8), max_tokens=12, priority=5, ignore_eos=True)
    )
    scheduler.add_request(
        make_request(
            "b", prompt(2, 8), max_tokens=12, priority=1, arrival_time=1.0, ignore_eos=True
        )
    )
    while scheduler.num_preemptions == 0:
        step(scheduler, executor)
    assert scheduler.get_request("a").status == RequestStatus.PREEMPTED
    assert scheduler.get_request("b").status == RequestStatus.RUNNING


def test_refuses_prompts_that_cannot_fit() -> None:
    scheduler = make_scheduler(num_blocks=400, max_model_len=4096)
    with pytest.raises(ValueError) as info:
        scheduler.add_request(make_request("long", prompt(1, 5000)))
    assert str(info.value) == (
        "prompt has 5000 tokens, but max_model_len is 4096 (prompt + max_tokens must fit); "
        "shorten the prompt or raise max_model_len"
    )
    small_cache = make_scheduler(num_blocks=4, block_size=16, max_model_len=4096)
    with pytest.raises(
        ValueError,
        match=r"prompt has 65 tokens, but the whole KV cache holds 64 \(4 blocks of 16\)",
    ):
        small_cache.add_request(make_request("big", prompt(1, 65)))
    empty = make_request("empty", [1])
    empty.prompt_token_ids = []
    with pytest.raises(ValueError, match="prompt is empty"):
        scheduler.add_request(empty)
    scheduler.add_request(make_request("dup", prompt(1, 5)))
    with pytest.raises(ValueError, match="'dup' is in use"):
        scheduler.add_request(make_request("dup", prompt(2, 5)))
    # Nothing but the one valid request entered.
    assert scheduler.num_waiting == 1 and small_cache.num_waiting == 0
    assert not small_cache.has_unfinished_requests()


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise max_num_batched_tokens to 128 or enable chunked"):
        make_scheduler(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="must be >= 1"):
        make_scheduler(max_num_seqs=0)


def test_siblings_share_the_prompt_blocks() -> None:
    scheduler = make_scheduler(block_size=16)
    executor = executor_for(scheduler)
    for i in range(2):
        scheduler.add_request(make_request(f"p-{i}", prompt(1, 40), max_tokens=2))
    scheduler.add_request(make_request("other", prompt(2, 40), max_tokens=2))
    # p-1 waits for the blocks p-0 is computing; an unrelated prompt does not.
    plan = step(scheduler, executor)
    assert scheduled(plan) == {"p-0": 40, "other": 40}
    plan = scheduler.schedule()
    assert scheduled(plan) == {"p-1": 8, "p-0": 1, "other": 1}
    p0, p1 = plan.new_reqs[0].block_ids, scheduler.kv_cache_manager.get_block_ids("p-0")
    assert plan.new_reqs[0].num_computed_tokens == 32
    assert p0[:2] == p1[:2] == [0, 1] and p0[2] != p1[2]
    assert [scheduler.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    deltas = scheduler.update_from_output(plan, executor.execute(plan))
    assert {d.req_id: d.num_cached_tokens for d in deltas} == {"p-1": 32, "p-0": 0, "other": 0}
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (120, 32)


def test_sibling_waits_for_the_whole_chunked_prefill() -> None:
    scheduler = make_scheduler(block_size=16, max_num_batched_tokens=64)
    executor = executor_for(scheduler)
    for i in range(2):
        scheduler.add_request(make_request(f"p-{i}", prompt(1, 100), max_tokens=2))
    assert scheduled(step(scheduler, executor)) == {"p-0": 64}
    # Blocks 0-3 are published, block 4 is being computed in this step: p-1 waits.
    assert scheduled(step(scheduler, executor)) == {"p-0": 36}
    plan = step(scheduler, executor)
    assert scheduled(plan) == {"p-1": 4, "p-0": 1}
    assert plan.new_reqs[0].num_computed_tokens == 96
    assert scheduler.get_request("p-1").num_cached_tokens == 96


def test_core_imports_no_torch() -> None:
    code = (
        "import sys, flowengine.core.scheduler, flowengine.core.kv_cache_utils; "
        "assert 'torch' not in sys.modules, 'flowengine.core pulled in torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
