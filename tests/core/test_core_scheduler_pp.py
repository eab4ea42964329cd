"""Scheduler under pipeline parallelism: the running requests split into one
micro-batch per stage, no request in two steps in flight, and plans that carry the
output tokens each step computes (`CachedRequestData.new_token_ids`), from which a
stage that never samples rebuilds exactly the tokens the last stage sampled."""

from __future__ import annotations

from core_sim_executor import (
    SimExecutor,
    executor_for,
    make_request,
    make_scheduler,
    run_to_completion,
)

from flowengine.messages import StepPlan, StepResult


def prompt(start: int, length: int) -> list[int]:
    return [(start * 7919 + i) % 50_000 for i in range(length)]


def pipelined(scheduler, num_stages: int = 2):
    scheduler.num_micro_batches = num_stages
    scheduler.include_new_token_ids = True
    return scheduler


class EarlierStage(SimExecutor):
    """A stage before the last: computes the same KV from the same plans, but never
    keeps a token it samples; the plans' new_token_ids are its only source of them."""

    num_prompt: dict[str, int]

    def execute(self, plan: StepPlan) -> StepResult:
        if not hasattr(self, "num_prompt"):
            self.num_prompt = {}
        for new in plan.new_reqs:
            self.num_prompt[new.req_id] = new.num_prompt_tokens
        num_new = len(plan.new_reqs)
        for cached, num in zip(plan.cached_reqs, plan.num_scheduled_tokens[num_new:],
                               strict=True):
            state = self.requests[cached.req_id]
            start = max(cached.num_computed_tokens, self.num_prompt[cached.req_id])
            end = cached.num_computed_tokens + num
            # Exactly the output positions the step computes, none of a prompt chunk.
            assert len(cached.new_token_ids) == max(end - start, 0), (cached, num)
            if cached.new_token_ids:  # ModelRunner.update_states' rule
                assert len(state.token_ids) >= start
                state.token_ids[start:end] = cached.new_token_ids
        result = super().execute(plan)
        for sampled in result.sampled:
            self.requests[sampled.req_id].token_ids.pop()
        return result


class Pipeline:
    """Two stages over the same plans; the last one's result goes to the scheduler."""

    def __init__(self, first: EarlierStage, last: SimExecutor) -> None:
        self.first, self.last = first, last

    @property
    def written_block_ids(self) -> set[int]:
        return self.last.written_block_ids

    @property
    def requests(self):
        assert self.first.requests.keys() == self.last.requests.keys()
        return self.last.requests

    def execute(self, plan: StepPlan) -> StepResult:
        early, result = self.first.execute(plan), self.last.execute(plan)
        assert early == result  # the same KV, so the same token, on both stages
        return result


def _scheduled(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True))


def test_decodes_split_into_one_micro_batch_per_stage() -> None:
    scheduler = pipelined(make_scheduler())
    executor = executor_for(scheduler)
    for name in "abcd":
        scheduler.add_request(make_request(name, prompt(ord(name), 5), max_tokens=4))
    first = scheduler.schedule()  # admissions are not capped: all four prefill
    assert _scheduled(first) == {"a": 5, "b": 5, "c": 5, "d": 5}
    assert not scheduler.schedule().num_scheduled_tokens  # all four are in flight
    scheduler.update_from_output(first, executor.execute(first))
    second, third = scheduler.schedule(), scheduler.schedule()
    assert _scheduled(second) == {"a": 1, "b": 1} and _scheduled(third) == {"c": 1, "d": 1}
    # Each carries the one token its request computes: the one step 1 sampled.
    assert [c.new_token_ids for c in second.cached_reqs] == [
        [scheduler.get_request(r).output_token_ids[0]] for r in "ab"]
    assert [c.num_computed_tokens for c in third.cached_reqs] == [5, 5]
    assert not scheduler.schedule().num_scheduled_tokens  # a..d all in a step in flight
    scheduler.update_from_output(second, executor.execute(second))
    fourth = scheduler.schedule()
    assert _scheduled(fourth) == {"a": 1, "b": 1}
    assert [c.new_token_ids for c in fourth.cached_reqs] == [
        scheduler.get_request(r).output_token_ids[1:2] for r in "ab"]


def test_prompt_chunks_carry_no_tokens_and_outputs_equal_one_stage() -> None:
    # Chunked prefill (budget 48), prefix sharing, preemption (few blocks): a stage
    # that never samples computes the same tokens as the last (Pipeline asserts it),
    # and the outputs equal the unpipelined engine's.
    shared = prompt(9, 40)
    arrivals = {0: [make_request(f"r{i}", shared + prompt(i, 3 + 11 * i), max_tokens=6 + i)
                    for i in range(6)],
                3: [make_request("late", prompt(99, 70), max_tokens=9)]}

    def copy(requests):
        return {s: [make_request(r.request_id, list(r.prompt_token_ids),
                                 max_tokens=r.max_tokens) for r in rs]
                for s, rs in requests.items()}

    reference = make_scheduler(num_blocks=24, max_num_batched_tokens=48)
    expected = run_to_completion(reference, executor_for(reference), copy(arrivals))
    scheduler = pipelined(make_scheduler(num_blocks=24, max_num_batched_tokens=48))
    first = EarlierStage(24, 16, 50)
    outputs = run_to_completion(scheduler, Pipeline(first, executor_for(scheduler)),
                                copy(arrivals), max_in_flight=2)
    assert {k: v.token_ids for k, v in outputs.items()} == {
        k: v.token_ids for k, v in expected.items()}
    assert all(len(v.token_ids) == arrivals_len for v, arrivals_len in zip(
        (outputs[f"r{i}"] for i in range(6)), (6 + i for i in range(6)), strict=True))
    # The run exercised what it claims to: preemptions and prefix-cache hits.
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0


def test_new_token_ids_of_a_resumed_request_recomputed_in_chunks() -> None:
    from flowengine.core.step_draft import NO_NEW_BLOCKS, StepDraft

    # A preempted request recomputes its 40 prompt + 30 output tokens in chunks: a
    # chunk inside the prompt carries no token, one across its end the outputs it
    # reaches, one past it only its own.
    request = make_request("r", prompt(3, 40), max_tokens=64)
    request.append_output_token_ids(list(range(100, 130)))
    expected = {(16, 8): [], (32, 20): list(range(100, 112)), (52, 18): list(range(112, 130))}
    for (num_computed, num_tokens), ids in expected.items():
        request.num_computed_tokens = num_computed
        draft = StepDraft(token_budget=64)
        draft.add_cached(request, num_tokens, NO_NEW_BLOCKS, request.num_tokens)
        plan, _ = draft.commit(1, [], lambda rid: [], with_new_token_ids=True)
        assert plan.cached_reqs[0].new_token_ids == ids, (num_computed, num_tokens)
        assert plan.cached_reqs[0].num_computed_tokens == num_computed
