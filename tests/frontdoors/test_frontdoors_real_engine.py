"""The Responses and Anthropic Messages routes on the real `AsyncEngine` and the default
model (SmolLM2-135M-Instruct), through the official SDKs: greedy texts, token counts and
stop reasons equal the chat route's for the same request, streamed and not; with
tool_choice required (the tools' JSON schema constrains the real model's output), the
calls equal the chat route's too (FLOWENGINE_FRONTDOOR_REAL_TOOLS=1: it is slow)."""

from __future__ import annotations

import json
import os

import anthropic
import openai
import pytest
from openai_live_server import LiveServer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
# (system, user message, max tokens): the first runs into its cap, the second ends
# with EOS before it (checked below, so both stop reasons are exercised).
CASES = [
    ("You are terse.", "Write a long story about the sea.", 12),
    (None, "What is the capital of France? Answer in one word.", 40),
]


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine
    from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions

    engine = AsyncEngine(default_model_path, max_model_len=MAX_MODEL_LEN)
    # Requests without tools are plain text (no parser runs for them).
    parsing = ChatParsingOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)
    server = LiveServer(engine, manage_engine=True, chat_parsing=parsing).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture(scope="module")
def clients(live):
    oai = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=live.base_url, api_key="unused", max_retries=0)
    return oai, claude, oai.models.list().data[0].id


@pytest.fixture(scope="module")
def chats(clients):
    """The chat route's greedy answer per case: (text, finish_reason, usage)."""
    oai, _, name = clients
    out = []
    for system, user, max_tokens in CASES:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        r = oai.chat.completions.create(
            model=name, messages=messages, max_tokens=max_tokens, temperature=0
        )
        out.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage))
    assert [finish for _, finish, _ in out] == ["length", "stop"]
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_responses_equal_chat(clients, chats, case):
    oai, _, name = clients
    system, user, max_tokens = CASES[case]
    text, finish, usage = chats[case]
    kwargs = {"instructions": system} if system else {}
    r = oai.responses.create(
        model=name, input=user, max_output_tokens=max_tokens, temperature=0, **kwargs
    )
    assert r.output_text == text
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.status == ("incomplete" if finish == "length" else "completed")
    events = list(
        oai.responses.create(
            model=name, input=user, max_output_tokens=max_tokens, temperature=0, stream=True,
            **kwargs,
        )
    )  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text


@pytest.mark.parametrize("case", range(len(CASES)))
def test_anthropic_messages_equal_chat(clients, chats, case):
    _, claude, name = clients
    system, user, max_tokens = CASES[case]
    text, finish, usage = chats[case]
    kwargs = {"system": system} if system else {}
    request = dict(
        model=name, max_tokens=max_tokens, messages=[{"role": "user", "content": user}],
        extra_body={"temperature": 0}, **kwargs,
    )  # fmt: skip
    m = claude.messages.create(**request)
    assert m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    with claude.messages.stream(**request) as stream:
        assert stream.get_final_text() == text
        assert stream.get_final_message().stop_reason == m.stop_reason
    count = claude.messages.count_tokens(
        model=name, messages=[{"role": "user", "content": user}], **kwargs
    )
    assert count.input_tokens == usage.prompt_tokens


def test_anthropic_prefill_continues_the_assistant_message(clients):
    """A conversation ending with an assistant message is continued (Anthropic's
    prefill), as the chat route's continue_final_message does."""
    oai, claude, name = clients
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    r = oai.chat.completions.create(
        model=name, messages=messages, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    expected = r.choices[0].message.content
    m = claude.messages.create(
        model=name, max_tokens=8, messages=messages, extra_body={"temperature": 0}
    )
    assert m.content[0].text == expected
    assert m.usage.input_tokens == r.usage.prompt_tokens
    count = claude.messages.count_tokens(model=name, messages=messages)
    assert count.input_tokens == r.usage.prompt_tokens
    # Not the same as a new assistant turn after it.
    fresh = oai.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    assert fresh.usage.prompt_tokens != r.usage.prompt_tokens


@pytest.mark.skipif(
    not os.environ.get("FLOWENGINE_FRONTDOOR_REAL_TOOLS"),
    reason="constrained decoding on the real model takes ~15-50 s; set "
    "FLOWENGINE_FRONTDOOR_REAL_TOOLS=1 (the fake-engine tool tests run the same code in CI)",
)
def test_required_tool_calls_equal_chat(clients):
    oai, claude, name = clients
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}  # fmt: skip
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.chat.completions.create(
        model=name, messages=user, max_tokens=40, temperature=0, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
    )  # fmt: skip
    calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert r.choices[0].finish_reason == "tool_calls" and calls[0][0] == "get_weather"
    tools = [{"type": "function", "name": "get_weather", "parameters": schema}]
    resp = oai.responses.create(model=name, input=user, max_output_tokens=40, temperature=0,
                                tools=tools, tool_choice="required")  # fmt: skip
    assert [(o.name, o.arguments) for o in resp.output if o.type == "function_call"] == calls
    events = list(oai.responses.create(model=name, input=user, max_output_tokens=40,
                                       temperature=0, tools=tools, tool_choice="required",
                                       stream=True))  # fmt: skip
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(a for _, a in calls)
    m = claude.messages.create(
        model=name, max_tokens=40, messages=user, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "input_schema": schema}], tool_choice={"type": "any"},
    )  # fmt: skip
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [
        (n, json.loads(a)) for n, a in calls
    ]
    assert m.stop_reason == "tool_use"
