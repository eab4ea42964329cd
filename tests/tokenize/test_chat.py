"""apply_chat_template: exact ids, role mapping, validation errors."""

from __future__ import annotations

import pytest

from flowengine.tokenize.chat import apply_chat_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_WITH_DEVELOPER = "{# developer role supported #}" + CHATML
STRICT = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.first %}"
    "{{ raise_exception('Conversation must start with a user turn') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}"
)


@pytest.fixture
def chat_tokenizer(fresh_byte_bpe_tokenizer):
    fresh_byte_bpe_tokenizer.chat_template = CHATML
    return fresh_byte_bpe_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_exact_ids_with_generation_prompt(chat_tokenizer) -> None:
    tok = chat_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"}]
    ids = apply_chat_template(tok, messages)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 世界<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids == encode(tok, expected)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # a special token, one id
    no_prompt = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert no_prompt == encode(tok, expected.removesuffix("<|im_start|>assistant\n"))


def test_developer_becomes_system_when_template_lacks_it(chat_tokenizer) -> None:
    messages = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Q"}]
    ids = apply_chat_template(chat_tokenizer, messages, add_generation_prompt=False)
    expected = "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
    assert ids == encode(chat_tokenizer, expected)
    assert messages[0]["role"] == "developer"  # the caller's list is not modified


def test_developer_kept_when_template_knows_it(chat_tokenizer) -> None:
    chat_tokenizer.chat_template = CHATML_WITH_DEVELOPER
    messages = [{"role": "developer", "content": "Rules."}]
    ids = apply_chat_template(chat_tokenizer, messages, add_generation_prompt=False)
    assert ids == encode(chat_tokenizer, "<|im_start|>developer\nRules.<|im_end|>\n")


def test_text_parts_are_joined_with_newlines(chat_tokenizer) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    ids = apply_chat_template(chat_tokenizer, [{"role": "user", "content": parts}], False)
    assert ids == encode(chat_tokenizer, "<|im_start|>user\none\ntwo<|im_end|>\n")


def test_no_chat_template_is_a_clear_error(byte_bpe_tokenizer) -> None:
    assert byte_bpe_tokenizer.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(byte_bpe_tokenizer, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages is empty"),
        ("hello", "must be a list"),
        (None, "must be a list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\] must have both"),
        ([{"content": "x"}], r"messages\[0\] must have both"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\.role must be one of",
        ),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\]\.content\[0\] must be a text part",
        ),
    ],
)
def test_malformed_messages(chat_tokenizer, messages, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_chat_template(chat_tokenizer, messages)


def test_template_rejection_becomes_value_error(chat_tokenizer) -> None:
    chat_tokenizer.chat_template = STRICT
    with pytest.raises(ValueError, match="rejected these messages: Conversation must start"):
        apply_chat_template(chat_tokenizer, [{"role": "assistant", "content": "hi"}])


def test_assistant_without_content_is_allowed(chat_tokenizer) -> None:
    # OpenAI allows content None on an assistant turn that carries tool calls.
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    ids = apply_chat_template(chat_tokenizer, messages, add_generation_prompt=False)
    expected = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    assert ids == encode(chat_tokenizer, expected)
