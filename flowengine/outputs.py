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
    token, None for the first; in a DELTA stream it comes with the first output that
    has it. What `outputs` hold follows the request's `SamplingParams.output_kind`:
    everything so far (CUMULATIVE), only what is new since the previous output
    (DELTA: new text, new token ids and their logprobs), or the whole result in the
    one output of a finished request (FINAL_ONLY).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold the request's next output into this one (vLLM's `RequestOutput.add`).

        The one place outputs are folded: a stream that its caller has not read yet
        keeps one pending output and folds each new one into it.
        aggregate True (DELTA outputs): per completion (matched by `index`) texts, token
        ids and logprobs are concatenated, so this stays the delta since the caller's
        previous output; False (CUMULATIVE): a newer completion replaces the older one.
        Either way the latest cumulative logprob, finish and stop reasons win, as do the
        request's `finished` and `num_cached_tokens`; a set `error` and
        `prompt_logprobs` are kept. Completions stay in index order.

        Mutates this output and the lists of its completions; `next_output` must not be
        used afterwards (its completions may now belong to this one).
        """
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        appended = False
        for c in next_output.outputs:
            i = by_index.get(c.index)
            if i is None:
                self.outputs.append(c)
                appended = True
            elif not aggregate:
                self.outputs[i] = c
            else:
                old = self.outputs[i]
                old.text += c.text
                old.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    if old.logprobs is None:
                        old.logprobs = []
                    old.logprobs.extend(c.logprobs)
                old.cumulative_logprob = c.cumulative_logprob
                old.finish_reason = c.finish_reason
                old.stop_reason = c.stop_reason
        if appended:
            self.outputs.sort(key=_completion_index)
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens or self.num_cached_tokens
        if next_output.error is not None:
            self.error = next_output.error
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs


def _completion_index(c: CompletionOutput) -> int:
    return c.index
