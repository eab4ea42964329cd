"""Chat messages -> prompt token ids through the model's own chat template.

Validation happens here, before Jinja, so that a caller learns what to change
("messages[1].role must be one of ...") instead of reading a template traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(index: int, role: str, content: Any) -> str | None:
    """A message's content as one string: OpenAI's text parts are joined by newlines
    (vLLM's "string" content format); None is allowed for assistant turns that carry
    tool calls."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return None
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(
                    f"messages[{index}].content[{j}] must be a text part "
                    '{"type": "text", "text": ...}; other content types are not supported'
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{j}].text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def _template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    if isinstance(template, Mapping):  # named templates: "default", "tool_use", ...
        return "\n".join(str(t) for t in template.values())
    return str(template)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check `messages` and return shallow copies with text content.

    Each message is a mapping with "role" (one of ROLES) and "content" (a string,
    a list of {"type": "text", "text": str} parts, or None for an assistant turn);
    other keys (name, tool_calls, tool_call_id) pass through.
    Raises ValueError naming the first offending message.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(
            'messages must be a list of {"role": ..., "content": ...} dicts, '
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; give at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f'messages[{i}] must be a dict with "role" and "content", '
                f"got {type(message).__name__}"
            )
        if "role" not in message or "content" not in message:
            raise ValueError(f'messages[{i}] must have both "role" and "content" keys')
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        checked.append({**message, "content": _content_text(i, role, message["content"])})
    return checked


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render `messages` with the tokenizer's chat template and tokenize the result.

    The template already writes the special tokens the model expects (BOS, turn
    markers), so the text is encoded with add_special_tokens=False, as Hugging Face's
    `apply_chat_template(tokenize=True)` does. Role "developer" (OpenAI's newer name
    for system) becomes "system" when the template never mentions "developer".
    add_generation_prompt appends the assistant turn header.

    Returns the prompt token ids. Raises ValueError when the tokenizer has no chat
    template, when `messages` is malformed (see `validate_messages`), or when the
    template rejects the conversation (for example roles that do not alternate).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
            "send a completion prompt (/v1/completions, LLM.generate) instead, "
            "or use a model that ships a chat template"
        )
    checked = validate_messages(messages)
    if "developer" not in _template_text(tokenizer):
        for message in checked:
            if message["role"] == "developer":
                message["role"] = "system"
    try:
        text = tokenizer.apply_chat_template(
            checked, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template rejected these messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))
