"""The plan of one step while the scheduler builds it, and its `StepPlan` message.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flowengine.core.block_pool import KVCacheBlock
from flowengine.core.in_flight import ScheduledRequest
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.request import Request

# Blocks added to a request that needed none this step (shared, never mutated).
NO_NEW_BLOCKS: tuple[KVCacheBlock, ...] = ()
# NOTE: `new_block_ids` of every cached request that gained no block (most decode
# steps) is this one list: readers of a plan must not mutate its lists (executors
# extend their own block tables from them). Sharing saves a list per request per step
# that the garbage collector would track while the plan is in flight.
_NO_NEW_BLOCK_IDS: list[int] = []
# The same for `new_token_ids` of a step that computes no output token (a prompt chunk).
_NO_TOKEN_IDS: list[int] = []


@dataclass(slots=True)
class StepDraft:
    """What one `Scheduler.schedule()` call has decided so far.

    Attributes:
        token_budget: tokens still free in this step.
        new_reqs, new_num_tokens: requests the executors receive in full (first run or
            resume), in scheduling order, and the tokens each computes.
        cached_reqs, cached_num_tokens, cached_new_blocks, cached_num_known: requests
            the executors hold, the tokens each computes, the blocks added to each this
            step, and each one's known tokens: its tokens plus, with async scheduling,
            its placeholders (`in_flight.py`); a request samples in this step when its
            computed tokens reach them. Parallel lists rather than a tuple per request:
            this runs for every running request on every step, and a tuple each is an
            allocation the garbage collector has to track.
        is_short_of_blocks: a running request could not get its blocks (it preempted
            others or itself, or waits for blocks that in-flight steps release).
        draft_token_ids: speculative decoding: the draft tokens of the cached requests
            that have some (their num_tokens count them), by request id.
    """

    token_budget: int
    new_reqs: list[Request] = field(default_factory=list)
    new_num_tokens: list[int] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    cached_num_tokens: list[int] = field(default_factory=list)
    cached_new_blocks: list[Sequence[KVCacheBlock]] = field(default_factory=list)
    cached_num_known: list[int] = field(default_factory=list)
    is_short_of_blocks: bool = False
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new_reqs.append(request)
        self.new_num_tokens.append(num_tokens)
        self.token_budget -= num_tokens

    def add_cached(
        self,
        request: Request,
        num_tokens: int,
        new_blocks: Sequence[KVCacheBlock],
        num_known: int,
    ) -> None:
        self.cached_reqs.append(request)
        self.cached_num_tokens.append(num_tokens)
        self.cached_new_blocks.append(new_blocks)
        self.cached_num_known.append(num_known)
        self.token_budget -= num_tokens

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.new_reqs) + len(self.cached_reqs)

    def commit(
        self,
        step_id: int,
        finished_req_ids: list[str],
        get_block_ids: Callable[[str], list[int]],
        with_new_token_ids: bool = False,
    ) -> tuple[StepPlan, dict[str, ScheduledRequest]]:
        """Build the `StepPlan` and advance each scheduled request's `num_computed_tokens`.

        The plan carries the counts from before the step: new requests in full (their
        whole block table from `get_block_ids`), cached ones as deltas, with the output
        tokens each computes when `with_new_token_ids` (pipeline parallelism:
        `CachedRequestData.new_token_ids`). Returns the plan
        and the in-flight record of each scheduled request (`ScheduledRequest`); one
        pass over the requests does both, since this runs for every running request on
        every step.
        """
        scheduled: dict[str, ScheduledRequest] = {}
        new_reqs: list[NewRequestData] = []
        for request, num_tokens in zip(self.new_reqs, self.new_num_tokens, strict=True):
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            new_reqs.append(
                NewRequestData(
                    req_id,
                    request.all_token_ids,
                    request.num_prompt_tokens,
                    request.sampling_params,
                    get_block_ids(req_id),
                    num_computed,
                    request.eos_token_id,
                )
            )
            num_computed += num_tokens
            request.num_computed_tokens = num_computed
            # A new (or resumed) request has no placeholders: see _schedule_waiting.
            samples = num_computed >= request.num_tokens
            scheduled[req_id] = ScheduledRequest(request, request.num_preemptions, samples)
        cached_reqs: list[CachedRequestData] = []
        drafts = self.draft_token_ids
        for request, num_tokens, new_blocks, num_known in zip(
            self.cached_reqs,
            self.cached_num_tokens,
            self.cached_new_blocks,
            self.cached_num_known,
            strict=True,
        ):
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            new_block_ids = [b.block_id for b in new_blocks] if new_blocks else _NO_NEW_BLOCK_IDS
            if with_new_token_ids:
                num_prompt = request.num_prompt_tokens
                end = num_computed + num_tokens - num_prompt  # < 0: a prompt chunk
                new_token_ids = (request.output_token_ids[max(num_computed - num_prompt, 0):end]
                                 if end > 0 else _NO_TOKEN_IDS)
                cached_reqs.append(CachedRequestData(req_id, new_block_ids, num_computed,
                                                     drafts.get(req_id, _NO_TOKEN_IDS), new_token_ids))
            elif drafts and req_id in drafts:
                cached_reqs.append(
                    CachedRequestData(req_id, new_block_ids, num_computed, drafts[req_id]))
            else:
                cached_reqs.append(CachedRequestData(req_id, new_block_ids, num_computed))
            num_computed += num_tokens
            request.num_computed_tokens = num_computed
            scheduled[req_id] = ScheduledRequest(
                request, request.num_preemptions, num_computed >= num_known
            )
        num_scheduled_tokens = self.new_num_tokens + self.cached_num_tokens
        plan = StepPlan(step_id, new_reqs, cached_reqs, num_scheduled_tokens, finished_req_ids)
        return plan, scheduled
