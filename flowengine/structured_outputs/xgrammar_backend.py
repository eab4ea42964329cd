"""The xgrammar backend (https://github.com/mlc-ai/xgrammar; vLLM's and SGLang's default).

xgrammar compiles a grammar against the tokenizer's token table once (the compiled
grammar holds per-state token masks, "adaptive token mask cache"), so each step's
mask costs a few tens of microseconds per request.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from flowengine.structured_outputs.backend import (
    GrammarOptions,
    choice_to_ebnf,
    is_lark,
    unsupported_json_features,
    with_strict_formats,
)


class XgrammarMatcher:
    """A `GrammarMatcher` over `xgrammar.GrammarMatcher`.

    Calls go to the matcher's C++ handle directly: the Python wrapper adds a frame per
    call, and the scheduler makes one accept call per constrained request per step.
    """

    __slots__ = ("_m", "_h")

    # xgrammar terminates only by accepting a stop token (terminate_without_stop_token
    # is False), so a caller may skip is_terminated() after any other token.
    terminates_on_stop_token_only = True

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self._h = matcher._handle

    def accept_token(self, token_id: int) -> bool:
        return bool(self._h.accept_token(token_id, False))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._h.fill_next_token_bitmask(bitmask, row, False)

    @staticmethod
    def batch_fill_bitmask(matchers: list[XgrammarMatcher], bitmask: torch.Tensor,
                           rows: list[int], threads: int) -> None:
        """`fill_bitmask(bitmask, rows[i])` of each of `matchers`, in one call: xgrammar
        converts the tensor once (a row-by-row call converts it per row, most of a
        row's cost) and fills outside the GIL, on `threads` threads."""
        _batch_matcher(threads).batch_fill_next_token_bitmask(matchers_of(matchers), bitmask,
                                                              rows)

    @staticmethod
    def batch_accept_token(matchers: list[XgrammarMatcher], tokens: list[int]) -> list[Any]:
        """`accept_token(tokens[i])` of each of `matchers`, in one call (xgrammar's
        `BatchGrammarMatcher.batch_accept_token`: one library call, GIL released)."""
        return _batch_accept(matchers, tokens)

    def is_terminated(self) -> bool:
        return bool(self._h.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()


def matchers_of(matchers: list[XgrammarMatcher]) -> list[Any]:
    return [m._m for m in matchers]


_BATCH_MATCHERS: dict[int, Any] = {}


def _batch_accept(matchers: list[XgrammarMatcher], tokens: list[int]) -> list[Any]:
    """xgrammar's batched accept, called on the matchers' handles where its binding
    allows (the Python wrapper's conversion of the result costs more than the call);
    its flags (true when accepted) as a list."""
    global _BATCH_ACCEPT
    if _BATCH_ACCEPT is None:
        import xgrammar as xgr
        from xgrammar import matcher as xgr_matcher

        core = getattr(getattr(xgr_matcher, "_core", None), "BatchGrammarMatcher", None)
        if core is not None and hasattr(core, "batch_accept_token"):
            raw = core.batch_accept_token
            _BATCH_ACCEPT = lambda ms, ts: raw([m._h for m in ms], ts, False)  # noqa: E731
        else:
            _BATCH_ACCEPT = lambda ms, ts: xgr.BatchGrammarMatcher.batch_accept_token(  # noqa: E731
                matchers_of(ms), ts)
    return list(_BATCH_ACCEPT(matchers, tokens))  # 0/1 flags


_BATCH_ACCEPT: Any = None


def _batch_matcher(threads: int) -> Any:
    """xgrammar's `BatchGrammarMatcher` with `threads` threads (one per thread count;
    it keeps no per-call state)."""
    batch = _BATCH_MATCHERS.get(threads)
    if batch is None:
        import xgrammar as xgr

        batch = _BATCH_MATCHERS[threads] = xgr.BatchGrammarMatcher(threads)
    return batch


class XgrammarGrammar:
    __slots__ = ("_compiled",)

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self, stop_token_ids: list[int]) -> XgrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(
            self._compiled, override_stop_tokens=stop_token_ids or None))


class XgrammarBackend:
    """Compiles constraints with xgrammar for one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer; its token table (special and added tokens
            included) is read once here.
        vocab_size: the model's vocabulary size (the logits' width, which may exceed
            the tokenizer's: the extra ids are never allowed).
        max_threads: xgrammar's own compile threads per grammar.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_threads: int = 2) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    def compile(self, kind: str, spec: str, options: GrammarOptions) -> XgrammarGrammar:
        """Raises ValueError naming `structured_outputs.<kind>` and xgrammar's reason."""
        try:
            return XgrammarGrammar(self._compile(kind, spec, options))
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
            raise ValueError(f"structured_outputs.{kind} is invalid: {_reason(exc)}") from None

    def _compile(self, kind: str, spec: str, options: GrammarOptions) -> Any:
        c = self.compiler
        if kind == "json":
            schema = json.loads(spec)
            check_xgrammar_schema(schema)
            # Formats xgrammar matches too loosely become their exact patterns.
            return c.compile_json_schema(json.dumps(with_strict_formats(schema)),
                                         any_whitespace=not options.disable_any_whitespace,
                                         strict_mode=True)
        if kind == "json_object":
            # Any JSON object, as vLLM compiles it: xgrammar's builtin JSON grammar also
            # takes arrays (and ignores disable_any_whitespace).
            return c.compile_json_schema('{"type": "object"}',
                                         any_whitespace=not options.disable_any_whitespace)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_to_ebnf(json.loads(spec)))
        if kind == "grammar":
            return c.compile_lark(spec) if is_lark(spec) else c.compile_grammar(spec)
        if kind == "structural_tag":
            return c.compile_structural_tag(structural_tag_spec(spec))
        raise ValueError(f"unknown structured output kind {kind!r}")


def structural_tag_spec(spec: str) -> str:
    """A structural tag in xgrammar's current form (`{"type": "structural_tag",
    "format": ...}`): the older form vLLM also takes (`structures` of {begin, schema,
    end} plus `triggers`) becomes the `triggered_tags` format it means, as xgrammar's
    own `StructuralTag.from_legacy_structural_tag` converts it (the single-string
    `from_structural_tag` reads only the current form). Others are returned as given."""
    tag = json.loads(spec)
    if not isinstance(tag, dict) or "format" in tag or "structures" not in tag:
        return spec
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError("structured_outputs.structural_tag: structures and triggers must be "
                         "lists")
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not isinstance(item.get("begin"), str) \
                or not isinstance(item.get("end"), str):
            raise ValueError(f"structured_outputs.structural_tag: structures[{i}] needs begin "
                             "and end strings")
        schema = item.get("schema", {})
        if isinstance(schema, str):
            schema = json.loads(schema)
        tags.append({"begin": item["begin"], "end": item["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def check_xgrammar_schema(schema: Any) -> None:
    """Raise ValueError naming the keywords xgrammar would ignore in `schema`."""
    found = unsupported_json_features(schema)
    if found:
        raise ValueError(
            f"structured_outputs.json uses {', '.join(found)}, which the xgrammar backend "
            "does not support; drop it, or serve with --structured-outputs-backend "
            "guidance (or auto)"
        )


def validate_xgrammar(kind: str, spec: str, options: GrammarOptions) -> None:
    """Check (kind, spec) without a tokenizer (the frontend's check before a request
    enters the engine); raises ValueError naming the field and the reason."""
    import xgrammar as xgr

    try:
        if kind == "json":
            check_xgrammar_schema(json.loads(spec))
            xgr.Grammar.from_json_schema(spec, any_whitespace=not options.disable_any_whitespace,
                                         strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_to_ebnf(json.loads(spec)))
        elif kind == "grammar":
            if is_lark(spec):
                xgr.Grammar.from_lark(spec)
            else:
                xgr.Grammar.from_ebnf(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(structural_tag_spec(spec))
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: "; keep the message only.
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            text = rest
    return text.splitlines()[0] if text else type(exc).__name__
