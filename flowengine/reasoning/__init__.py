"""Reasoning parsers by name (vLLM's `--reasoning-parser`): they split a model's
output into `reasoning_content` and `content`. Pure logic, shared by the serving layer
(flowengine/entrypoints/openai/serving_chat.py)."""

from __future__ import annotations

from flowengine.reasoning.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ThinkReasoningParser]:
    """The parser class of `--reasoning-parser NAME`. Raises ValueError naming the choices."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


__all__ = ["REASONING_PARSERS", "ThinkReasoningParser", "get_reasoning_parser"]
