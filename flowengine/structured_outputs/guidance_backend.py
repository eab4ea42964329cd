"""The llguidance backend (https://github.com/guidance-ai/llguidance), vLLM's "guidance".

llguidance computes each mask lazily from a lexer and an Earley parser (no per-grammar
precompute), and implements JSON-schema keywords that xgrammar ignores (`not`,
`contains`, ...), so "auto" sends those schemas here.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from flowengine.structured_outputs.backend import (
    GrammarOptions,
    choice_to_ebnf,
    with_strict_formats,
)


class GuidanceMatcher:
    """A `GrammarMatcher` over `llguidance.LLMatcher`."""

    __slots__ = ("_m", "_eos_token_id")

    def __init__(self, matcher: Any, eos_token_id: int | None) -> None:
        self._m = matcher
        self._eos_token_id = eos_token_id

    def accept_token(self, token_id: int) -> bool:
        # NOTE: consuming a refused token puts an LLMatcher into an error state for
        # good; check first, so a refusal leaves the state unchanged (the interface).
        # validate_tokens does not count the tokenizer's EOS: it is valid where the
        # grammar accepts.
        if token_id == self._eos_token_id:
            if not self._m.is_accepting():
                return False
        elif self._m.validate_tokens([token_id]) != 1:
            return False
        return bool(self._m.consume_token(token_id)) and not self._m.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    @staticmethod
    def batch_fill_bitmask(matchers: list[GuidanceMatcher], bitmask: torch.Tensor,
                           rows: list[int], threads: int) -> None:
        """`fill_bitmask(bitmask, rows[i])` of each of `matchers` in one call, on
        `threads` of llguidance's threads (outside the GIL). `bitmask`: [R, W] int32,
        contiguous, CPU."""
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(_executor(threads),
                                    [(m._m, row) for m, row in zip(matchers, rows, strict=True)],
                                    bitmask)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()


_EXECUTORS: dict[int, Any] = {}


def _executor(threads: int) -> Any:
    """llguidance's `LLExecutor` with `threads` threads (one per thread count)."""
    executor = _EXECUTORS.get(threads)
    if executor is None:
        import llguidance

        executor = _EXECUTORS[threads] = llguidance.LLExecutor(num_threads=threads)
    return executor


class GuidanceGrammar:
    __slots__ = ("_prototype", "_eos_token_id")

    def __init__(self, prototype: Any, eos_token_id: int | None) -> None:
        self._prototype = prototype  # a matcher at the start state, copied per request
        self._eos_token_id = eos_token_id

    def new_matcher(self, stop_token_ids: list[int]) -> GuidanceMatcher:
        # NOTE: llguidance's stop token is the EOS given when the backend was built;
        # stop_token_ids cannot change it per request.
        return GuidanceMatcher(self._prototype.deep_copy(), self._eos_token_id)


def guidance_grammar(kind: str, spec: str, options: GrammarOptions) -> str:
    """The llguidance grammar text for (kind, spec); ValueError for structural tags."""
    import llguidance

    if kind == "json":
        # Formats llguidance matches too loosely (date: any Feb 29) become exact patterns.
        schema = with_strict_formats(json.loads(spec))
        if options.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": not options.disable_any_whitespace})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}',
            defaults={"whitespace_flexible": not options.disable_any_whitespace})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("grammar", choice_to_ebnf(json.loads(spec)))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)
    if kind == "structural_tag":
        raise ValueError("structured_outputs.structural_tag is not supported by the guidance "
                         "backend; serve with --structured-outputs-backend xgrammar (or auto)")
    raise ValueError(f"unknown structured output kind {kind!r}")


def _no_additional_properties(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where every object schema without additionalProperties gets false."""
    def fix(node: Any) -> Any:
        if isinstance(node, list):
            return [fix(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in ("enum", "const", "default", "examples") else fix(v))
               for k, v in node.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    return fix(schema)


def validate_guidance(kind: str, spec: str, options: GrammarOptions,
                      tokenizer: Any = None) -> str:
    """Check (kind, spec); returns the grammar text. Raises ValueError naming the field
    and llguidance's reason (an unsupported keyword is named by it)."""
    import llguidance

    try:
        grammar = guidance_grammar(kind, spec, options)
    except ValueError as exc:  # llguidance's own parse errors (e.g. GBNF to Lark)
        if str(exc).startswith("structured_outputs."):
            raise
        raise ValueError(f"structured_outputs.{kind} is invalid: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        reason = messages[0].strip()
        if "Unimplemented keys" in reason:
            raise ValueError(f"structured_outputs.{kind} uses a JSON-schema feature that is "
                             f"not supported ({reason}); drop it")
        raise ValueError(f"structured_outputs.{kind} is invalid: {reason}")
    return grammar


class GuidanceBackend:
    """Compiles constraints with llguidance for one tokenizer (args as XgrammarBackend;
    `eos_token_id`: the stop token the grammar allows where it may end)."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 eos_token_id: int | list[int] | None = None) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=eos_token_id)
        self.eos_token_id = self.ll_tokenizer.eos_token

    def compile(self, kind: str, spec: str, options: GrammarOptions) -> GuidanceGrammar:
        import llguidance

        grammar = validate_guidance(kind, spec, options, self.ll_tokenizer)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is invalid: {matcher.get_error()}")
        return GuidanceGrammar(matcher, self.eos_token_id)
