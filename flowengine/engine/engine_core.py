"""The engine core: requests in, steps planned and applied, deltas out (DESIGN.md §4).

`EngineCore` joins the pure `Scheduler` with an executor (anything with
`execute_model(plan) -> StepResult`). It holds no asyncio and no processes. Two
drivers use the same object:

- the in-process `LLM` calls `step()`: schedule, execute, update;
- the Scheduler actor (flowengine/actors/scheduler.py) calls `schedule()` and, once the
  executor actor's result arrives over the `results` channel, `update()`, with up to
  two plans in flight. In the engine process of the multiproc placement the executor
  is remote and the core has none (`executor=None`).

Requests enter through `add_request` (raises on bad input) or `handle` (the requests
channel's messages: bad input becomes an "error" delta). Deltas made outside a step
(aborts, rejected requests) wait in the core's one pending list and lead the next
`update()` (or `take_outputs()`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from flowengine.core.scheduler import Scheduler
from flowengine.messages import (
    AbortRequest,
    GrammarOutput,
    NewRequest,
    RequestDelta,
    StepPlan,
    StepResult,
)
from flowengine.request import Request

logger = logging.getLogger(__name__)


class ExecutorLike(Protocol):
    def execute_model(self, plan: StepPlan) -> StepResult: ...


class EngineCore:
    """Owns the scheduler and, in one process, its executor.

    Args:
        scheduler: the pure scheduler (block accounting, stop checks on token ids).
        executor: runs a `StepPlan` and returns sampled tokens as a `StepResult`;
            None where the executor runs elsewhere (`step()` then raises).
        max_model_len: tokens a request may hold (prompt + output).
    """

    def __init__(
        self, scheduler: Scheduler, executor: ExecutorLike | None, max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_model_len = max_model_len
        # A step with constrained rows runs forward, then the grammar bitmask fill (on
        # the host while the device computes), then sampling, where the executor can
        # split a step so (`Scheduler.defer_grammar_bitmask`).
        self._split_steps = (hasattr(executor, "launch_forward")
                             and hasattr(executor, "launch_sampling"))
        if self._split_steps:
            scheduler.defer_grammar_bitmask = True
        self.num_steps = 0
        # Deltas produced outside a step (aborts, rejected requests), delivered first
        # by the next update() or take_outputs().
        self._pending: list[RequestDelta] = []

    # ------------------------------------------------------------------ requests
    def add_request(self, msg: NewRequest) -> None:
        """Admit one tokenized request. Raises `ValueError` (nothing enters) if invalid."""
        self.scheduler.add_request(Request.from_new_request(msg, self.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests as aborted and free their blocks (unknown ids are ignored);
        an "abort" delta for each live one is pending."""
        self._pending.extend(self.scheduler.abort_requests(request_ids))

    def handle(self, msg: NewRequest | AbortRequest) -> None:
        """Apply one message of the requests channel. A NewRequest whose id is live is
        ignored (resubmitted after an engine restart and also sent directly: keep
        one); an invalid one gets an "error" delta instead of raising (the frontend
        validates first; this is the last line, never silence)."""
        if isinstance(msg, AbortRequest):
            self.abort_requests(msg.request_ids)
            return
        if self.scheduler.get_request(msg.request_id) is not None:
            return
        try:
            self.add_request(msg)
        except ValueError as exc:
            self._pending.append(
                RequestDelta(msg.request_id, [], finish_reason="error", error=str(exc))
            )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    @property
    def has_pending_outputs(self) -> bool:
        """Deltas wait that no step produced (see `take_outputs`)."""
        return bool(self._pending)

    def take_outputs(self) -> list[RequestDelta]:
        """The pending deltas (aborts, rejected requests); clears them."""
        deltas, self._pending = self._pending, []
        return deltas

    # ------------------------------------------------------------------ steps
    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when it schedules no token (its finished ids are
        repeated in the next plan, so it need not be sent)."""
        plan = self.scheduler.schedule()
        if self.scheduler.pending_deltas:  # requests failed while planning
            self._pending.extend(self.scheduler.pending_deltas)
            self.scheduler.pending_deltas.clear()
        return plan if plan.num_scheduled_tokens else None

    @property
    def num_compiling_grammars(self) -> int:
        """Requests waiting for their grammar to compile (a driver with nothing
        scheduled waits for news briefly instead of for the next request)."""
        return self.scheduler.num_compiling_grammars

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a grammar compile finishes, at most `timeout_s` seconds."""
        if self.scheduler.structured_outputs is not None:
            self.scheduler.structured_outputs.wait_for_compiles(timeout_s)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run `plan` on the executor. An executor exception becomes a `StepResult`
        with `error` set, so every request of the step finishes with finish_reason
        "error" instead of hanging. Raises RuntimeError without an executor."""
        if self.executor is None:
            raise RuntimeError("this EngineCore has no executor: its steps run remotely")
        start = time.perf_counter()
        try:
            if plan.pending_structured_output_tokens:
                result = self._execute_split(plan)
            else:
                result = self.executor.execute_model(plan)
        except Exception as exc:  # surfaced to each caller of this step
            logger.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            result = StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}")
        logger.debug(
            "step %d: %d reqs, %d tokens, %.1f ms",
            plan.step_id,
            len(plan.num_scheduled_tokens),
            plan.total_num_scheduled_tokens,
            1e3 * (time.perf_counter() - start),
        )
        return result

    def _execute_split(self, plan: StepPlan) -> StepResult:
        """A plan sent without its grammar bitmask: launch the forward, fill the bitmask
        while the device runs it, then sample with it."""
        forward = self.executor.launch_forward(plan)
        grammar = None
        for output in self.fill_grammar_bitmasks():
            if output.step_id == plan.step_id:
                grammar = output
        if grammar is None:
            raise RuntimeError(f"step {plan.step_id}: its grammar bitmask was not filled")
        return self.executor.launch_sampling(forward, grammar).result()

    def fill_grammar_bitmasks(self) -> list[GrammarOutput]:
        """Fill the bitmasks of pending plans that can be filled now
        (`Scheduler.fill_grammar_bitmasks`): a driver calls it right after sending or
        launching a plan, and sends the outputs to the executors before the next plan."""
        return self.scheduler.fill_grammar_bitmasks()

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply a step's result (`Scheduler.update_from_output`, same rules and
        errors); returns the pending deltas followed by the step's."""
        self.num_steps += 1
        deltas = self.take_outputs()
        deltas.extend(self.scheduler.update_from_output(plan, result))
        return deltas

    def take_grammar_work(self) -> Callable[[], Any] | None:
        """The matchers' advance and bitmask fill that the last update() left to run off
        the driver's thread (`Scheduler.take_grammar_work`), or None."""
        return self.scheduler.take_grammar_work()

    def finish_grammar_work(self, outcome: Any) -> list[RequestDelta]:
        """`Scheduler.finish_grammar_work`: the GrammarOutputs join
        take_grammar_outputs(); returns the pending deltas and those of refused tokens."""
        deltas = self.take_outputs()
        deltas.extend(self.scheduler.finish_grammar_work(outcome))
        return deltas

    def take_grammar_outputs(self) -> list[GrammarOutput]:
        """Bitmasks of plans sent with pending_structured_output_tokens that the last
        update() filled (`Scheduler.take_grammar_outputs`): the driver sends them to
        the executors before its next plan."""
        return self.scheduler.take_grammar_outputs()

    def step(self) -> list[RequestDelta]:
        """Schedule one step, run it, and return per-request deltas (pending first).

        A BaseException while the step runs (KeyboardInterrupt) is raised after the
        step is retired: its requests finish with an error, whose deltas the next
        step returns, and the scheduler's in-flight records stay in step."""
        if not self.scheduler.has_unfinished_requests():
            return self.take_outputs()
        plan = self.schedule()
        if plan is None:
            if self.num_compiling_grammars:
                self.wait_for_grammars(0.05)  # no busy loop while grammars compile
            return self.take_outputs()
        try:
            result = self.execute(plan)
        except BaseException as exc:
            error = f"the step was interrupted ({type(exc).__name__})"
            self._pending = self.update(plan, StepResult(plan.step_id, [], error=error))
            raise
        return self.update(plan, result)
