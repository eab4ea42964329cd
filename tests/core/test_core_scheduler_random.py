"""Many random requests under random budgets and small KV caches, driven to completion.

Every run must end with all blocks free and give exactly the outputs of a run with
no preemption, no prefix caching and an unlimited budget (the SimExecutor's tokens
depend only on each request's token history, read back through its block table).
Each run is repeated with two plans in flight (the overlapped engine loop).
"""

from __future__ import annotations

import random

import pytest
from core_sim_executor import (
    Finished,
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


@pytest.mark.parametrize("max_in_flight", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_random_runs_match_the_reference(seed: int, max_in_flight: int) -> None:
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
    )
    arrivals = random_arrivals(rng, num_parents=25)
    expected = reference(arrivals, scheduler.max_len)
    outputs = run_to_completion(
        scheduler, executor_for(scheduler, VOCAB), clone(arrivals), max_in_flight=max_in_flight
    )
    got = {k: Finished(v.token_ids, v.finish_reason, v.stop_reason) for k, v in outputs.items()}
    assert got == expected
    assert all(o.finish_reason in ("stop", "length") for o in outputs.values())
    if scheduler.kv_cache_manager.enable_caching:
        assert scheduler.prefix_cache_hits > 0
        siblings = [o.num_cached_tokens for k, o in outputs.items() if not k.endswith("-0")]
        assert any(n > 0 for n in siblings)


def test_small_caches_do_preempt() -> None:
    """The random setup above exercises preemption, not just the happy path."""
    total = 0
    for seed in range(4):
        rng = random.Random(100 + seed)
        scheduler = make_scheduler(
            num_blocks=12, block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=48
        )
        arrivals = random_arrivals(rng, num_parents=25)
        expected = reference(arrivals, scheduler.max_len)
        outputs = run_to_completion(scheduler, executor_for(scheduler, VOCAB), clone(arrivals))
        got = {k: Finished(v.token_ids, v.finish_reason, v.stop_reason) for k, v in outputs.items()}
        assert got == expected
        total += scheduler.num_preemptions
    assert total > 0
