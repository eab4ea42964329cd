"""The chat route's output parsing: reasoning (`--reasoning-parser`), then tool calls
(`--tool-call-parser` for `tool_choice=auto`, the fixed formats of `required` and a
named function), one `ChoiceParser` per choice.

Text goes through the reasoning parser first; what it passes as content goes through
the tool parser. Both are incremental and hold back only what may still be a marker,
so a streamed choice's deltas join to exactly the non-streamed message (which is the
same machine fed the whole text). Pure logic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowengine.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)
from flowengine.entrypoints.openai.tool_parsers.base import add_piece
from flowengine.entrypoints.openai.tool_parsers.request import ToolChoice
from flowengine.reasoning import ThinkReasoningParser, get_reasoning_parser


@dataclass(frozen=True)
class ChatParsingOptions:
    """The server's parsing flags (vLLM's names).

    Attributes:
        tool_call_parser: `--tool-call-parser` (hermes, llama3_json, mistral, pythonic).
        enable_auto_tool_choice: `--enable-auto-tool-choice`: `tool_choice=auto` (the
            default with tools) is parsed; without it such a request is a 400.
        reasoning_parser: `--reasoning-parser` (qwen3, deepseek_r1).
        exclude_tools_when_tool_choice_none: `--exclude-tools-when-tool-choice-none`:
            with tool_choice "none" the template is rendered without the tools.
    Raises ValueError for an unknown parser name, or auto tool choice without a parser.
    """

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def auto_enabled(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def tool_parser_class(self, choice: ToolChoice) -> type[ToolParser] | None:
        """The parser class a request's tool choice uses, None for plain content."""
        if choice.mode == "auto":
            assert self.tool_call_parser is not None
            return get_tool_parser(self.tool_call_parser)
        if choice.mode == "required":
            return RequiredToolParser
        if choice.mode == "named":
            return NamedToolParser
        return None

    def parser_factory(self, choice: ToolChoice) -> Callable[[str | None], ChoiceParser] | None:
        """Makes one `ChoiceParser` per choice (given the prompt text), or None when the
        output is plain content."""
        tool_cls = self.tool_parser_class(choice)
        reasoning_cls = (
            get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        )
        if tool_cls is None and reasoning_cls is None:
            return None

        def make_tools() -> ToolParser:
            assert tool_cls is not None
            if tool_cls is NamedToolParser:
                return NamedToolParser(choice.function_name or "")
            return tool_cls()

        def make(prompt: str | None) -> ChoiceParser:
            return ChoiceParser(
                reasoning_cls(prompt) if reasoning_cls else None,
                make_tools() if tool_cls else None,
                choice,
            )

        return make


@dataclass
class ChoiceDelta:
    """What one choice may send now: reasoning text, content text, tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChoiceDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for piece in other.tool_calls:
            add_piece(self.tool_calls, piece)

    def delta_json(self) -> dict[str, Any]:
        """OpenAI's (and vLLM's, for `reasoning_content`) `delta` object."""
        body: dict[str, Any] = {}
        if self.reasoning:
            body["reasoning_content"] = self.reasoning
        if self.content:
            body["content"] = self.content
        if self.tool_calls:
            body["tool_calls"] = [d.to_json() for d in self.tool_calls]
        return body


class ChoiceParser:
    """Reasoning, then tool calls, for one choice (see the module docstring)."""

    def __init__(
        self,
        reasoning: ThinkReasoningParser | None,
        tools: ToolParser | None,
        choice: ToolChoice,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.choice = choice
        self.num_tool_calls = 0  # tool calls reported

    def feed(self, text: str) -> ChoiceDelta:
        if self.reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self.reasoning.feed(text)
        out = ChoiceDelta(reasoning=reasoning)
        out.extend(self._content(content, final=False))
        return out

    def finish(self) -> ChoiceDelta:
        out = ChoiceDelta()
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            out.reasoning = reasoning
            out.extend(self._content(content, final=True))
        else:
            out.extend(self._content("", final=True))
        return out

    def _content(self, text: str, final: bool) -> ChoiceDelta:
        if self.tools is None:
            return ChoiceDelta(content=text)
        parsed = self.tools.feed(text) if text else None
        out = ChoiceDelta()
        if parsed is not None:
            out.content, out.tool_calls = parsed.content, parsed.tool_calls
        if final:
            rest = self.tools.finish()
            out.content += rest.content
            for piece in rest.tool_calls:
                add_piece(out.tool_calls, piece)
        if not self.choice.parallel_tool_calls:  # OpenAI: at most one call
            out.tool_calls = [d for d in out.tool_calls if d.index == 0]
        self.num_tool_calls = max(
            [self.num_tool_calls, *(d.index + 1 for d in out.tool_calls)]
        )
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling
        tools (auto or required; a named function's stays "stop", as OpenAI's), the
        engine's reason otherwise (a cut by max_tokens stays "length")."""
        if engine_reason == "stop" and self.num_tool_calls and self.choice.mode != "named":
            return "tool_calls"
        return engine_reason


def join_choice(deltas: list[ChoiceDelta]) -> dict[str, Any]:
    """The non-streamed assistant message of a choice's deltas: role, content (null
    when the model only called tools or only reasoned, as vLLM), `tool_calls` when it
    called any, `reasoning_content` when it reasoned."""
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                call = calls[piece.index] = {
                    "id": piece.id, "type": "function",
                    "function": {"name": piece.name, "arguments": ""},
                }  # fmt: skip
            call["function"]["arguments"] += piece.arguments
    message: dict[str, Any] = {
        "role": "assistant", "content": content or (None if calls or reasoning else "")}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
