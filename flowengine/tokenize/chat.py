"""Chat messages -> prompt token ids through the model's own chat template.

Validation happens here, before Jinja, so that a caller learns what to change
("messages[1].role must be one of ...") instead of reading a template traceback.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from flowengine.tokenize.tool_check import ToolError, check_function_name, check_parameters

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


# apply_chat_template's own arguments: a chat_template_kwargs key may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def load_chat_template(value: str | Path | None) -> str | None:
    """A `--chat-template` value as template text (vLLM's `load_chat_template` rule).

    A path that opens is read; otherwise a string holding any of the Jinja characters
    `{`, `}` or a newline is the template itself (with backslash escapes such as `\\n`
    decoded). The text is compiled as transformers' apply_chat_template compiles it, so
    that a broken template fails here, at start-up, not in every chat request.

    Raises ValueError for a string that looks like a path but does not open, and for
    text that is not a valid Jinja template (the message names the line).
    """
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text, source = f.read(), f"file {str(value)!r}"
    except OSError as err:
        if isinstance(value, Path) or not any(c in value for c in "{}\n"):
            raise ValueError(
                f"the chat template {str(value)!r} looks like a file path, but it cannot "
                f"be opened ({err}); give an existing file or the template text"
            ) from err
        text, source = codecs.decode(value, "unicode_escape"), "text"
    try:
        _compile_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(
            f"the chat template {source} is not a valid Jinja template: {err.message} "
            f"(line {err.lineno}); fix it or give another --chat-template"
        ) from None
    return text


def _compile_template(text: str) -> None:
    """Compile `text` with transformers' own Jinja environment (sandbox, loopcontrols,
    its {% generation %} tag); plain Jinja syntax where that private helper is gone.
    Raises jinja2.TemplateSyntaxError."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


def _template_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> str:
    template = chat_template or tokenizer.chat_template
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
        message = {**message, "content": _content_text(i, role, message["content"])}
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(i, message)
        checked.append(message)
    return checked


def _tool_calls(index: int, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` with each `arguments` as a dict: chat
    templates render the arguments object themselves (Hugging Face's convention, and
    what vLLM passes them). Raises ValueError naming the bad call."""
    calls = message["tool_calls"]
    where = f"messages[{index}].tool_calls"
    if message["role"] != "assistant":
        raise ValueError(f"{where}: only assistant messages carry tool_calls")
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f'{where}[{j}] must have "function": {{"name": ..., "arguments": ...}}')
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}[{j}].function.arguments is not valid JSON ({err.msg}); send "
                    "the arguments object as JSON text"
                ) from None
        if not isinstance(arguments, Mapping):
            raise ValueError(
                f"{where}[{j}].function.arguments must be an object (or JSON text of one), "
                f"got {type(arguments).__name__}"
            )
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check `tools` for the chat template: a list of OpenAI function tools
    ({"type": "function", "function": {"name": ..., "parameters": {...}}}), by the
    server's rules (flowengine/tokenize/tool_check.py: names, unique, `parameters` a
    JSON Schema of an object). Raises ValueError (a `ToolError`, `.param` the field)
    naming the first bad tool."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type", "function") != "function":
            raise ToolError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}}', f"tools[{i}]")
        check_function_name(i, fn.get("name"), seen)
        if fn.get("parameters") is not None:
            check_parameters(i, fn["name"], fn["parameters"])
    return [dict(t) for t in tools]


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Render `messages` with the chat template and tokenize the result.

    The template already writes the special tokens the model expects (BOS, turn
    markers), so the text is encoded with add_special_tokens=False, as Hugging Face's
    `apply_chat_template(tokenize=True)` does. Role "developer" (OpenAI's newer name
    for system) becomes "system" when the template never mentions "developer".

    add_generation_prompt appends the assistant turn header; continue_final_message
    leaves the last message open (no end-of-turn marker) so the model continues it
    (vLLM's and Hugging Face's names; both true is an error). chat_template: template
    text instead of the tokenizer's. chat_template_kwargs: extra variables for the
    template, e.g. {"enable_thinking": False} (Qwen3); a key naming one of
    apply_chat_template's own arguments (RESERVED_TEMPLATE_KWARGS) is an error.
    tools: OpenAI function tools, given to the template as its `tools` variable (a
    template that ignores them, such as SmolLM2's own, renders without them: pass a
    tool-capable one, e.g. examples/templates/tool_chat_template_hermes.jinja).
    Assistant messages' `tool_calls` reach the template with dict arguments.

    Returns the prompt token ids. Raises ValueError when there is no chat template,
    when `messages` is malformed (see `validate_messages`), for the option conflicts
    above, or when the template rejects the conversation (e.g. roles that do not
    alternate).
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: these are options of "
            "the request itself, not template variables"
        )
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; "
            "send a completion prompt (/v1/completions, LLM.generate) instead, "
            "or use a model that ships a chat template"
        )
    checked = validate_messages(messages)
    if "developer" not in _template_text(tokenizer, chat_template):
        for message in checked:
            if message["role"] == "developer":
                message["role"] = "system"
    try:
        # Options passed only when set: the call stays the plain one otherwise.
        if chat_template:
            kwargs["chat_template"] = chat_template
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None:
            kwargs["tools"] = validate_tools(tools)
        text = tokenizer.apply_chat_template(
            checked, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template rejected these messages: {e}") from e
    except TypeError as e:
        # e.g. a chat_template_kwargs key this tokenizer's apply_chat_template refuses
        raise ValueError(f"the chat template cannot be applied with these options: {e}") from e
    return encode_text(tokenizer, text, "the chat messages", add_special_tokens=False)


def encode_text(tokenizer: Any, text: str, what: str, **kwargs: Any) -> list[int]:
    """`tokenizer.encode(text, **kwargs)` as a list. Raises ValueError naming `what` when
    `text` holds a lone surrogate (a str that is not Unicode text: the fast tokenizers
    refuse it with an obscure TypeError); checked only when encode fails, so the usual
    call costs nothing more."""
    try:
        return list(tokenizer.encode(text, **kwargs))
    except TypeError:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{what}: not valid Unicode text, a lone surrogate "
                f"{text[exc.start]!r} at character {exc.start}") from None
        raise
