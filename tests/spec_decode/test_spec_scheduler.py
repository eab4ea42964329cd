"""The scheduler with draft tokens: exact plans, budget, KV slots, rollback, stats; and
random runs (preemption, prefix caching, aborts, async scheduling) whose outputs equal
the non-speculative reference exactly (tests/core's SimExecutor semantics)."""

from __future__ import annotations

import random

import pytest
from core_sim_executor import (
    Finished,
    collect,
    make_request,
    make_scheduler,
    run_to_completion,
)
from spec_sim import OracleProposer, SpecSimExecutor, next_token
from test_core_scheduler_random import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    VOCAB,
    check_against_reference,
    clone,
    random_aborts,
    random_arrivals,
    reference,
)

from flowengine.core.scheduler import Scheduler
from flowengine.messages import SampledTokens, StepResult


class FixedProposer:
    """Always proposes `drafts` (cut to the cap); records the calls."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.num_speculative_tokens = len(drafts)
        self.calls: list[tuple[list[int], int | None]] = []

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        self.calls.append((list(token_ids), max_num_tokens))
        return self.drafts[:max_num_tokens]


def spec_scheduler(proposer, **kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    from flowengine.core.spec_tokens import SpecDecodeState

    scheduler.spec = SpecDecodeState(proposer, scheduler.max_len)
    return scheduler


def test_drafts_are_planned_budgeted_allocated_and_rolled_back() -> None:
    proposer = FixedProposer([7, 8, 9])
    s = spec_scheduler(proposer, num_blocks=8, block_size=4)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    plan0 = s.schedule()  # prefill: no drafts
    assert plan0.num_scheduled_tokens == [3] and plan0.new_reqs[0].block_ids == [0]
    assert proposer.calls == []
    s.update_from_output(plan0, StepResult(plan0.step_id, [SampledTokens("a", [5])]))
    # Decode: token 5 at position 3 plus drafts 7, 8, 9 at 4..6: one new block (1).
    plan1 = s.schedule()
    assert proposer.calls == [([1, 2, 3, 5], 8)]  # cap: max_tokens 10 - 1 output - 1 (bonus)
    (cached,) = plan1.cached_reqs
    assert (cached.draft_token_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        [7, 8, 9], [1], 3)
    assert plan1.num_scheduled_tokens == [4]
    request = s.get_request("a")
    assert request.num_computed_tokens == 7
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1]
    # The executor accepted 7, rejected 8: tokens 7 and 6 (the bonus) come back.
    deltas = s.update_from_output(plan1, StepResult(plan1.step_id, [SampledTokens("a", [7, 6])]))
    assert deltas[0].new_token_ids == [7, 6]
    assert request.output_token_ids == [5, 7, 6]
    assert request.num_computed_tokens == 5  # 3 + 1 + 1 accepted; 8, 9 rolled back
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1]  # position 4 lives in block 1
    stats = s.make_stats()
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total,
            stats.spec_decode_num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])
    # Next: token 6 at position 5 plus 3 drafts (6..8): block 1 suffices up to 7.
    plan2 = s.schedule()
    assert plan2.cached_reqs[0].num_computed_tokens == 5
    assert plan2.cached_reqs[0].new_block_ids == [2]
    assert plan2.num_scheduled_tokens == [4]
    # All rejected: only the bonus token; the block of positions 8.. is freed again.
    free_before = s.num_free_blocks
    s.update_from_output(plan2, StepResult(plan2.step_id, [SampledTokens("a", [4])]))
    assert request.num_computed_tokens == 6
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1]
    assert s.num_free_blocks == free_before + 1
    assert s.make_stats().spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]
    assert s.make_stats().spec_decode_num_draft_tokens_total == 6


def test_drafts_fit_the_budget_max_tokens_and_max_len() -> None:
    proposer = FixedProposer([7, 8, 9, 10])
    s = spec_scheduler(proposer, num_blocks=64, block_size=4, max_num_batched_tokens=3,
                       max_model_len=9)
    s.add_request(make_request("a", [1, 2], max_tokens=5))
    p = s.schedule()
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("a", [5])]))
    p = s.schedule()  # budget 3: the token and 2 drafts
    assert p.cached_reqs[0].draft_token_ids == [7, 8] and p.num_scheduled_tokens == [3]
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("a", [7, 8, 1])]))
    # 4 outputs of max_tokens 5: the next token is the last one, no drafts at all.
    p = s.schedule()
    assert p.cached_reqs[0].draft_token_ids == [] and p.num_scheduled_tokens == [1]
    assert proposer.calls[-1][1] == 2  # the call before; none made for the last token
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("a", [3])]))
    assert s.get_request("a") is None  # 5 tokens: finished by length
    # max_len 9: a 6-token prompt with 1 output may draft 9 - 7 = 2 tokens.
    s = spec_scheduler(proposer, num_blocks=64, block_size=4, max_model_len=9)
    s.add_request(make_request("b", [1, 2, 3, 4, 5, 6], max_tokens=20))
    p = s.schedule()
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("b", [5])]))
    p = s.schedule()
    assert proposer.calls[-1] == ([1, 2, 3, 4, 5, 6, 5], 2)
    assert p.cached_reqs[0].draft_token_ids == [7, 8] and p.num_scheduled_tokens == [3]
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("b", [7, 8, 2])]))
    assert s.get_request("b") is None  # 9 tokens = max_len


def test_no_preemption_for_drafts() -> None:
    """Short of blocks, a request runs without its drafts rather than preempting."""
    proposer = FixedProposer([7, 8, 9, 10])
    s = spec_scheduler(proposer, num_blocks=2, block_size=4, max_model_len=8)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    s.add_request(make_request("b", [1, 2, 4], max_tokens=4))
    p = s.schedule()
    s.update_from_output(p, StepResult(p.step_id, [SampledTokens("a", [5]),
                                                   SampledTokens("b", [6])]))
    p = s.schedule()  # a's 4 tokens would need a third block
    assert [c.draft_token_ids for c in p.cached_reqs] == [[], []]
    assert p.num_scheduled_tokens == [1, 1] and s.num_preemptions == 0


def test_constrained_requests_get_no_drafts() -> None:
    proposer = FixedProposer([7, 8])
    s = spec_scheduler(proposer)
    request = make_request("a", [1, 2, 3], max_tokens=10)
    assert s.spec is not None
    request.sampling_params.structured_outputs = object()  # type: ignore[assignment]
    assert s.spec.drafts_for(request, 10) == []
    assert proposer.calls == []


def _spec_run(seed: int, max_in_flight: int, async_scheduling: bool, *, chunked: bool,
              caching: bool, num_blocks: int, aborts: bool):
    rng = random.Random(seed)
    proposer = OracleProposer(k=rng.randint(1, 5), vocab_size=VOCAB, seed=seed)
    scheduler = spec_scheduler(
        proposer,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(6, 40) if chunked else rng.randint(48, 64),
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        policy="priority" if seed % 2 else "fcfs",
        async_scheduling=async_scheduling,
    )
    arrivals = random_arrivals(rng, num_parents=25)
    abort_steps = random_aborts(rng, arrivals) if aborts else {}
    expected = reference(arrivals, scheduler.max_len)
    executor = SpecSimExecutor(num_blocks, BLOCK_SIZE, VOCAB)
    outputs = run_to_completion(scheduler, executor, clone(arrivals),
                                max_in_flight=max_in_flight, aborts=abort_steps)
    aborted = {r for ids in abort_steps.values() for r in ids}
    check_against_reference(outputs, expected, aborted)
    return scheduler, executor


MODES = [(1, False), (2, False), (2, True)]  # (plans in flight, async scheduling)


@pytest.mark.parametrize(("max_in_flight", "async_scheduling"), MODES)
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_with_drafts_match_the_reference(seed: int, max_in_flight: int,
                                                     async_scheduling: bool) -> None:
    scheduler, executor = _spec_run(seed, max_in_flight, async_scheduling,
                                    chunked=seed % 4 != 3, caching=seed % 3 != 2,
                                    num_blocks=random.Random(seed).randint(12, 20),
                                    aborts=bool(seed % 2))
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_drafts_total == len(executor.num_accepted) > 0
    assert stats.spec_decode_num_accepted_tokens_total == sum(executor.num_accepted) > 0
    assert stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens_total
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))


@pytest.mark.parametrize(("max_in_flight", "async_scheduling"), MODES)
def test_small_caches_preempt_with_drafts(max_in_flight: int, async_scheduling: bool) -> None:
    total = 0
    for seed in range(3):
        scheduler, _ = _spec_run(100 + seed, max_in_flight, async_scheduling, chunked=True,
                                 caching=True, num_blocks=12, aborts=False)
        total += scheduler.num_preemptions
    assert total > 0


def test_rejected_drafts_never_reach_the_prefix_cache() -> None:
    """A second request whose prompt is the first one's prompt + output hits its blocks
    (every block published while drafts were rolled back in them) and continues with
    exactly the reference tokens."""
    proposer = OracleProposer(k=4, vocab_size=VOCAB, error_rate=0.5, seed=3)
    s = spec_scheduler(proposer, num_blocks=32, block_size=BLOCK_SIZE, max_model_len=64)
    executor = SpecSimExecutor(32, BLOCK_SIZE, VOCAB)
    prompt = [3, 1, 4, 1, 5]
    out = run_to_completion(s, executor, {0: [make_request("a", prompt, max_tokens=20,
                                                           ignore_eos=True)]})
    history = prompt + out["a"].token_ids
    expected = []
    for _ in range(6):
        expected.append(next_token(history + expected, VOCAB))
    assert out["a"].token_ids == [next_token(history[:i], VOCAB)
                                  for i in range(5, 25)]
    assert sum(executor.num_accepted) < 4 * len(executor.num_accepted)  # some rejected
    out2 = run_to_completion(s, executor, {0: [make_request("b", history, max_tokens=6,
                                                            ignore_eos=True)]})
    # Blocks of verified tokens are published once the step after them returns, so all
    # but the tokens verified in a's last step (at most 4 + 1 of 25) are hits.
    assert out2["b"].num_cached_tokens in (16, 20, 24)
    assert out2["b"].token_ids == expected


def test_abort_with_drafts_in_flight() -> None:
    proposer = FixedProposer([7, 8, 9])
    s = spec_scheduler(proposer, num_blocks=8, block_size=4, async_scheduling=True)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    p0 = s.schedule()
    s.update_from_output(p0, StepResult(p0.step_id, [SampledTokens("a", [5])]))
    p1 = s.schedule()
    assert p1.cached_reqs[0].draft_token_ids == [7, 8, 9]
    p2 = s.schedule()  # async: never planned on a placeholder while speculating
    assert p2.num_scheduled_tokens == []
    outputs: dict[str, Finished] = {}
    collect(s.abort_requests(["a"]), outputs)
    assert s.num_free_blocks == 6  # deferred until step 1 completes
    collect(s.update_from_output(p1, StepResult(p1.step_id, [SampledTokens("a", [7, 1])])),
            outputs)
    assert outputs["a"].token_ids == [] and outputs["a"].finish_reason == "abort"
    assert s.num_free_blocks == 8
