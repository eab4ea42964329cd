"""Steps in flight: plans sent to the executors whose results are not applied yet.

With two plans in flight (DESIGN.md §5) the scheduler plans step N+1 before step N's
result arrives. It then needs three answers that only the in-flight plans hold:

- how many tokens a request gains once the in-flight results arrive: one for each
  in-flight step in which it samples (its *placeholder* tokens, vLLM v1's
  `num_output_placeholders`), so step N+1 can compute the token step N samples;
- which in-flight step is the last one to write a request's KV blocks, so blocks of a
  request that finishes, is preempted or is aborted stay taken until that step is done;
- whether a request changed (finished, preempted, replaced under the same id) since a
  plan was made, so a late result does not touch the wrong state.

Placeholders are counted from the records, not stored on the request, so there is no
counter to keep in step with preemption, abort and id reuse. A scan is O(steps in
flight), two in practice.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections import deque

import msgspec

from flowengine.request import Request


class ScheduledRequest(msgspec.Struct, frozen=True, gc=False):
    """One request of an in-flight plan, as the scheduler saw it when planning.

    Attributes:
        request: the scheduler's `Request` object (identity tells id reuse apart).
        num_preemptions: `request.num_preemptions` at planning time; a larger count later
            means the request was preempted since, so this step's blocks are not its own.
        samples: the step computes the request's last token (known or placeholder), so
            the executor samples one token for it.

    A msgspec struct rather than a dataclass: one is made per request per step, and a
    struct is built several times faster. Never sent anywhere (it holds the Request).
    gc=False is safe: it is immutable and nothing it references points back to it.
    """

    request: Request
    num_preemptions: int
    samples: bool


class InFlightSteps:
    """Records of the plans with scheduled tokens whose results are not applied yet.

    Plans are added in step order and must complete in the same order (the executors
    run plans in order, DESIGN.md §5).
    """

    def __init__(self) -> None:
        self._steps: deque[tuple[int, dict[str, ScheduledRequest]]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step_id: int, scheduled: dict[str, ScheduledRequest]) -> None:
        """Record a plan just sent. Raises ValueError unless `step_id` is the newest."""
        if self._steps and step_id <= self._steps[-1][0]:
            raise ValueError(f"step {step_id} planned after step {self._steps[-1][0]}")
        self._steps.append((step_id, scheduled))

    def complete(self, step_id: int) -> dict[str, ScheduledRequest]:
        """Forget the oldest plan, whose result has arrived, and return its records.

        Raises ValueError when `step_id` is not the oldest plan in flight: results must
        be applied once each, in the order the plans were made.
        """
        if not self._steps or self._steps[0][0] != step_id:
            oldest = self._steps[0][0] if self._steps else None
            raise ValueError(
                f"result of step {step_id} applied, but the oldest step in flight is {oldest}; "
                "apply each step's result once, in the order the plans were made"
            )
        return self._steps.popleft()[1]

    @property
    def oldest_step_id(self) -> int | None:
        """Id of the oldest plan in flight (the next result to apply), or None."""
        return self._steps[0][0] if self._steps else None

    def num_placeholders(self, request: Request) -> int:
        """Tokens `request` samples in in-flight steps: known to the executors, not yet
        to the scheduler."""
        count = 0
        for _, scheduled in self._steps:
            entry = scheduled.get(request.request_id)
            if entry is not None and entry.request is request and entry.samples:
                count += 1
        return count

    def last_step_of(self, request: Request) -> int | None:
        """Id of the newest in-flight step that computes tokens of `request` (so writes
        its KV blocks), or None."""
        for step_id, scheduled in reversed(self._steps):
            entry = scheduled.get(request.request_id)
            if entry is not None and entry.request is request:
                return step_id
        return None
