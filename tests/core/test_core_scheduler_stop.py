"""Scheduler results: stop conditions on token ids, error results, aborts."""

from __future__ import annotations

import pytest
from core_sim_executor import make_request, make_scheduler

from flowengine.core.scheduler import Scheduler
from flowengine.messages import RequestDelta, SampledTokens, StepResult, TokenLogprobs
from flowengine.request import Request, RequestStatus


def run_scripted(
    scheduler: Scheduler, request: Request, script: list[int]
) -> tuple[list[int], RequestDelta]:
    """Run one request; the 'model' returns the script's tokens in order."""
    scheduler.add_request(request)
    tokens: list[int] = []
    script_iter = iter(script)
    while True:
        plan = scheduler.schedule()
        done = request.num_computed_tokens >= request.num_tokens
        sampled = [SampledTokens(request.request_id, [next(script_iter)])] if done else []
        deltas = scheduler.update_from_output(plan, StepResult(plan.step_id, sampled))
        for delta in deltas:
            tokens += delta.new_token_ids
            if delta.finish_reason is not None:
                assert scheduler.num_free_blocks == scheduler.num_total_blocks
                return tokens, delta


@pytest.mark.parametrize(
    ("params", "script", "tokens", "finish", "stop_reason"),
    [
        (dict(eos_token_id=0), [5, 6, 0, 7], [5, 6, 0], "stop", None),
        (dict(eos_token_id=0, ignore_eos=True, max_tokens=5), [0] * 5, [0] * 5, "length", None),
        # EOS and stop ids count only once more than min_tokens tokens exist.
        (dict(eos_token_id=0, min_tokens=2), [0, 0, 0, 9], [0, 0, 0], "stop", None),
        (dict(stop_token_ids=[9, 8]), [5, 8, 9], [5, 8], "stop", 8),
        (dict(stop_token_ids=[9], min_tokens=1), [9, 9], [9, 9], "stop", 9),
        (dict(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], "length", None),
        # EOS as the last allowed token reports the more informative "stop".
        (dict(eos_token_id=0, max_tokens=2), [5, 0], [5, 0], "stop", None),
    ],
)
def test_stop_conditions(
    params: dict, script: list[int], tokens: list[int], finish: str, stop_reason: int | None
) -> None:
    scheduler = make_scheduler(block_size=4)
    request = make_request("r", [1, 2, 3], **{"max_tokens": 16, **params})
    got, last = run_scripted(scheduler, request, script)
    assert (got, last.finish_reason, last.stop_reason) == (tokens, finish, stop_reason)
    expected_status = (
        RequestStatus.FINISHED_STOPPED if finish == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert request.status == expected_status
    assert scheduler.get_request("r") is None and not scheduler.has_unfinished_requests()


def test_max_model_len_and_kv_capacity_cap_the_length() -> None:
    scheduler = make_scheduler(block_size=4, max_model_len=6)
    got, last = run_scripted(scheduler, make_request("r", [1, 2, 3], max_tokens=16), [5] * 16)
    assert (got, last.finish_reason) == ([5, 5, 5], "length")
    # 2 blocks of 4: the KV cache holds 8 tokens, less than max_model_len.
    scheduler = make_scheduler(block_size=4, num_blocks=2, max_model_len=100)
    got, last = run_scripted(scheduler, make_request("r", [1, 2, 3], max_tokens=16), [5] * 16)
    assert (got, last.finish_reason) == ([5] * 5, "length")


def test_extra_tokens_after_a_stop_are_dropped_with_their_logprobs() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("r", [1, 2, 3], eos_token_id=0))
    plan = scheduler.schedule()
    logprobs = [TokenLogprobs([t], [-0.5], -0.5, 1) for t in (5, 0, 7)]
    result = StepResult(plan.step_id, [SampledTokens("r", [5, 0, 7], logprobs)])
    (delta,) = scheduler.update_from_output(plan, result)
    assert delta.new_token_ids == [5, 0] and delta.new_logprobs == logprobs[:2]
    assert delta.finish_reason == "stop"


def test_error_result_finishes_every_request_of_the_plan() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i + 1] * 5, arrival_time=i))
    plan = scheduler.schedule()
    assert plan.scheduled_req_ids == ["r0", "r1"]
    deltas = scheduler.update_from_output(plan, StepResult(plan.step_id, [], error="boom"))
    assert [(d.req_id, d.finish_reason, d.error, d.new_token_ids) for d in deltas] == [
        ("r0", "error", "boom", []),
        ("r1", "error", "boom", []),
    ]
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 1)
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["r0", "r1"] and plan.scheduled_req_ids == ["r2"]


def test_missing_token_is_an_error_and_prefill_tokens_are_ignored() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", [1] * 6))
    plan = scheduler.schedule()
    # A token sampled for a partial prefill chunk is discarded (vLLM samples them too).
    result = StepResult(plan.step_id, [SampledTokens("r", [9])])
    assert scheduler.update_from_output(plan, result) == []
    assert scheduler.get_request("r").output_token_ids == []
    plan = scheduler.schedule()
    (delta,) = scheduler.update_from_output(plan, StepResult(plan.step_id, []))
    assert delta.finish_reason == "error"
    assert delta.error == "the executor returned no token for request r"
    with pytest.raises(ValueError, match="result of step 7 applied to plan"):
        scheduler.update_from_output(plan, StepResult(7, []))


def test_abort_frees_blocks_and_is_idempotent() -> None:
    scheduler = make_scheduler(block_size=4, max_num_seqs=1)
    scheduler.add_request(make_request("run", [1] * 9, arrival_time=0.0))
    scheduler.add_request(make_request("wait", [2] * 9, arrival_time=1.0))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, StepResult(plan.step_id, [SampledTokens("run", [5])]))
    assert scheduler.num_free_blocks == scheduler.num_total_blocks - 3
    scheduler.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("run", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert not scheduler.has_unfinished_requests()
    # Only the request the executors hold is announced; an empty plan repeats it later.
    assert scheduler.schedule().finished_req_ids == ["run"]
    assert scheduler.schedule().finished_req_ids == ["run"]
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests(["x"], RequestStatus.RUNNING)


def test_abort_after_plan_skips_the_result() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("r", [1] * 5))
    plan = scheduler.schedule()
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    result = StepResult(plan.step_id, [SampledTokens("r", [3])])
    assert scheduler.update_from_output(plan, result) == []
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
