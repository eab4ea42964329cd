"""The plan of one step while the scheduler builds it, and its `StepPlan` message.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flowengine.core.block_pool import KVCacheBlock
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.request import Request


@dataclass
class StepDraft:
    """What one `Scheduler.schedule()` call has decided so far.

    Attributes:
        token_budget: tokens still free in this step.
        num_scheduled: request id -> tokens to compute this step.
        new_reqs: requests the executors receive in full (first run or resume).
        cached_reqs: requests the executors hold, with the blocks added this step.
        is_short_of_blocks: a running request could not get its blocks (it preempted
            others or itself, or waits for blocks that in-flight steps release).
    """

    token_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[tuple[Request, list[KVCacheBlock]]] = field(default_factory=list)
    is_short_of_blocks: bool = False

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        self.new_reqs.append(request)

    def add_cached(self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        self.cached_reqs.append((request, new_blocks))

    def to_plan(
        self,
        step_id: int,
        finished_req_ids: list[str],
        get_block_ids: Callable[[str], list[int]],
    ) -> StepPlan:
        """The `StepPlan` message: new requests in full, cached ones as deltas.

        Call before advancing the requests' `num_computed_tokens`: the plan carries the
        counts from before the step. `get_block_ids` gives a request's whole block table.
        """
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=r.all_token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_id=r.eos_token_id,
            )
            for r in self.new_reqs
        ]
        cached_reqs = [
            CachedRequestData(
                req_id=r.request_id,
                new_block_ids=[b.block_id for b in blocks],
                num_computed_tokens=r.num_computed_tokens,
            )
            for r, blocks in self.cached_reqs
        ]
        entries: list[NewRequestData | CachedRequestData] = [*new_reqs, *cached_reqs]
        return StepPlan(
            step_id=step_id,
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=[self.num_scheduled[e.req_id] for e in entries],
            finished_req_ids=finished_req_ids,
        )
