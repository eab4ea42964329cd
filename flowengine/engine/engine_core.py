"""The engine's step loop: schedule, execute, update (DESIGN.md §4).

`EngineCore` joins the pure `Scheduler` with an executor (anything with
`execute_model(plan) -> StepResult`). It holds no asyncio and no processes: the
in-process `LLM` drives it directly, and the Scheduler actor wraps the same object.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Protocol

from flowengine.core.scheduler import Scheduler
from flowengine.messages import NewRequest, RequestDelta, StepPlan, StepResult
from flowengine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def request_from_msg(msg: NewRequest, max_model_len: int) -> Request:
    """The scheduler's `Request` for a `NewRequest`; max_tokens capped by max_model_len."""
    params = msg.sampling_params
    budget = max_model_len - len(msg.prompt_token_ids)
    max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
    request = Request(
        msg.request_id,
        msg.prompt_token_ids,
        params,
        eos_token_id=msg.eos_token_id,
        max_tokens=max_tokens,
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )
    if msg.output_token_ids:
        # Recompute after an engine restart: the caller already holds these tokens.
        request.append_output_token_ids(list(msg.output_token_ids))
    return request


def abort_requests(scheduler: Scheduler, request_ids: list[str]) -> list[RequestDelta]:
    """Finish live requests as aborted (frees blocks); one "abort" delta for each."""
    live = [
        rid
        for rid in request_ids
        if (r := scheduler.get_request(rid)) is not None and not r.is_finished
    ]
    scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
    return [RequestDelta(rid, [], finish_reason="abort") for rid in live]


class ExecutorLike(Protocol):
    def execute_model(self, plan: StepPlan) -> StepResult: ...


class EngineCore:
    """Owns the scheduler and one executor; `step()` runs one engine step.

    Args:
        scheduler: the pure scheduler (block accounting, stop checks on token ids).
        executor: runs a `StepPlan` and returns sampled tokens as a `StepResult`.
        max_model_len: tokens a request may hold (prompt + output).
    """

    def __init__(self, scheduler: Scheduler, executor: ExecutorLike, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_model_len = max_model_len
        self.num_steps = 0
        # Deltas produced outside a step (aborts), delivered with the next step.
        self._pending: list[RequestDelta] = []

    def add_request(self, msg: NewRequest) -> None:
        """Admit one tokenized request. Raises `ValueError` (nothing enters) if invalid."""
        self.scheduler.add_request(request_from_msg(msg, self.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests as aborted and free their blocks (unknown ids are ignored)."""
        self._pending.extend(abort_requests(self.scheduler, request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(self) -> list[RequestDelta]:
        """Schedule one step, run it, and return per-request deltas.

        An executor exception becomes a `StepResult` with `error` set, so every request
        of that step finishes with finish_reason "error" instead of hanging.
        """
        deltas, self._pending = self._pending, []
        if not self.scheduler.has_unfinished_requests():
            return deltas
        plan = self.scheduler.schedule()
        if not plan.num_scheduled_tokens:
            return deltas
        start = time.perf_counter()
        try:
            result = self.executor.execute_model(plan)
        except Exception as exc:  # surfaced to each caller of this step
            logger.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            result = StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}")
        self.num_steps += 1
        logger.debug(
            "step %d: %d reqs, %d tokens, %.1f ms",
            plan.step_id,
            len(plan.num_scheduled_tokens),
            plan.total_num_scheduled_tokens,
            1e3 * (time.perf_counter() - start),
        )
        deltas.extend(self.scheduler.update_from_output(plan, result))
        return deltas
