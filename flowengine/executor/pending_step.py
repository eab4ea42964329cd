"""A launched step whose sampled tokens are still on their way to the host.

The runner enqueues a step's forward and sampling, then a non-blocking copy of the
sampled ids (and logprobs, if asked) into pinned host memory, and records an event
after it. `result()` waits only for that event, so the host can read step N's tokens
while step N+1, launched after it, keeps the GPU busy (DESIGN.md §5).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from flowengine.executor.input_batch import RequestState
from flowengine.messages import SampledTokens, StepResult
from flowengine.sample.output import LogprobsTensors, SamplerOutput


def copy_to_host(output: SamplerOutput, *, timing: bool = False,
                 ) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """Start non-blocking copies of `output`'s tensors into pinned host memory.

    Returns the host-side SamplerOutput (valid once the event has completed) and the
    event recorded after the copies (None on the CPU, where the copies are synchronous;
    with `timing`, a CUDA event that can measure elapsed time).
    """
    is_cuda = output.sampled_token_ids.is_cuda

    def to_host(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=is_cuda)
        host.copy_(t, non_blocking=is_cuda)
        return host

    lt = output.logprobs_tensors
    host_lt = None if lt is None else LogprobsTensors(
        to_host(lt.top_token_ids), to_host(lt.top_logprobs),
        to_host(lt.sampled_logprobs), to_host(lt.sampled_ranks))
    host = SamplerOutput(to_host(output.sampled_token_ids), output.num_logprobs, host_lt)
    event = None
    if is_cuda:
        event = torch.cuda.Event(enable_timing=timing)
        event.record()
    return host, event


class PendingStep:
    """Handle of one launched step; `result()` gives its StepResult.

    Args:
        step_id: the plan's step id.
        req_ids: requests that sampled, in row order.
        placeholders: (request state, index into its token_ids) of each sampled token,
            in row order; `result()` writes the real ids there.
        host_output: the sampled tokens in host memory (see copy_to_host), or None when
            the step sampled nothing.
        event: completes when host_output is valid (None: already valid).
        on_done: called once with this step after its placeholders are filled.
        lock: held while the placeholders are filled (the runner's, so that result()
            may run in another thread than the next launch).
        start_event: a timing CUDA event recorded when the step's device work was
            enqueued (after its inputs' copy); with a timing `event`, `device_events`
            gives both (FLOWENGINE_DEVICE_TIMERS, read by the executor actor's timers).
    """

    def __init__(self, step_id: int, req_ids: list[str],
                 placeholders: list[tuple[RequestState, int]],
                 host_output: SamplerOutput | None, event: torch.cuda.Event | None,
                 on_done: Callable[[PendingStep], None] | None = None,
                 lock: threading.RLock | None = None,
                 start_event: torch.cuda.Event | None = None) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        self._placeholders = placeholders
        self._host_output = host_output
        self._event = event
        self._on_done = on_done
        self._lock = lock
        self._result: StepResult | None = None
        self._start_event = start_event

    @property
    def device_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """(start, end) timing events of the step's device work, or None when the step
        was not timed. Valid to measure (`start.elapsed_time(end)`, ms) once done()."""
        if self._start_event is None or self._event is None:
            return None
        return self._start_event, self._event

    @classmethod
    def empty(cls, step_id: int) -> PendingStep:
        """A step that sampled nothing (only partial prefill chunks, or no tokens)."""
        return cls(step_id, [], [], None, None)

    @property
    def is_resolved(self) -> bool:
        return self._result is not None

    def done(self) -> bool:
        """True once the step's tokens are in host memory (result() will not wait)."""
        return self._result is not None or self._event is None or self._event.query()

    def result(self) -> StepResult:
        """Wait for the step's tokens, write them into the requests, return the result.

        Idempotent: later calls return the same StepResult.
        """
        if self._result is not None:
            return self._result
        if self._host_output is None:
            self._result = StepResult(self.step_id, [])
            return self._result
        if self._event is not None:
            self._event.synchronize()  # outside the lock: a launch may proceed meanwhile
        token_ids, logprobs = self._host_output.tolists()
        with self._lock if self._lock is not None else contextlib.nullcontext():
            if self._result is not None:  # resolved by another thread meanwhile
                return self._result
            for (state, index), token in zip(self._placeholders, token_ids, strict=True):
                state.token_ids[index] = token
                state.placeholder_indices.remove(index)
            self._result = StepResult(self.step_id, [
                SampledTokens(rid, [tok], None if lp is None else [lp],
                              state.take_prompt_logprobs())
                for rid, tok, lp, (state, _) in zip(self.req_ids, token_ids, logprobs,
                                                    self._placeholders, strict=True)
            ])
            if self._on_done is not None:
                self._on_done(self)
        return self._result
