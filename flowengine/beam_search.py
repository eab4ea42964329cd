"""Beam search: vLLM's `BeamSearchParams` / `BeamSearchOutput`, scored as transformers.

The engine does not know beams. A driver (`LLM.beam_search`, or
`flowengine.entrypoints.async_engine.beam_search` for the server) runs each step by
submitting every live beam as its own request (its prompt plus the beam's tokens,
`max_tokens=1`, `logprobs=num_candidates`, see `step_params`) and hands the top
log-probabilities back to `BeamSearch.advance`. This is how vLLM's `LLM.beam_search`
drives its engine. KV memory: the beams of a prompt hit the prefix cache on every full
block they share (the prompt's full blocks, and the full blocks of a common
generated prefix), each such block held once with a reference per beam; only the
partial last block of each beam is recomputed in each step (vLLM v1 does the same).

Which beams survive and how hypotheses are scored follows transformers'
`GenerationMixin._beam_search` (transformers 4.50+/5.x, `generation/utils.py`), so the
result equals `model.generate(num_beams=W, length_penalty=..., early_stopping=...,
do_sample=False)`:

- each step keeps the best K = max(2, 1 + number of EOS ids) * W continuations of all
  live beams by cumulative log-probability; the first W of them that do not end are
  the next live beams;
- a continuation that ends (an EOS id, or the max_tokens-th token) and ranks among
  the first W becomes a finished hypothesis with score
  cum_logprob / generated_len ** length_penalty (generated_len counts the EOS token,
  not the prompt); the best W hypotheses are kept;
- early_stopping=True: stop once W hypotheses are finished; False: stop when the best
  live beam, scored at its current length, cannot beat the worst kept hypothesis;
  "never": the same, but with length_penalty > 0 the best live beam is scored at
  max_tokens (the canonical beam search with length_penalty=0).

Pure logic: no asyncio, no torch, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flowengine.outputs import Logprob
from flowengine.sampling_params import SamplingParams

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class BeamSearchParams:
    """Parameters of one beam search (vLLM's `BeamSearchParams`, plus transformers'
    `early_stopping`).

    Attributes:
        beam_width: beams kept per step and sequences returned (>= 1).
        max_tokens: most tokens generated per sequence (>= 1).
        ignore_eos: EOS does not end a beam (every sequence runs to max_tokens).
        temperature: >= 0, passed to each step's request as vLLM does; the beams are
            ranked by the model's raw log-probabilities (vLLM v1's logprobs, and
            transformers' beam search with do_sample=False), so it does not change the
            result.
        length_penalty: exponent of the generated length in a hypothesis' score
            (score = cum_logprob / len ** length_penalty); > 0 favours longer
            sequences, < 0 shorter ones. transformers' default 1.0.
        include_stop_str_in_output: the text of a sequence that ended with EOS keeps
            the EOS token's text.
        early_stopping: True, False or "never", transformers' meaning (module
            docstring). Default False, as transformers.

    Raises:
        ValueError: a value out of range, naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )


@dataclass
class BeamSearchSequence:
    """One returned sequence (vLLM's `BeamSearchSequence`).

    Attributes:
        tokens: prompt token ids followed by the generated ones (EOS included when the
            sequence ended with it), as vLLM.
        logprobs: per generated token, the top log-probabilities of that step
            (token id -> Logprob, rank 1 = most likely), the chosen token among them.
        cum_logprob: sum of the generated tokens' log-probabilities (natural log).
        score: cum_logprob / len(generated) ** length_penalty, the value beams are
            ranked by (transformers' `sequences_scores`).
        text: the generated text (without EOS unless include_stop_str_in_output).
        finish_reason: "stop" (EOS) or "length" (max_tokens).
        stop_reason: None (EOS ends a sequence, as vLLM reports it).
        num_prompt_tokens: how many of `tokens` are the prompt's.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (tokens after the prompt)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The result of one prompt (vLLM's `BeamSearchOutput`): `sequences`, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]  # generated only
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float


def length_normalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty (transformers' hypothesis score).

    NOTE: a huge |length_penalty| takes length ** length_penalty out of the float range
    (where Python's float pow raises OverflowError, and a 0.0 denominator
    ZeroDivisionError); the score is then its limit: -0.0 for a vanishing score,
    -inf for a diverging one (cum_logprob <= 0).
    """
    try:
        return cum_logprob / length ** length_penalty
    except OverflowError:
        return -0.0 if cum_logprob <= 0 else 0.0
    except ZeroDivisionError:
        return -math.inf if cum_logprob < 0 else 0.0


def num_candidates(beam_width: int, num_eos_ids: int) -> int:
    """Continuations kept per step, also the log-probabilities asked per beam:
    max(2, 1 + num_eos_ids) * beam_width (transformers' `beams_to_keep`), enough that
    W live beams remain when every live beam's best continuation is an EOS."""
    return max(2, 1 + num_eos_ids) * beam_width


def step_params(params: BeamSearchParams, num_eos_ids: int) -> SamplingParams:
    """SamplingParams of one beam's request in a step: one token, the top
    `num_candidates` log-probabilities, no stop (the search decides), no text."""
    return SamplingParams(
        max_tokens=1,
        temperature=params.temperature,
        logprobs=num_candidates(params.beam_width, num_eos_ids),
        ignore_eos=True,
        detokenize=False,
    )


def step_prompt(token_ids: list[int], prompt: Any) -> dict[str, Any]:
    """The prompt of one beam's step request: the beam's token ids, under the search
    prompt's `cache_salt` (a dict prompt's key) when it has one.

    NOTE: every step must carry the salt: an unsalted step would cache the prompt's
    blocks where requests of any other salt (or none) hit them.
    """
    step: dict[str, Any] = {"prompt_token_ids": token_ids}
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        step["cache_salt"] = prompt["cache_salt"]
    return step


def check_request(
    params: BeamSearchParams, num_prompt_tokens: int, max_model_len: int,
    max_logprobs: int, num_eos_ids: int,
) -> None:
    """Raise ValueError when a search cannot run on this engine: its sequences would
    not fit max_model_len, or its steps need more log-probabilities than the engine's
    max_logprobs (-1: no limit) returns."""
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens={params.max_tokens} "
            f"exceeds max_model_len={max_model_len}; shorten the prompt or lower max_tokens"
        )
    needed = num_candidates(params.beam_width, num_eos_ids)
    if max_logprobs != -1 and needed > max_logprobs:
        raise ValueError(
            f"beam_width={params.beam_width} needs the top {needed} log-probabilities of "
            f"each beam per step, over the engine's max_logprobs={max_logprobs}; lower "
            "beam_width or raise max_logprobs (--max-logprobs)"
        )


def top_logprobs(logprobs: dict[int, Logprob]) -> dict[int, float]:
    """A step's Logprob dict (token id -> Logprob) as token id -> float."""
    return {token: lp.logprob for token, lp in logprobs.items()}


class BeamSearch:
    """The state of one prompt's beam search; the driver alternates `beam_inputs()`
    (run each as a request) and `advance(...)` (their log-probabilities) until `done`.

    Args:
        prompt_token_ids: the prompt.
        params: the search's parameters.
        eos_token_ids: ids that end a beam (ignored with params.ignore_eos).
    """

    def __init__(
        self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = num_candidates(params.beam_width, len(set(eos_token_ids)))
        # Sorted by cum_logprob, best first (transformers' running beams). One beam to
        # start: the others of transformers start at -1e9 and are never chosen.
        self.running: list[_Beam] = [_Beam([], [], 0.0)]
        self.finished: list[tuple[float, _Beam]] = []  # (score, beam), best first
        self.num_generated = 0  # tokens of every running beam
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def beam_inputs(self) -> list[list[int]]:
        """Token ids of each live beam's request: the prompt plus the beam's tokens."""
        if self.done:
            return []
        return [self.prompt_token_ids + b.tokens for b in self.running]

    def advance(self, top_logprobs: Sequence[dict[int, float]]) -> None:
        """Extend the search by one token.

        top_logprobs: one dict per live beam (in `beam_inputs()` order): token id ->
            natural-log probability of the next token, at least the top
            `num_candidates` tokens of that beam.

        Raises:
            ValueError: the number of dicts is not the number of live beams.
        """
        if self.done:
            raise ValueError("the beam search is done; nothing to advance")
        if len(top_logprobs) != len(self.running):
            raise ValueError(f"got log-probabilities for {len(top_logprobs)} beams, "
                             f"{len(self.running)} are live")
        p = self.params
        width = p.beam_width
        cands: list[tuple[float, int, int, float]] = []  # (cum, beam index, token, lp)
        for i, (beam, lps) in enumerate(zip(self.running, top_logprobs, strict=True)):
            # Only each beam's own top K can be in the joint top K.
            best = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))[: self.num_candidates]
            cands.extend((beam.cum_logprob + lp, i, tok, lp) for tok, lp in best)
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: self.num_candidates]
        gen_len = self.num_generated + 1
        at_max = gen_len >= p.max_tokens
        ranked = [dict(sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))) for lps in top_logprobs]

        def extend(c: tuple[float, int, int, float]) -> _Beam:
            parent = self.running[c[1]]
            step_lps = {t: Logprob(lp, rank) for rank, (t, lp) in
                        enumerate(ranked[c[1]].items(), start=1)}
            return _Beam(parent.tokens + [c[2]], parent.logprobs + [step_lps], c[0])

        ends = [at_max or c[2] in self.eos_token_ids for c in cands]
        # Finished hypotheses: only the first W ranks may finish (the rest are spares
        # that keep W beams alive), not after W are kept with early_stopping=True, and
        # not once no live beam can improve on them.
        full = len(self.finished) == width
        if self._improvable and not (full and p.early_stopping is True):
            for c, end in zip(cands[:width], ends[:width], strict=False):
                if end:
                    score = length_normalized(c[0], gen_len, p.length_penalty)
                    self.finished.append((score, extend(c)))
            self.finished.sort(key=lambda sb: -sb[0])  # stable: earlier ones win ties
            del self.finished[width:]
        self.running = [extend(c) for c, end in zip(cands, ends, strict=True) if not end][:width]
        self.num_generated = gen_len
        if len(self.finished) == width and self.running:
            if p.early_stopping == "never" and p.length_penalty > 0:
                best_len = p.max_tokens
            else:
                best_len = gen_len
            best_possible = length_normalized(self.running[0].cum_logprob, best_len,
                                              p.length_penalty)
            self._improvable = best_possible > self.finished[-1][0]
        open_beam = not (len(self.finished) == width and p.early_stopping is True)
        self.done = not (self._improvable and open_beam and not all(ends))

    def output(self, decode=None) -> BeamSearchOutput:
        """The best `beam_width` finished sequences, best first.

        decode: token ids -> text (e.g. a tokenizer's decode); None leaves text None.
        """
        n = len(self.prompt_token_ids)
        sequences = []
        for score, beam in self.finished:
            ended_eos = bool(beam.tokens) and beam.tokens[-1] in self.eos_token_ids
            text = None
            if decode is not None:
                shown = beam.tokens
                if ended_eos and not self.params.include_stop_str_in_output:
                    shown = beam.tokens[:-1]
                text = decode(shown)
            sequences.append(BeamSearchSequence(
                tokens=self.prompt_token_ids + beam.tokens, logprobs=beam.logprobs,
                cum_logprob=beam.cum_logprob, score=score, text=text,
                finish_reason="stop" if ended_eos else "length", num_prompt_tokens=n,
            ))
        return BeamSearchOutput(sequences)
