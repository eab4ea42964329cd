"""The plan of one step while the scheduler builds it, and its `StepPlan` message.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flowengine.core.block_pool import KVCacheBlock
from flowengine.core.in_flight import ScheduledRequest
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.request import Request


@dataclass(slots=True)
class StepDraft:
    """What one `Scheduler.schedule()` call has decided so far.

    Attributes:
        token_budget: tokens still free in this step.
        new_reqs: (request, tokens to compute) of requests the executors receive in
            full (first run or resume), in scheduling order.
        cached_reqs: (request, tokens to compute, blocks added this step, known tokens)
            of requests the executors hold. Known tokens: its tokens plus, with async
            scheduling, its placeholders (`in_flight.py`); the request samples in this
            step when its computed tokens reach them.
        is_short_of_blocks: a running request could not get its blocks (it preempted
            others or itself, or waits for blocks that in-flight steps release).
    """

    token_budget: int
    new_reqs: list[tuple[Request, int]] = field(default_factory=list)
    cached_reqs: list[tuple[Request, int, list[KVCacheBlock], int]] = field(default_factory=list)
    is_short_of_blocks: bool = False

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new_reqs.append((request, num_tokens))
        self.token_budget -= num_tokens

    def add_cached(
        self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock], num_known: int
    ) -> None:
        self.cached_reqs.append((request, num_tokens, new_blocks, num_known))
        self.token_budget -= num_tokens

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.new_reqs) + len(self.cached_reqs)

    def commit(
        self,
        step_id: int,
        finished_req_ids: list[str],
        get_block_ids: Callable[[str], list[int]],
    ) -> tuple[StepPlan, dict[str, ScheduledRequest]]:
        """Build the `StepPlan` and advance each scheduled request's `num_computed_tokens`.

        The plan carries the counts from before the step: new requests in full (their
        whole block table from `block_table`, request id -> blocks), cached ones as
        deltas. Returns the plan and the in-flight record of each scheduled request
        (`ScheduledRequest`); one pass over the requests does both, since this runs
        for every running request on every step.
        """
        scheduled: dict[str, ScheduledRequest] = {}
        num_scheduled_tokens: list[int] = []
        new_reqs: list[NewRequestData] = []
        for request, num_tokens in self.new_reqs:
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
            num_scheduled_tokens.append(num_tokens)
            num_computed += num_tokens
            request.num_computed_tokens = num_computed
            # A new (or resumed) request has no placeholders: see _schedule_waiting.
            samples = num_computed >= request.num_tokens
            scheduled[req_id] = ScheduledRequest(request, request.num_preemptions, samples)
        cached_reqs: list[CachedRequestData] = []
        for request, num_tokens, new_blocks, num_known in self.cached_reqs:
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            new_block_ids = [b.block_id for b in new_blocks] if new_blocks else []
            cached_reqs.append(CachedRequestData(req_id, new_block_ids, num_computed))
            num_scheduled_tokens.append(num_tokens)
            num_computed += num_tokens
            request.num_computed_tokens = num_computed
            scheduled[req_id] = ScheduledRequest(
                request, request.num_preemptions, num_computed >= num_known
            )
        plan = StepPlan(step_id, new_reqs, cached_reqs, num_scheduled_tokens, finished_req_ids)
        return plan, scheduled
