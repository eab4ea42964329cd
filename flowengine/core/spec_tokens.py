"""Draft tokens in the scheduler: who gets them, their budget, their rollback, counters.

Speculative decoding (docs/design.md, "Speculative decoding"): a decoding request may
be scheduled for its last known token plus k draft tokens (vLLM's
`num_tokens_with_spec`: they all count against the step's token budget and get KV
slots before the step). The executor verifies them in the same forward and returns the
accepted drafts plus one token sampled after them; the rejected drafts' KV is then
rolled back: `num_computed_tokens` drops by their count and blocks that hold no
verified token leave the block table (`KVCacheManager.trim`; the executor trims its
copy by the same rule, `ModelRunner.apply_verified`). Drafts never enter
`Request.output_token_ids`, so they are never hashed into the prefix cache: only
blocks full of verified tokens are published.

Rules:
- a request gets drafts only when it decodes (one token left to compute) and is not
  constrained by structured outputs (its next-token mask is filled for one position);
- at most `max_tokens - num_output_tokens - 1` drafts (the bonus token is always one
  more) and `max_len - num_tokens` (every draft needs a KV slot within max_len), and
  at most the budget left minus the token itself;
- with async scheduling a request is never planned on a placeholder while
  speculation is on: its accepted count is only known from the result, so it waits for
  its previous step's result (as vLLM, which did not overlap n-gram speculation).

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from flowengine.request import Request


class DraftProposer(Protocol):
    """Makes draft tokens from a request's token ids (the n-gram proposer)."""

    num_speculative_tokens: int

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]: ...


class ExecutorDrafts:
    """The scheduler's side of a draft model: drafts arrive with the results."""

    from_executor = True

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        raise RuntimeError("a draft model's drafts come from the executor's results")


class SpecDecodeState:
    """The scheduler's speculative-decoding part: proposer, caps and vLLM's counters.

    Attributes (totals since start, vLLM's `SpecDecodingStats`):
        num_drafts: request-steps that carried at least one draft token.
        num_draft_tokens: draft tokens scheduled.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: [k] accepted draft tokens by position.
    """

    def __init__(self, proposer: DraftProposer, max_len: int) -> None:
        self.proposer = proposer
        # A draft model proposes in the executor: its drafts come with each result
        # (Request.spec_token_ids) instead of from `propose`.
        self.from_executor = getattr(proposer, "from_executor", False)
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.max_len = max_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def drafts_for(self, request: Request, max_num_drafts: int) -> list[int]:
        """Draft tokens for a decoding `request` (see the module docstring), at most
        `max_num_drafts` (the budget left after its own token); may be empty."""
        params = request.sampling_params
        if params.structured_outputs is not None:
            return []
        num_output = len(request.output_token_ids)
        num_tokens = len(request.prompt_token_ids) + num_output
        cap = min(max_num_drafts, request.max_tokens - num_output - 1,
                  self.max_len - num_tokens)
        if cap <= 0:
            return []
        if self.from_executor:
            drafts, request.spec_token_ids = request.spec_token_ids, []
            return drafts[:cap]
        return self.proposer.propose(request.prompt_token_ids + request.output_token_ids, cap)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of `num_draft_tokens` with `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def stats(self) -> dict[str, Any]:
        """The counters as SchedulerStats fields."""
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
