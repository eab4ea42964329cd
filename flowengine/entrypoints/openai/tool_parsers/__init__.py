"""Tool-call parsers by name, as vLLM's `--tool-call-parser` (see base.py for the
rules they share). `get_tool_parser(name)` returns the class; a request makes one
instance per choice."""

from __future__ import annotations

from flowengine.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    join_deltas,
)
from flowengine.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from flowengine.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from flowengine.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from flowengine.entrypoints.openai.tool_parsers.whole_json import (
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of `--tool-call-parser NAME`. Raises ValueError naming the
    choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "NamedToolParser", "ParsedDelta",
    "RequiredToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "get_tool_parser",
    "join_deltas",
]  # fmt: skip
