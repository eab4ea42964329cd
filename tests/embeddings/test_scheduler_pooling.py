"""Prefill-only pooled requests in the pure scheduler: one step each, finished by the
pooled result (no token), blocks freed at once, no speculative token under async
scheduling."""

from __future__ import annotations

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.messages import SampledTokens, StepResult
from flowengine.request import Request
from flowengine.sampling_params import SamplingParams


def _scheduler(async_scheduling: bool) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                     max_model_len=32, enable_chunked_prefill=False),
                     CacheConfig(block_size=8, num_blocks=16, enable_prefix_caching=False),
                     async_scheduling=async_scheduling)


def _pooling_request(rid: str, n: int, max_model_len: int = 32) -> Request:
    # What InputProcessor._process_pooling sends: max_tokens 1, the prompt may fill
    # max_model_len.
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1, detokenize=False),
                   eos_token_id=None, max_tokens=min(1, max_model_len - n))


def test_pooled_results_finish_requests_and_free_blocks():
    for async_scheduling in (False, True):
        sched = _scheduler(async_scheduling)
        sched.add_request(_pooling_request("a", 20))
        sched.add_request(_pooling_request("b", 32))  # the whole max_model_len
        plan = sched.schedule()
        assert plan.scheduled_req_ids == ["a", "b"]
        assert plan.num_scheduled_tokens == [20, 32]
        assert sched.num_free_blocks == 16 - 3 - 4
        # With async scheduling the next plan is made before the result: nothing more
        # to compute for either request (no speculative token after a pooled prompt).
        nxt = sched.schedule()
        assert nxt.num_scheduled_tokens == []
        result = StepResult(plan.step_id, [SampledTokens("a", [], pooled=b"\x00" * 8),
                                           SampledTokens("b", [], pooled=b"\x01" * 8)])
        deltas = sched.update_from_output(plan, result)
        assert [(d.req_id, d.finish_reason, d.new_token_ids, d.pooled) for d in deltas] == [
            ("a", "stop", [], b"\x00" * 8), ("b", "stop", [], b"\x01" * 8)]
        assert not sched.has_unfinished_requests()
        assert sched.num_free_blocks == 16
        assert sorted(sched.schedule().finished_req_ids) == ["a", "b"]


def test_a_missing_pooled_vector_fails_the_request():
    sched = _scheduler(False)
    sched.add_request(_pooling_request("a", 5))
    plan = sched.schedule()
    deltas = sched.update_from_output(plan, StepResult(plan.step_id, []))
    assert deltas[0].finish_reason == "error" and "no token" in deltas[0].error
    assert sched.num_free_blocks == 16
