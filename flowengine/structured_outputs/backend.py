"""The interface between the engine and a grammar library (xgrammar, llguidance).

A backend is built once per tokenizer (its token table is the expensive part) and
compiles a constraint, given as (kind, spec) of a `StructuredOutputsParams`, into a
`CompiledGrammar`; each request (each of n samples) gets its own `GrammarMatcher`
from it. The token bitmask is vLLM's and xgrammar's layout: int32 words
`[num_rows, ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set when token `t`
may come next.

Which backend serves a constraint is decided by `select_backend`, the one rule the
frontend's validation (validate.py) and the engine's compiler (manager.py) share.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Protocol

import torch

BackendName = Literal["auto", "xgrammar", "guidance"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "xgrammar", "guidance")


class GrammarMatcher(Protocol):
    """The state of one sequence in its grammar; not thread-safe (one owner)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar
        forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` ([R, W] int32, CPU)."""
        ...

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or the grammar cannot continue)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""
        ...

    def reset(self) -> None:
        """Back to the start of the grammar."""
        ...


class CompiledGrammar(Protocol):
    def new_matcher(self, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher; `stop_token_ids` end the output where the grammar may end
        (EOS is allowed only there)."""
        ...


class StructuredOutputBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, kind: str, spec: str, options: GrammarOptions) -> CompiledGrammar:
        """Compile (kind, spec); raises ValueError naming what is wrong."""
        ...


class GrammarOptions(tuple):
    """(disable_any_whitespace, disable_additional_properties), hashable for the cache."""

    def __new__(cls, disable_any_whitespace: bool = False,
                disable_additional_properties: bool = False) -> GrammarOptions:
        return super().__new__(cls, (disable_any_whitespace, disable_additional_properties))

    @property
    def disable_any_whitespace(self) -> bool:
        return self[0]

    @property
    def disable_additional_properties(self) -> bool:
        return self[1]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


# JSON-schema keywords that xgrammar's converter ignores without an error (it would
# then accept outputs the schema forbids; checked against xgrammar 0.2.9). A schema
# using one of them goes to llguidance under "auto", and is refused by name under
# "xgrammar". multipleOf is honoured for integers only. uniqueItems (only when true:
# false asks for nothing) is not implemented by llguidance either, so it is refused.
_XGRAMMAR_UNSUPPORTED = frozenset({
    "not", "contains", "minContains", "maxContains", "if", "then", "else",
    "dependentSchemas", "multipleOf", "uniqueItems",
})
# Keys whose values are user data, not subschemas: not walked for keywords.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required", "description",
                        "title", "$comment"})
_NAMED_SUBSCHEMAS = frozenset({"properties", "$defs", "definitions", "patternProperties",
                               "dependentSchemas"})


def unsupported_json_features(schema: Any, unsupported: frozenset[str] = _XGRAMMAR_UNSUPPORTED,
                              ) -> list[str]:
    """The keywords of `schema` (a parsed JSON schema) in `unsupported`, sorted; also
    "format with minLength/maxLength" and "pattern with minLength/maxLength" (xgrammar
    drops the length bounds of a string that has a format or a pattern), and "allOf"
    of several schemas (xgrammar takes any one of them, as anyOf)."""
    found: set[str] = set()

    def walk(node: Any, named: bool = False) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            if named:  # property names are data, their values are subschemas
                walk(value)
                continue
            if key in _DATA_KEYS:
                continue
            if key in unsupported and not (key == "multipleOf"
                                           and node.get("type") == "integer") and not (
                    key == "uniqueItems" and value is False):
                found.add(key)
            if key in ("format", "pattern") and ("minLength" in node or "maxLength" in node):
                found.add(f"{key} with minLength/maxLength")
            if key == "allOf" and isinstance(value, list) and len(value) > 1:
                found.add("allOf")
            walk(value, named=key in _NAMED_SUBSCHEMAS)

    walk(schema)
    return sorted(found)


_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)"
              "|(0[13578]|1[02])-31)")
# Exact patterns of the string formats whose xgrammar grammar is looser than the format's
# definition (checked against xgrammar 0.2.9: ipv4 takes octets with leading zeros,
# "date" any day 01-31 of any month and year 0000). ipv4: RFC 2673's dotted quad
# without leading zeros (Python's ipaddress, which jsonschema's format checker uses);
# date: RFC 3339 full-date, years 0001-9999 (Python's date.fromisoformat), Gregorian
# leap years.
STRICT_FORMAT_PATTERNS = {
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
    "date": f"^({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$",
}


def with_strict_formats(schema: Any) -> Any:
    """`schema` with each `format` of STRICT_FORMAT_PATTERNS on a node without its own
    `pattern` replaced by that exact pattern (a copy; the input is not changed)."""
    if isinstance(schema, list):
        return [with_strict_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            out[key] = {name: with_strict_formats(sub) for name, sub in value.items()}
        else:
            out[key] = with_strict_formats(value)
    pattern = STRICT_FORMAT_PATTERNS.get(out.get("format")) if isinstance(
        out.get("format"), str) else None
    if pattern is not None and "pattern" not in out:
        del out["format"]
        out["pattern"] = pattern
    return out


def select_backend(configured: str, kind: str, spec: str) -> str:
    """The backend that compiles (kind, spec): `configured` unless it is "auto", which
    takes xgrammar (vLLM's default) and llguidance for the JSON schemas whose keywords
    xgrammar would ignore (vLLM's fallback rule)."""
    if configured != "auto":
        return configured
    if kind == "json" and unsupported_json_features(json.loads(spec)):
        return "guidance"
    return "xgrammar"


def choice_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes, which
    xgrammar's and GBNF's string literals share). Characters other than controls,
    quotes and backslashes stay themselves: a JSON escape of one past U+FFFF is a
    surrogate pair, which both grammars read as two (invalid) code points."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """EBNF/GBNF rules use `::=`; Lark rules use `:` (vLLM tells them apart the same way)."""
    return "::=" not in grammar
