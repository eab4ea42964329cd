"""Chat-template options (vLLM's names): --chat-template text or file,
chat_template_kwargs, add_generation_prompt, continue_final_message; exact ids."""

from __future__ import annotations

import pytest

from flowengine.engine.input_processor import InputProcessor
from flowengine.tokenize.chat import apply_chat_template, load_chat_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer"}]


@pytest.fixture
def tok(fresh_byte_bpe_tokenizer):
    fresh_byte_bpe_tokenizer.chat_template = CHATML
    return fresh_byte_bpe_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(tok) -> None:
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    messages = MESSAGES[:1]
    assert apply_chat_template(tok, messages) == encode(tok, base)
    off = apply_chat_template(tok, messages, chat_template_kwargs={"enable_thinking": False})
    assert off == encode(tok, base + "<think></think>")
    on = apply_chat_template(tok, messages, chat_template_kwargs={"enable_thinking": True})
    assert on == encode(tok, base)


def test_continue_final_message_leaves_the_last_turn_open(tok) -> None:
    ids = apply_chat_template(tok, MESSAGES, add_generation_prompt=False,
                              continue_final_message=True)
    assert ids == encode(tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer")
    closed = apply_chat_template(tok, MESSAGES, add_generation_prompt=False)
    assert closed == encode(
        tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer<|im_end|>\n"
    )


def test_option_conflicts_are_errors(tok) -> None:
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and "
                                         "`add_generation_prompt` to True"):
        apply_chat_template(tok, MESSAGES, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        apply_chat_template(tok, MESSAGES, chat_template_kwargs={"tokenize": True})


def test_a_given_template_replaces_the_tokenizers(byte_bpe_tokenizer) -> None:
    # byte_bpe_tokenizer has no chat template of its own
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(byte_bpe_tokenizer, MESSAGES[:1])
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ids = apply_chat_template(byte_bpe_tokenizer, MESSAGES[:1], chat_template=template)
    assert ids == encode(byte_bpe_tokenizer, "[user]Hi")


def test_load_chat_template_file_text_and_bad_path(tmp_path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(str(file)) == "{{ messages[0]['content'] }}!"
    assert load_chat_template(file) == "{{ messages[0]['content'] }}!"
    # a literal with Jinja characters; backslash escapes are decoded, as vLLM does
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_input_processor_uses_engine_then_request_template(tok) -> None:
    ip = InputProcessor(tok, max_model_len=512, vocab_size=len(tok), eos_token_id=None,
                        chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert ip.chat_prompt(MESSAGES[:1]) == ("<Hi>", encode(tok, "<Hi>"))
    text, ids = ip.chat_request({"messages": MESSAGES[:1], "chat_template": "={{ messages|length }}",
                                 "cache_salt": "s"})
    assert (text, ids) == ("=1", encode(tok, "=1"))
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        ip.chat_request({"messages": MESSAGES, "chat_template_kwargs": ["x"]})
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        ip.chat_prompt(MESSAGES, add_generation_prompt="no")
    with pytest.raises(ValueError, match="non-empty list"):
        ip.chat_request({"messages": []})
