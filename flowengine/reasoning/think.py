"""`<think>...</think>` reasoning: split a model's output into `reasoning_content`
and `content` (vLLM's `--reasoning-parser qwen3` and `deepseek_r1`).

- `deepseek_r1`: the output is reasoning until `</think>` (DeepSeek-R1's template
  opens `<think>` in the prompt, so the output may or may not repeat it); an output
  without `</think>` is all reasoning (vLLM's rule: the model never stopped thinking).
- `qwen3`: the output is reasoning when it starts with `<think>`, or when the prompt
  ends inside an open `<think>` (Qwen3 "thinking" templates that write the tag
  themselves); otherwise it is content (e.g. `enable_thinking=False`, whose prompt
  closes an empty think block). Reasoning ends at `</think>`.
The tags themselves are in neither part; what follows `</think>` is content as the
model wrote it. One parser per choice: `feed(text)` returns the (reasoning, content)
text that is certain now, holding back what may be the start of a tag; `finish()` the
rest. `extract` is the same machine fed the whole text, so streamed and non-streamed
splits are equal. Pure logic.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from flowengine.sampling_params import StructuredOutputsParams

START, END = "<think>", "</think>"


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkReasoningParser:
    """Base of the `<think>` parsers; `always_reasoning` says whether an output that
    does not open `<think>` itself starts in reasoning."""

    name: ClassVar[str] = ""
    always_reasoning: ClassVar[bool] = False

    def __init__(self, prompt: str | None = None) -> None:
        # The prompt may open the think block itself (its last tag is <think>).
        opened = prompt is not None and prompt.rfind(START) > prompt.rfind(END)
        self._starts_in_reasoning = self.always_reasoning or opened
        self._mode = "start"  # start | reasoning | content
        self._buf = ""

    @property
    def is_reasoning_end(self) -> bool:
        """The reasoning has ended (or never started): what follows is content."""
        return self._mode == "content"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning text, content text) released by this delta."""
        self._buf += text
        reasoning = content = ""
        if self._mode == "start":
            head = self._buf.lstrip()
            if START.startswith(head) and len(head) < len(START):
                return "", ""  # maybe <think>, arriving
            if head.startswith(START):
                self._buf = head[len(START):]
                self._mode = "reasoning"
            else:
                self._mode = "reasoning" if self._starts_in_reasoning else "content"
        if self._mode == "reasoning":
            at = self._buf.find(END)
            if at == -1:
                keep = _partial(self._buf, END)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(END):]
            self._mode = "content"
        if self._mode == "content":
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the output."""
        rest, self._buf = self._buf, ""
        if self._mode == "start":  # whitespace, or a partial "<think"
            return (rest, "") if self._starts_in_reasoning else ("", rest)
        if self._mode == "reasoning":
            return rest, ""
        return "", rest

    @classmethod
    def gated_structural_tag(cls, json_schema: dict[str, Any]) -> dict[str, Any]:
        """xgrammar's structural tag that lets the model reason before a JSON
        constraint applies: an optional `<think>...</think>` block (the whole text up to
        `</think>` for `always_reasoning`), whitespace, then JSON valid against
        `json_schema`. A structured output thus constrains only the content.

        NOTE: a qwen3 prompt that opens `<think>` itself is not seen here (the template
        is rendered later): the output must then open its own block or start the JSON.
        """
        value = {"type": "json_schema", "json_schema": json_schema}
        return cls._gated(value, {"type": "regex", "pattern": "[ \\t\\r\\n]*"})

    @classmethod
    def _gated(cls, value: dict[str, Any], space: dict[str, Any] | None) -> dict[str, Any]:
        """The structural tag: [think block, space (if any)] then `value` (a format)."""
        think = {"type": "tag", "begin": "" if cls.always_reasoning else START,
                 "content": {"type": "any_text"}, "end": END}
        after_thinking = {"type": "sequence",
                          "elements": [think, value] if space is None else [think, space, value]}
        if cls.always_reasoning:
            return {"type": "structural_tag", "format": after_thinking}
        return {"type": "structural_tag", "format": {"type": "or",
                                                      "elements": [after_thinking, value]}}

    @classmethod
    def gated_constraint(cls, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """`constraint` applied only after the think block, as a structural tag
        (`gated_structural_tag`'s shape): a JSON schema or any JSON object after
        optional whitespace (JSON allows it); a regex, choice or EBNF/Lark grammar right
        after `</think>` (vLLM's rule: the grammar starts with the first content token,
        so the content is exactly in its language). Returned unchanged: a structural
        tag (the caller's own format decides), and a JSON schema whose keywords only
        llguidance honours (`select_backend`): a structural tag compiles on xgrammar,
        which would ignore them, so validity wins and the schema applies from the
        first token.
        """
        from flowengine.structured_outputs.backend import is_lark, select_backend

        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            schema = json.loads(spec)
            if select_backend("auto", kind, spec) != "xgrammar":
                return constraint
            return StructuredOutputsParams(structural_tag=cls.gated_structural_tag(schema))
        if kind == "json_object":
            return StructuredOutputsParams(
                structural_tag=cls.gated_structural_tag({"type": "object"}))
        if kind == "regex":
            value: dict[str, Any] = {"type": "regex", "pattern": spec}
        elif kind == "choice":
            value = {"type": "or", "elements": [{"type": "const_string", "value": c}
                                                for c in json.loads(spec)]}
        elif kind == "grammar":
            value = {"type": "grammar", "grammar": spec,
                     "syntax": "lark" if is_lark(spec) else "ebnf"}
        else:
            return constraint
        return StructuredOutputsParams(structural_tag=cls._gated(value, None))

    @classmethod
    def extract(cls, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        parser = cls(prompt)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    always_reasoning = True
