"""Sampling parameters of one request, with vLLM's names and defaults.

`SamplingParams` is a msgspec struct so that it crosses processes inside
`NewRequest` without pickle (DESIGN.md §2). Construction validates every field and
raises `ValueError` with the field, the value and the allowed range; an unknown
keyword argument raises `TypeError` (msgspec's constructor does that for us).

NOTE: every integer field is bounded to a signed 64-bit integer (msgpack's range, so
encoding for the shared-memory rings cannot fail on a valid object), every float must
be finite, and `bool` is not accepted where a number is meant.
"""

from __future__ import annotations

import math

import msgspec

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Below this temperature sampling is treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample the tokens of one request.

    Fields follow vLLM's `SamplingParams` (same names, same meaning):

    - n: number of completions for the prompt (>= 1); they share the prompt's KV blocks.
    - temperature: >= 0; 0 means greedy.
    - top_p: in (0, 1]; top_k: -1/0 (off) or >= 1; min_p: in [0, 1].
    - presence_penalty, frequency_penalty: in [-2, 2], over generated tokens (OpenAI's
      definition); repetition_penalty: > 0, over prompt and generated tokens
      (Keskar et al. 2019, as Hugging Face applies it).
    - seed: per-request seed; the same seed gives the same tokens whatever else runs.
    - stop: strings that end the text (matched on characters); stop_token_ids: ids that
      end it; include_stop_str_in_output keeps the matched stop string.
    - ignore_eos: keep going after EOS; max_tokens (>= 1, None = up to max_model_len);
      min_tokens: EOS/stop ids are suppressed until this many tokens exist.
    - logprobs: number of top log-probabilities per generated token (plus the sampled
      token's), None for none.
    - skip_special_tokens, spaces_between_special_tokens: detokenization options.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {value!r}")

        def integer(field: str, value: object, lo: int, hi: int, rule: str) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(field, value, "an integer")
            if not lo <= value <= hi:
                raise bad(field, value, rule)

        def number(field: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(field, value, "a number")
            if not math.isfinite(value):
                raise bad(field, value, "a finite number")
            return float(value)

        integer("n", self.n, 1, INT64_MAX, "an integer >= 1")
        if number("temperature", self.temperature) < 0.0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        integer("top_k", self.top_k, -1, INT64_MAX, "-1 or 0 (disabled) or >= 1")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= number("presence_penalty", self.presence_penalty) <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= number("frequency_penalty", self.frequency_penalty) <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if number("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1, INT64_MAX, f">= 1 and <= {INT64_MAX}")
        integer("min_tokens", self.min_tokens, 0, INT64_MAX, f">= 0 and <= {INT64_MAX}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, INT64_MAX, ">= 0")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet; leave it unset")
        if self.stop is not None and (
            not isinstance(self.stop, list)
            or any(not isinstance(s, str) or s == "" for s in self.stop)
        ):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids")
            for t in self.stop_token_ids:
                integer("stop_token_ids", t, 0, INT64_MAX, f"token ids in [0, {INT64_MAX}]")
        if self.seed is not None:
            integer("seed", self.seed, INT64_MIN, INT64_MAX, f"in [{INT64_MIN}, {INT64_MAX}]")
            # Sample i of n is seeded seed + i (so the samples differ): that must fit too.
            if self.seed + self.n - 1 > INT64_MAX:
                raise bad("seed", self.seed, f"<= {INT64_MAX} - (n - 1) with n={self.n}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "true or false")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop) if self.stop else []

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **changes)
