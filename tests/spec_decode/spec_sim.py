"""A speculative-decoding SimExecutor and an oracle proposer with scripted mistakes.

`SpecSimExecutor` is tests/core's SimExecutor plus the executor's side of speculative
decoding: a cached request's draft tokens are appended and computed in the step (their
KV slots are written with values that depend on them), each of the 1 + k rows yields
the token that follows its prefix (read back through the block table), the accepted
drafts plus one token are returned, and the rejected drafts are rolled back by the
engine's rule (num_computed_tokens, block-table entries past
ceil(num_computed_tokens / block_size)). A scheduler that published a block holding a
rejected draft, kept a wrong num_computed_tokens or reused a block still in use
changes the tokens (or trips an assertion).
"""

from __future__ import annotations

import random

from core_sim_executor import _ROOT_KV, SimExecutor, mix

from flowengine.messages import SampledTokens, StepPlan, StepResult


def next_token(token_ids: list[int], vocab_size: int) -> int:
    """The token SimExecutor derives after `token_ids` (its KV chain, then its rule)."""
    value = _ROOT_KV
    for t in token_ids:
        value = mix(value, t)
    return (mix(value, 7) >> 11) % vocab_size


class OracleProposer:
    """Proposes the true next tokens, each wrong with probability `error_rate` (a
    wrong draft and everything after it are then garbage); sometimes proposes fewer.

    calls: (token_ids, max_num_tokens) of every call, for exact checks.
    """

    def __init__(self, k: int, vocab_size: int, error_rate: float = 0.3,
                 seed: int = 0) -> None:
        self.num_speculative_tokens = k
        self.vocab_size = vocab_size
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.calls: list[tuple[list[int], int | None]] = []

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        self.calls.append((list(token_ids), max_num_tokens))
        k = self.num_speculative_tokens if max_num_tokens is None else min(
            self.num_speculative_tokens, max_num_tokens)
        k = self.rng.randint(0, k) if self.rng.random() < 0.2 else k
        history = list(token_ids)
        drafts = []
        for _ in range(k):
            t = next_token(history, self.vocab_size)
            if self.rng.random() < self.error_rate:
                t = (t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(t)
            history.append(t)
        return drafts


class SpecSimExecutor(SimExecutor):
    """SimExecutor that verifies draft tokens (module docstring).

    num_accepted: accepted draft tokens of every verified draft, in order.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        super().__init__(num_blocks, block_size, vocab_size)
        self.num_accepted: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        drafts: dict[str, list[int]] = {}
        for cached in plan.cached_reqs:
            if cached.draft_token_ids:
                drafts[cached.req_id] = cached.draft_token_ids
        # Base class: new requests, block tables, the KV writes of every scheduled token;
        # drafts are appended first so that they are computed (and a sampled token is
        # appended after them, replaced below).
        for req_id, d in drafts.items():
            self.requests[req_id].token_ids.extend(d)
        result = super().execute(StepPlan(plan.step_id, plan.new_reqs, plan.cached_reqs,
                                          plan.num_scheduled_tokens, []))
        sampled = []
        for s in result.sampled:
            d = drafts.get(s.req_id)
            if not d:
                sampled.append(s)
                continue
            state = self.requests[s.req_id]
            del state.token_ids[-1]  # the base class's token after the last draft
            end = len(state.token_ids)
            k = len(d)
            rows = []
            for pos in range(end - 1 - k, end):
                value = self._read(state, pos)
                rows.append((mix(value, 7) >> 11) % self.vocab_size)
            a = 0
            while a < k and rows[a] == d[a]:
                a += 1
            tokens = rows[:a + 1]
            self.num_accepted.append(a)
            del state.token_ids[-k:]
            state.num_computed_tokens -= k - a
            del state.block_ids[-(-state.num_computed_tokens // self.block_size):]
            state.token_ids.extend(tokens)
            sampled.append(SampledTokens(s.req_id, tokens))
        return StepResult(plan.step_id, sampled)
