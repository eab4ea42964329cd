"""The engine-side state of one request (DESIGN.md §4). Pure Python, no torch."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from flowengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flowengine.messages import NewRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # cancelled by the caller or the client went away
    FINISHED_ERROR = 6  # failed; the error text travels in the output

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence the scheduler runs: a prompt, its generated tokens and its KV blocks.

    A user request with `n` > 1 becomes `n` `Request`s (ids `"{parent}-{i}"`) that share
    the prompt's KV blocks through the prefix cache.

    Attributes:
        prompt_token_ids: the prompt, list of int token ids (never empty).
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens whose K/V are in the cache (prompt and output).
        block_hashes: chained hashes of the full blocks of prompt+output, filled in by
            the KV cache manager as blocks fill.
        num_cached_tokens: prompt tokens served from the prefix cache at first schedule.
        priority: lower value runs first under the "priority" policy (vLLM's rule).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "output_token_ids",
        "num_computed_tokens",
        "status",
        "block_hashes",
        "num_cached_tokens",
        "scheduled_time",
        "num_preemptions",
        "stop_reason",
        "max_tokens",
        "cache_salt",
        "error",
        "spec_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1  # set when first scheduled
        self.scheduled_time = 0.0  # time.monotonic() when first scheduled (metrics)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Speculative decoding with a draft model: the drafts the executor proposed to
        # follow the request's last token (core/spec_tokens.py).
        self.spec_token_ids: list[int] = []

    @classmethod
    def from_new_request(cls, msg: NewRequest, max_model_len: int) -> Request:
        """The scheduler's `Request` for a `NewRequest` message; max_tokens capped so
        that prompt + output fit max_model_len. Tokens the caller already holds (a
        recompute after an engine restart) become its first outputs. Raises ValueError
        for an empty prompt."""
        params = msg.sampling_params
        budget = max_model_len - len(msg.prompt_token_ids)
        max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        request = cls(
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
            request.append_output_token_ids(list(msg.output_token_ids))
        return request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
