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

import enum
import json as _json
import math
from typing import Any

import msgspec

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Below this temperature sampling is treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds (vLLM's `RequestOutputKind`).

    - CUMULATIVE: everything so far (text, token ids, logprobs from the first token),
      one output per step; the last one is the whole result.
    - DELTA: only what is new since the previous output (a stream: joining the texts
      and token ids of every output gives the whole result).
    - FINAL_ONLY: one output, when the request finished, with the whole result.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The kinds of constraint, in vLLM's field order (StructuredOutputsParams).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the generated text (vLLM's `StructuredOutputsParams`).

    Exactly one kind is set:

    - json: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it.
    - regex: a regular expression the whole output matches.
    - choice: a non-empty list of strings; the output is exactly one of them.
    - grammar: a context-free grammar, EBNF/GBNF (`root ::= ...`) or Lark.
    - json_object: True: any JSON object (OpenAI's `response_format: json_object`).
    - structural_tag: xgrammar's structural tag (a dict, or its JSON text), e.g.
      free text with tool calls whose arguments follow a schema.

    Options: disable_any_whitespace (JSON without whitespace between tokens),
    disable_additional_properties (a schema's objects take no properties beyond the
    listed ones unless the schema says so), as vLLM names them.

    Construction checks only the shape of each field (ValueError naming the field);
    the engine compiles the constraint before anything is generated and raises
    ValueError naming the field for an invalid schema, regex or grammar
    (flowengine/structured_outputs/).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS
                     if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                f"{', '.join(set_kinds) if set_kinds else 'none'}"
            )
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{kind} is not valid JSON: {exc}") from None
                if not isinstance(parsed, dict) and not (kind == "json" and isinstance(parsed, bool)):
                    raise ValueError(f"structured_outputs.{kind} must be a JSON object")
            elif not isinstance(value, dict):
                raise ValueError(f"structured_outputs.{kind} must be a JSON object or its "
                                 f"JSON text, got {type(value).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(value, list) or not value
                    or any(not isinstance(c, str) for c in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        elif value is not True:
            raise ValueError("structured_outputs.json_object must be true")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false")

    @property
    def kind(self) -> str:
        """The one kind that is set ("json", "regex", "choice", "grammar",
        "json_object" or "structural_tag")."""
        for k in STRUCTURED_OUTPUT_KINDS:
            value = getattr(self, k)
            if value is not None and value is not False:
                return k
        raise AssertionError("unreachable: __post_init__ checks one kind is set")

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: the cache key of its compiled
        grammar with `kind` (JSON kinds re-serialized compactly, so the same schema
        as a dict or as JSON text compiles once).

        NOTE: keys keep their order: a schema's `properties` order is the order in
        which the backends generate them (e.g. "reasoning" before "answer"), so
        sorting them would change the output."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                value = _json.loads(value)
            return _json.dumps(value, separators=(",", ":"))
        if kind == "choice":
            return _json.dumps(value, ensure_ascii=False)
        if kind == "json_object":
            return ""
        return value


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample the tokens of one request.

    Fields follow vLLM's `SamplingParams` (same names, same meaning):

    - n: number of completions for the prompt (>= 1); they share the prompt's KV blocks.
      The engine's input processor refuses n over 16384 (vLLM's VLLM_MAX_N_SEQUENCES
      default, `input_processor.MAX_N_SEQUENCES`).
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
      token's), None for none, -1 for the whole vocabulary (the engine's max_logprobs
      must allow it: -1 or >= the vocabulary size).
    - prompt_logprobs: the same for every prompt token after the first (the first has
      None); -1 for the whole vocabulary.
    - detokenize: False returns token ids only (text ""); stop strings need text.
    - skip_special_tokens, spaces_between_special_tokens: detokenization options.
    - truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1; -1 = as many
      as fit with one generated token, max_model_len - 1), None to keep them all.
    - logit_bias: token id -> bias in [-100, 100] added to that token's logit before
      sampling (OpenAI's definition; -100 effectively bans, 100 effectively forces).
    - allowed_token_ids: only these ids may be sampled (non-empty list).
    - bad_words: words that may not be generated. Each is tokenized with and without a
      leading space; a one-token word is always banned, a longer one bans its last
      token when the generated tokens end with the rest (vLLM's rule).
    - extra_args: a dict passed through untouched, for custom code (vLLM's field).
    - structured_outputs: a `StructuredOutputsParams` constraint (JSON schema, regex,
      choice, grammar, any JSON object, structural tag), or None.
    - output_kind: a `RequestOutputKind`, what each output of the request holds
      (CUMULATIVE by default, as vLLM; `AsyncEngine.submit(output_kind=...)` sets it).

    `bad_words_token_ids` is filled in by the engine's input processor (the tokenized
    `bad_words`); callers leave it unset. Token ids in logit_bias, allowed_token_ids
    and bad words are checked against the vocabulary there (ValueError).
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
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words_token_ids: list[list[int]] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                integer(name, value, -1, INT64_MAX, ">= 0, or -1 for the whole vocabulary")
        if self.truncate_prompt_tokens is not None:
            integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, INT64_MAX,
                    ">= 1, or -1 for max_model_len")
            if self.truncate_prompt_tokens == 0:
                raise bad("truncate_prompt_tokens", 0, ">= 1, or -1 for max_model_len")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a dict of token id -> bias")
            for token_id, bias in self.logit_bias.items():
                integer("logit_bias", token_id, 0, INT64_MAX, "keyed by token ids >= 0")
                if not -100.0 <= number("logit_bias", bias) <= 100.0:
                    raise bad(f"logit_bias[{token_id}]", bias, "in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", self.allowed_token_ids,
                          "a non-empty list of token ids")
            for t in self.allowed_token_ids:
                integer("allowed_token_ids", t, 0, INT64_MAX, f"token ids in [0, {INT64_MAX}]")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "a list of non-blank strings")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, list) or any(
                not isinstance(w, list) or not w for w in self.bad_words_token_ids
            ):
                raise bad("bad_words_token_ids", self.bad_words_token_ids,
                          "a list of non-empty token-id lists")
            for word in self.bad_words_token_ids:
                for t in word:
                    integer("bad_words_token_ids", t, 0, INT64_MAX,
                            f"token ids in [0, {INT64_MAX}]")
        if self.extra_args is not None and (
            not isinstance(self.extra_args, dict)
            or any(not isinstance(k, str) for k in self.extra_args)
        ):
            raise bad("extra_args", self.extra_args, "a dict with string keys")
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
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "true or false")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs,
                      "a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            if isinstance(self.output_kind, bool) or self.output_kind not in (0, 1, 2):
                raise bad("output_kind", self.output_kind,
                          "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
            self.output_kind = RequestOutputKind(self.output_kind)
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are matched on the "
                             "text); use stop_token_ids or drop detokenize=False")

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
