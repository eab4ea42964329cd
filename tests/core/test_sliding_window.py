"""Sliding-window KV block freeing (flowengine/core/sliding_window.py).

Exact block ids as a request advances past the window; the null block is never freed,
hashed or handed out; prefix caching and preemption stay correct; and a scheduler run
whose simulated attention reads the whole window gives the outputs of a run without
freeing, with each request's blocks bounded by the window.
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import pytest
from core_sim_executor import _ROOT_KV, Finished, SimExecutor, collect, make_request, mix

sys.path.insert(0, str(Path(__file__).parent.parent / "spec_decode"))
from spec_sim import OracleProposer, SpecSimExecutor  # noqa: E402

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.kv_cache_manager import KVCacheManager, cdiv
from flowengine.core.scheduler import Scheduler
from flowengine.core.sliding_window import SlidingWindowBlocks
from flowengine.core.spec_tokens import SpecDecodeState
from flowengine.request import Request
from flowengine.sampling_params import SamplingParams


def req(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), eos_token_id=None, max_tokens=64)


def step(manager: KVCacheManager, request: Request, num_tokens: int) -> list[int]:
    """Allocate and 'compute' `num_tokens` more tokens, then publish and skip as the
    scheduler does after the step; returns the ids of the newly allocated blocks."""
    new = manager.allocate_slots(request, num_tokens)
    assert new is not None
    request.num_computed_tokens += num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    manager.remove_skipped_blocks(request, request.num_computed_tokens)
    return [b.block_id for b in new]


def test_num_skipped_blocks_follows_the_window() -> None:
    pool_manager = KVCacheManager(num_blocks=4, block_size=4)
    swa = SlidingWindowBlocks(pool_manager.block_pool, sliding_window=8, block_size=4)
    # The next token at position n reads positions n-7..n: block i is dead once
    # 4*(i+1) <= n - 7.
    assert [swa.num_skipped_blocks(n) for n in (0, 7, 10, 11, 14, 15, 19, 23)] == [
        0, 0, 0, 1, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        SlidingWindowBlocks(pool_manager.block_pool, 0, 4)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVCacheManager(num_blocks=1, block_size=4, sliding_window=8)


def test_exact_blocks_freed_as_a_request_passes_the_window() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, sliding_window=8)
    null = manager.null_block
    assert null is not None and null.block_id == 0 and null.ref_cnt == 1
    assert manager.num_usable_blocks == 9 and manager.num_free_blocks == 9
    assert manager.usage == 0.0
    a = req("a", list(range(100, 130)))
    # Prefill in chunks of 4: after n computed tokens the blocks before (n - 7) // 4 go.
    assert step(manager, a, 4) == [1]
    assert step(manager, a, 4) == [2]
    assert manager.get_block_ids("a") == [1, 2]
    assert step(manager, a, 4) == [3]  # n = 12: block 1 (positions 0-3) is out
    assert manager.get_block_ids("a") == [0, 2, 3]
    assert manager.block_pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 1]
    assert manager.block_pool.blocks[1].ref_cnt == 0
    assert step(manager, a, 3) == [4]  # n = 15: (15 - 7) // 4 = 2, block 2 out
    assert manager.get_block_ids("a") == [0, 0, 3, 4]
    # Decode one token at a time: block 3 (positions 8-11) goes at n = 19.
    for n in (16, 17, 18):
        step(manager, a, 1)
        assert manager.get_block_ids("a") == [0, 0, 3, 4, 5][: cdiv(n, 4)], n
    step(manager, a, 1)
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5]
    assert manager.block_pool.free_block_queue.block_ids() == [6, 7, 8, 9, 1, 2, 3]
    assert manager.num_free_blocks == 7 and manager.usage == pytest.approx(2 / 9)
    # The null block is never hashed and never freed.
    assert null.block_hash is None and null.ref_cnt == 1
    manager.free(a)
    assert null.ref_cnt == 1 and manager.num_free_blocks == 9
    assert manager.block_pool.free_block_queue.block_ids() == [6, 7, 8, 9, 1, 2, 3, 5, 4]
    assert manager.usage == 0.0
    # Taking every free block never hands out the null block.
    assert 0 not in [b.block_id for b in manager.block_pool.get_new_blocks(9)]


def test_freed_blocks_stay_prefix_hits_while_cached() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=4, sliding_window=8)
    prompt = list(range(200, 220))
    a = req("a", prompt)
    step(manager, a, 20)  # one chunk: blocks 1-5, published, then (20 - 7) // 4 = 3 freed
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5]
    assert all(manager.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3))
    assert manager.block_pool.free_block_queue.block_ids()[-3:] == [3, 2, 1]
    # b shares 16 tokens: the freed blocks 1-3 still hold a's KV, so they are hits
    # (along with 4, still held by a).
    b = req("b", [*prompt[:16], 7, 7, 7])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3, 4] and num_hit == 16
    assert manager.allocate_slots(b, 3, hits) is not None
    # Position 16 reads 9..16 only: hits 1 and 2 go back at once (still cached).
    assert manager.get_block_ids("b") == [0, 0, 3, 4, 6]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 1]
    assert manager.block_pool.get_cached_block(b.block_hashes[0]) is manager.block_pool.blocks[1]
    b.num_computed_tokens = 19
    manager.cache_blocks(b, 19)
    manager.remove_skipped_blocks(b, 19)  # (19 - 7) // 4 = 3: blocks 1, 2, 3 out of b
    assert manager.get_block_ids("b") == [0, 0, 0, 4, 6]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 6)] == [0, 0, 0, 2, 1]
    manager.free(a)
    manager.free(b)
    # Once a freed block is evicted (reused for other tokens), it is no hit any more.
    c = req("c", list(range(900, 940)))
    for _ in range(10):
        step(manager, c, 4)
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is None
    hits, num_hit = manager.get_computed_blocks(req("d", prompt))
    assert hits == [] and num_hit == 0


def test_trim_and_deferred_free_skip_the_null_block() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, sliding_window=4)
    a = req("a", list(range(24)))
    step(manager, a, 16)  # (16 - 3) // 4 = 3 blocks out
    assert manager.get_block_ids("a") == [0, 0, 0, 4]
    # Speculative decoding wrote 6 draft slots; 5 are rejected: trim the tail only.
    assert manager.allocate_slots(a, 6) is not None
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5, 6]
    assert manager.trim(a, 17) == 1
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5]
    manager.free(a, after_step=3)
    assert manager.num_deferred_free_blocks == 2
    manager.release_deferred(3)
    assert manager.num_free_blocks == 9 and manager.null_block.ref_cnt == 1


class WindowCheck:
    """Mixin for a SimExecutor: every step checks that each computed position's window
    still reads back the request's own KV through its block table: a block freed while
    in the window and reused (or never written) fails the check."""

    window: int = 0

    def execute(self, plan):  # noqa: ANN001, ANN201
        result = super().execute(plan)
        for req_id, num_tokens in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens,
                                      strict=True):
            state = self.requests[req_id]
            end = state.num_computed_tokens
            expected, value = [], _ROOT_KV
            for token in state.token_ids[:end]:
                value = mix(value, token)
                expected.append(value)
            for pos in range(max(0, end - num_tokens - self.window + 1), end):
                assert self.kv[self._slot(state, pos)] == expected[pos], (req_id, pos)
        return result


class WindowSim(WindowCheck, SimExecutor):
    pass


class SpecWindowSim(WindowCheck, SpecSimExecutor):
    """Verifies draft tokens (rolling rejected ones back) and checks the window."""


def run(window: int | None, num_blocks: int, requests: list[Request], *,
        async_scheduling: bool = False, prefix_caching: bool = True,
        chunk: int = 24, proposer: OracleProposer | None = None,
        ) -> tuple[dict[str, Finished], Scheduler, int]:
    """Drive a Scheduler to completion (one plan ahead with async scheduling); returns
    the outputs, the scheduler and the most blocks any request held at once (the
    null block not counted)."""
    block_size = 4
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=200),
        CacheConfig(block_size, num_blocks, prefix_caching, sliding_window=window),
        async_scheduling=async_scheduling)
    if proposer is not None:
        scheduler.spec = SpecDecodeState(proposer, scheduler.max_len)
    sim = (WindowSim if proposer is None else SpecWindowSim)(num_blocks, block_size, 50)
    sim.window = window or 10**9
    for request in requests:
        scheduler.add_request(request)
    manager = scheduler.kv_cache_manager
    outputs: dict[str, Finished] = {}
    in_flight: deque = deque()
    most_held = 0
    for _ in range(5000):
        if not (scheduler.has_unfinished_requests() or in_flight):
            break
        while len(in_flight) < (2 if async_scheduling else 1):
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break
            in_flight.append((plan, sim.execute(plan)))
        most_held = max([most_held, *(sum(b is not manager.null_block for b in blocks)
                                      for blocks in manager.req_to_blocks.values())])
        plan, result = in_flight.popleft()
        collect(scheduler.update_from_output(plan, result), outputs)
    else:
        raise AssertionError("no progress")
    sim.execute(scheduler.schedule())
    assert sim.requests == {} and scheduler.num_steps_in_flight == 0
    assert scheduler.num_free_blocks == scheduler.num_total_blocks  # no null block counted
    return outputs, scheduler, most_held


def test_scheduler_block_counts_leave_out_the_null_block() -> None:
    """num_total_blocks and the stats count the blocks requests can hold: with a
    window, the cache's blocks less the null block (block 0, never free)."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(4, 10, True, sliding_window=8))
    manager = scheduler.kv_cache_manager
    assert manager.null_block is not None and manager.null_block.block_id == 0
    stats = scheduler.make_stats()
    assert (scheduler.num_total_blocks, scheduler.num_free_blocks) == (9, 9)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.kv_cache_usage) == (9, 9, 0.0)
    # A 10-token prompt takes blocks 1-3; the used count is total - free, exactly.
    scheduler.add_request(make_request("a", list(range(3, 13)), max_tokens=4))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [10]
    assert manager.get_block_ids("a") == [1, 2, 3]
    stats = scheduler.make_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks) == (9, 6)
    assert stats.kv_cache_usage == pytest.approx(3 / 9)
    assert stats.kv_cache_usage == pytest.approx(
        (stats.num_total_blocks - stats.num_free_blocks) / stats.num_total_blocks)
    # Without a window every block is usable.
    full = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(4, 10, True))
    assert (full.num_total_blocks, full.make_stats().num_total_blocks) == (10, 10)
    assert full.num_free_blocks == 10


def requests(shared_prefix: bool = False, num: int = 4) -> list[Request]:
    """`num` requests of prompts 10 + 6i and 60 + 5i output tokens; with the shared
    20-token prefix, prompts 20 + 10 + 3i and 20 + 2i output tokens."""
    if not shared_prefix:
        return [make_request(f"r{i}", [((i * 7 + j) % 45) + 3 for j in range(10 + 6 * i)],
                             max_tokens=60 + 5 * i) for i in range(num)]
    return [make_request(f"r{i}", [*range(1, 21), *(((i * 7 + j) % 45) + 3
                                                    for j in range(10 + 3 * i))],
                         max_tokens=20 + 2 * i) for i in range(num)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_outputs_equal_full_kv_and_blocks_stay_bounded(async_scheduling: bool) -> None:
    full, _, full_held = run(None, 400, requests())
    assert full_held == cdiv(28 + 75, 4)  # r3 holds its whole sequence
    # 4 requests of up to 103 tokens in 40 blocks (160 slots): only the window fits.
    outputs, sched, held = run(12, 40, requests(), async_scheduling=async_scheduling)
    assert outputs == full
    assert all(o.finish_reason == "length" for o in outputs.values())
    assert sched.num_preemptions == 0
    # A step of up to 24 tokens plus the 11 positions before it, block-aligned, plus one
    # more step of a plan in flight.
    assert held <= cdiv(11 + 24 + (24 if async_scheduling else 0), 4) + 1
    assert held < full_held
    # Without freeing, the same pool has to preempt.
    _, no_window, _ = run(None, 40, requests())
    assert no_window.num_preemptions > 0


def test_preemption_and_prefix_caching_stay_correct_with_a_window() -> None:
    full, _, _ = run(None, 400, requests(True, 8), prefix_caching=False)
    # 22 usable blocks hold the longest sequence (85 tokens) but not 8 windows of up
    # to 5 blocks each: requests get preempted and resume from the prefix cache.
    outputs, sched, held = run(8, 23, requests(True, 8), chunk=16)
    assert held <= cdiv(7 + 16, 4) + 1  # prefix hits out of the window not kept either
    assert {k: (o.token_ids, o.finish_reason) for k, o in outputs.items()} == {
        k: (o.token_ids, o.finish_reason) for k, o in full.items()}
    assert sched.num_preemptions > 0
    assert sched.prefix_cache_hits > 0


def test_draft_rollback_with_a_window() -> None:
    """Speculative decoding: rejected drafts are trimmed from the tail while the head
    is freed out of the window; outputs equal the plain run's."""
    full, _, _ = run(None, 400, requests())
    proposer = OracleProposer(k=4, vocab_size=50, error_rate=0.4, seed=5)
    outputs, sched, held = run(12, 40, requests(), proposer=proposer)
    assert outputs == full
    assert sched.spec is not None and sched.spec.num_draft_tokens > 0
    assert 0 < sched.spec.num_accepted_tokens < sched.spec.num_draft_tokens
    assert held <= cdiv(11 + 24, 4) + 1
