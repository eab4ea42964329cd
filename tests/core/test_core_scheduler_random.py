"""Many random requests under random budgets and small KV caches, driven to completion.

Every run must end with all blocks free and give exactly the outputs of a run with
no preemption, no prefix caching and an unlimited budget (the SimExecutor's tokens
depend only on each request's token history, read back through its block table).
Each run is repeated with two plans in flight (the overlapped engine loop), without
and with async scheduling (DESIGN.md §5), and with some requests aborted mid-way: an
aborted request must have received a strict prefix of its reference tokens.
"""

from __future__ import annotations

import random

import pytest
from core_sim_executor import (
    Finished,
    SimStats,
    executor_for,
    make_request,
    make_scheduler,
    run_to_completion,
)

from flowengine.request import Request

VOCAB = 50
BLOCK_SIZE = 4
MAX_MODEL_LEN = 48


def random_arrivals(rng: random.Random, num_parents: int) -> dict[int, list[Request]]:
    """Prompts built from a few shared prefixes; some parents have n = 2 or 3 siblings."""
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    arrivals: dict[int, list[Request]] = {}
    for p in range(num_parents):
        tokens = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 20)
        params = dict(
            max_tokens=max_tokens,
            eos_token_id=rng.randrange(VOCAB),
            ignore_eos=rng.random() < 0.3,
            min_tokens=rng.randint(0, min(3, max_tokens)),
            stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else None,
            cache_salt="tenant" if rng.random() < 0.2 else None,
            priority=rng.randint(0, 3),
        )
        step = rng.randint(0, 15)
        for i in range(rng.choice([1, 1, 2, 3])):
            request = make_request(f"p{p}-{i}", tokens, arrival_time=float(step), **params)
            arrivals.setdefault(step, []).append(request)
    return arrivals


def clone(arrivals: dict[int, list[Request]]) -> dict[int, list[Request]]:
    return {
        step: [
            make_request(
                r.request_id,
                r.prompt_token_ids,
                max_tokens=r.max_tokens,
                eos_token_id=r.eos_token_id,
                arrival_time=r.arrival_time,
                priority=r.priority,
                cache_salt=r.cache_salt,
                ignore_eos=r.sampling_params.ignore_eos,
                min_tokens=r.sampling_params.min_tokens,
                stop_token_ids=r.sampling_params.stop_token_ids,
            )
            for r in reqs
        ]
        for step, reqs in arrivals.items()
    }


def reference(arrivals: dict[int, list[Request]], max_model_len: int) -> dict[str, Finished]:
    scheduler = make_scheduler(
        num_blocks=4096,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=1 << 20,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    outputs = run_to_completion(scheduler, executor_for(scheduler, VOCAB), clone(arrivals))
    assert scheduler.num_preemptions == 0
    return {k: Finished(v.token_ids, v.finish_reason, v.stop_reason) for k, v in outputs.items()}


def random_aborts(
    rng: random.Random, arrivals: dict[int, list[Request]]
) -> dict[int, list[str]]:
    """About one request in six is aborted 0..12 steps after it arrives."""
    aborts: dict[int, list[str]] = {}
    for step, requests in arrivals.items():
        for request in requests:
            if rng.random() < 1 / 6:
                aborts.setdefault(step + rng.randint(0, 12), []).append(request.request_id)
    return aborts


def check_against_reference(
    outputs: dict[str, Finished], expected: dict[str, Finished], aborted: set[str]
) -> None:
    assert outputs.keys() == expected.keys()
    for req_id, out in outputs.items():
        ref = expected[req_id]
        if out.finish_reason == "abort":
            assert req_id in aborted
            assert out.token_ids == ref.token_ids[: len(out.token_ids)], req_id
            assert len(out.token_ids) < len(ref.token_ids), req_id
        else:
            assert (out.token_ids, out.finish_reason, out.stop_reason) == (
                ref.token_ids,
                ref.finish_reason,
                ref.stop_reason,
            ), req_id


MODES = [(1, False), (2, False), (2, True), (3, True)]  # (plans in flight, async)


@pytest.mark.parametrize(("max_in_flight", "async_scheduling"), MODES)
@pytest.mark.parametrize("seed", range(12))
def test_random_runs_match_the_reference(
    seed: int, max_in_flight: int, async_scheduling: bool
) -> None:
    rng = random.Random(seed)
    chunked = seed % 4 != 3
    num_blocks = rng.randint(9, 20)  # 36..80 tokens: the longest prompt always fits
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40) if chunked else rng.randint(48, 64),
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=seed % 3 != 2,
        policy="priority" if seed % 2 else "fcfs",
        async_scheduling=async_scheduling,
    )
    arrivals = random_arrivals(rng, num_parents=25)
    aborts = random_aborts(rng, arrivals) if seed % 2 else {}
    expected = reference(arrivals, scheduler.max_len)
    stats = SimStats()
    outputs = run_to_completion(
        scheduler,
        executor_for(scheduler, VOCAB),
        clone(arrivals),
        max_in_flight=max_in_flight,
        aborts=aborts,
        stats=stats,
    )
    aborted = {req_id for ids in aborts.values() for req_id in ids}
    check_against_reference(outputs, expected, aborted)
    reasons = [o.finish_reason for o in outputs.values()]
    assert ("abort" in reasons) == bool(aborts)
    assert set(reasons) <= {"stop", "length", "abort"}
    # Decodes overlap exactly when async scheduling plans on placeholders.
    assert (stats.num_decode_overlaps > 0) == (async_scheduling and max_in_flight >= 2)
    if scheduler.kv_cache_manager.enable_caching:
        assert scheduler.prefix_cache_hits > 0
        siblings = [o.num_cached_tokens for k, o in outputs.items() if not k.endswith("-0")]
        assert any(n > 0 for n in siblings)


@pytest.mark.parametrize(("max_in_flight", "async_scheduling"), MODES)
def test_small_caches_do_preempt(max_in_flight: int, async_scheduling: bool) -> None:
    """The random setup above exercises preemption, with plans in flight too."""
    total = total_in_flight = 0
    for seed in range(4):
        rng = random.Random(100 + seed)
        scheduler = make_scheduler(
            num_blocks=12,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=32,
            max_model_len=48,
            async_scheduling=async_scheduling,
        )
        arrivals = random_arrivals(rng, num_parents=25)
        expected = reference(arrivals, scheduler.max_len)
        stats = SimStats()
        outputs = run_to_completion(
            scheduler,
            executor_for(scheduler, VOCAB),
            clone(arrivals),
            max_in_flight=max_in_flight,
            stats=stats,
        )
        check_against_reference(outputs, expected, set())
        total += scheduler.num_preemptions
        total_in_flight += stats.num_preempted_in_flight
    assert total > 0
    assert (total_in_flight > 0) == (max_in_flight >= 2)
