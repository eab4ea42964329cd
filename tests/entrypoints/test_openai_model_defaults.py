"""Model sampling defaults (generation_config.json) and chat-template options on the
OpenAI routes, through the `openai` SDK (`extra_body`): request > model defaults >
SamplingParams defaults, and max_new_tokens caps max_tokens, as in vLLM."""

from __future__ import annotations

import openai
import pytest
from openai_helpers import assert_error

from flowengine import SamplingParams

HELLO = [{"role": "user", "content": "hi"}]
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 7}  # fmt: skip


@pytest.fixture
def defaults(engine):
    engine.default_sampling_params = dict(DEFAULTS)
    yield
    engine.default_sampling_params = {}


def test_completions_fill_unset_fields_from_the_model(client, engine, defaults) -> None:
    client.completions.create(model="fake-model", prompt="abc")
    assert engine.submitted[-1][2] == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
        max_tokens=7,  # min(16, the model's 7)
    )  # fmt: skip
    client.completions.create(model="fake-model", prompt="abc", temperature=0.0, top_p=0.5,
                              max_tokens=3, extra_body={"top_k": -1, "min_p": 0.0})
    assert engine.submitted[-1][2] == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=-1, min_p=0.0, repetition_penalty=1.1, max_tokens=3
    )
    client.completions.create(model="fake-model", prompt="abc", max_tokens=50)
    assert engine.submitted[-1][2].max_tokens == 7  # the model's max_new_tokens caps it


def test_chat_fills_unset_fields_from_the_model(client, engine, defaults) -> None:
    client.chat.completions.create(model="fake-model", messages=HELLO,
                                   extra_body={"repetition_penalty": 1.0})
    assert engine.submitted[-1][2] == SamplingParams(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.0, max_tokens=7
    )
    client.chat.completions.create(model="fake-model", messages=HELLO, max_completion_tokens=2)
    assert engine.submitted[-1][2].max_tokens == 2


def test_no_model_defaults_keeps_openai_defaults(client, engine) -> None:
    client.chat.completions.create(model="fake-model", messages=HELLO)
    assert engine.submitted[-1][2] == SamplingParams(max_tokens=None)
    client.completions.create(model="fake-model", prompt="abc")
    assert engine.submitted[-1][2] == SamplingParams(max_tokens=16)


def test_chat_template_options_reach_the_engine(client, engine) -> None:
    client.chat.completions.create(
        model="fake-model", messages=HELLO,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert engine.submitted[-1][1] == {
        "messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}
    }
    messages = [*HELLO, {"role": "assistant", "content": "The"}]
    client.chat.completions.create(
        model="fake-model", messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert engine.submitted[-1][1] == {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True
    }
    client.chat.completions.create(model="fake-model", messages=HELLO)
    assert engine.submitted[-1][1] == HELLO  # defaults: the plain conversation


def test_continue_final_message_with_generation_prompt_is_a_400(http, engine) -> None:
    num = len(engine.submitted)
    body = {"messages": HELLO, "continue_final_message": True}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400,
                       param="continue_final_message")
    assert err["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    bad = {"messages": HELLO, "chat_template_kwargs": ["x"]}
    assert http.post("/v1/chat/completions", json=bad).status_code == 400
    assert len(engine.submitted) == num


def test_sdk_sees_the_400(client) -> None:
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="fake-model", messages=HELLO, extra_body={"continue_final_message": True}
        )



def test_tokenize_refuses_continue_with_generation_prompt(http) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "ok"}]
    both = {"messages": messages, "continue_final_message": True}
    err = assert_error(http.post("/tokenize", json=both), 400)
    assert "Cannot set both" in err["message"]


def test_request_chat_template_needs_the_trust_flag(client, server, engine) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    num = len(engine.submitted)
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
        client.chat.completions.create(model="fake-model", messages=HELLO,
                                       extra_body={"chat_template": template})
    assert len(engine.submitted) == num
    server.server.context.trust_request_chat_template = True
    try:
        client.chat.completions.create(model="fake-model", messages=HELLO,
                                       extra_body={"chat_template": template})
    finally:
        server.server.context.trust_request_chat_template = False
    assert engine.submitted[-1][1] == {"messages": HELLO, "chat_template": template}
