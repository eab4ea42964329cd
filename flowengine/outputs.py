"""What callers receive: `RequestOutput` / `CompletionOutput`, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (natural log), its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (top-N plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, then token id -> Logprob (top-N plus
# the prompt token itself), as vLLM's RequestOutput.prompt_logprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (`index` among the request's `n`).

    `finish_reason` is "stop", "length", "abort" or None while running; `stop_reason`
    is the stop string or stop token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Outputs of one request: the prompt, its completions, whether all are finished.

    `num_cached_tokens` counts prompt tokens served from the prefix cache.
    `prompt_logprobs` (requests with `prompt_logprobs` set): one entry per prompt
    token, None for the first; in a stream it comes with the first output that has it.
    In a stream (`AsyncEngine.submit`), each `RequestOutput` holds the delta since the
    previous one: new text and new token ids only.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
