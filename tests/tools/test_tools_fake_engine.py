"""Tool calling and reasoning over HTTP, with a scripted model (exact outputs): the
`auto` path with each parser, streamed deltas that join to the non-streamed message,
finish_reason, parallel_tool_calls, reasoning splits, LangChain's bind_tools, and bad
input answered with a 400 naming the field while the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai_helpers import sse_events, strict
from openai_live_server import LiveServer
from scripted_engine import ScriptedEngine

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.responses import ChatCompletionChunk, ChatCompletionResponse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}  # fmt: skip

SCRIPTS = {
    "one call": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>',
    "two calls": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
                 "\n</tool_call>",
    "no call": "Paris is sunny today.\n",
    "broken": "<tool_call>\nget_weather(Paris)\n</tool_call>",
    "cut": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
    "think then call": '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
                       '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "think": "<think>\n2 + 2 is 4.\n</think>\n\nIt is 4.",
    "still thinking": "<think>\nLet me count: 1, 2,",
}


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(SCRIPTS, step_s=0.0005)


@pytest.fixture(scope="module")
def servers(engine):
    auto = LiveServer(engine, chat_parsing=ChatParsingOptions(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3",
    )).start()  # fmt: skip
    plain = LiveServer(engine).start()
    try:
        yield auto, plain
    finally:
        auto.stop()
        plain.stop()


@pytest.fixture
def http(servers):
    with httpx.Client(base_url=servers[0].base_url, timeout=30) as client:
        yield client


def chat(http, content: str, **fields):
    body = {"messages": [{"role": "user", "content": content}], "tools": [WEATHER, TIME], **fields}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    strict(resp.content, ChatCompletionResponse)
    return resp.json()["choices"][0]


def stream(http, content: str, **fields):
    body = {"messages": [{"role": "user", "content": content}], "tools": [WEATHER, TIME],
            "stream": True, **fields}  # fmt: skip
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.content)
    for e in events:
        strict(e, ChatCompletionChunk)
    chunks = [json.loads(e) for e in events]
    return chunks


def join(chunks) -> dict:
    """A client's reassembly of a streamed choice (what the openai SDK does)."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls") or []:
                call = message["tool_calls"].setdefault(piece["index"], {
                    "id": piece.get("id"), "type": piece.get("type"),
                    "function": {"name": piece["function"].get("name"), "arguments": ""}})
                call["function"]["arguments"] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {
        "content": message["content"] or None,
        "reasoning_content": message["reasoning_content"] or None,
        "tool_calls": [message["tool_calls"][i] for i in sorted(message["tool_calls"])],
        "finish_reason": finish,
    }


def simple(message: dict) -> dict:
    return {
        "content": message.get("content") or None,
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": [(c["type"], c["function"]["name"], c["function"]["arguments"])
                       for c in message.get("tool_calls") or []],  # fmt: skip
    }


EXPECTED = {
    "one call": ("Let me look.", None, [("function", "get_weather", '{"city": "Paris"}')],
                 "tool_calls"),
    "two calls": (None, None, [("function", "get_weather", '{"city": "Paris"}'),
                               ("function", "get_time", '{"tz": "CET"}')], "tool_calls"),
    "no call": ("Paris is sunny today.\n", None, [], "stop"),
    "broken": ("<tool_call>\nget_weather(Paris)\n</tool_call>", None, [], "stop"),
    "think then call": (None, "\nThe user wants weather.\n",
                        [("function", "get_weather", '{"city": "Oslo"}')], "tool_calls"),
    "think": ("\n\nIt is 4.", "\n2 + 2 is 4.\n", [], "stop"),
}


@pytest.mark.parametrize("prompt", sorted(EXPECTED))
def test_auto_non_streamed_exact(http, prompt):
    content, reasoning, calls, finish = EXPECTED[prompt]
    choice = chat(http, prompt)
    assert simple(choice["message"]) == {
        "content": content, "reasoning_content": reasoning, "tool_calls": calls}
    assert choice["finish_reason"] == finish
    ids = [c["id"] for c in choice["message"].get("tool_calls") or []]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == len(ids)
    if calls:
        assert choice["message"]["content"] == content  # null when the model only called


@pytest.mark.parametrize("prompt", sorted(EXPECTED))
def test_streamed_deltas_join_to_the_non_streamed_message(http, prompt):
    content, reasoning, calls, finish = EXPECTED[prompt]
    chunks = stream(http, prompt)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    joined = join(chunks[1:])
    assert joined["finish_reason"] == finish
    assert simple(joined) == {"content": content, "reasoning_content": reasoning,
                              "tool_calls": calls}  # fmt: skip
    assert simple(joined) == simple(chat(http, prompt)["message"])
    pieces = [p for c in chunks for ch in c["choices"] for p in ch["delta"].get("tool_calls", [])]
    if calls:  # arguments arrive in fragments, the first piece of a call names it
        assert len(pieces) > len(calls)
        firsts = [p for p in pieces if "id" in p]
        assert [(p["index"], p["type"], p["function"]["name"]) for p in firsts] == [
            (i, "function", name) for i, (_, name, _) in enumerate(calls)]
    # the finish_reason rides on the last chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(finish) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


def test_cut_by_max_tokens_keeps_length(http):
    choice = chat(http, "cut", max_tokens=20)
    assert choice["finish_reason"] == "length"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == '{"city": "P'  # 20 pieces of the script
    assert join(stream(http, "cut", max_tokens=20))["finish_reason"] == "length"


def test_parallel_tool_calls_false_keeps_the_first(http):
    choice = chat(http, "two calls", parallel_tool_calls=False)
    assert simple(choice["message"])["tool_calls"] == [
        ("function", "get_weather", '{"city": "Paris"}')]
    joined = join(stream(http, "two calls", parallel_tool_calls=False))
    assert [c["function"]["name"] for c in joined["tool_calls"]] == ["get_weather"]


def test_a_reasoning_only_answer_has_null_content(http):
    # An output that never left its think block (cut by max_tokens, as reasoning models
    # often are) had content "" beside its reasoning_content; vLLM's (and OpenAI's)
    # message has content null when the model wrote no content.
    choice = chat(http, "still thinking")
    assert choice["message"]["reasoning_content"] == "\nLet me count: 1, 2,"
    assert choice["message"]["content"] is None
    assert chat(http, "no call")["message"]["content"] == "Paris is sunny today.\n"


def test_tool_choice_none_is_plain_text_and_tools_reach_the_template(http, engine):
    choice = chat(http, "one call", tool_choice="none")
    assert choice["message"] == {"role": "assistant", "content": SCRIPTS["one call"]}
    assert choice["finish_reason"] == "stop"
    _, prompt, _ = engine.submitted[-1]
    assert prompt["tools"] == [WEATHER, TIME]


def test_named_and_required_parse_their_forced_formats(http, engine):
    engine.scripts["forced named"] = '{"city": "Rome"}'
    engine.scripts["forced required"] = (
        '[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(http, "forced named", tool_choice=named)
    assert simple(choice["message"]) == {"content": None, "reasoning_content": None,
                                         "tool_calls": [("function", "get_weather",
                                                         '{"city": "Rome"}')]}  # fmt: skip
    assert choice["finish_reason"] == "stop"  # OpenAI's finish_reason for a forced function
    assert simple(join(stream(http, "forced named", tool_choice=named))) == simple(
        choice["message"])
    choice = chat(http, "forced required", tool_choice="required")
    assert simple(choice["message"])["tool_calls"] == [
        ("function", "get_time", '{"tz": "UTC"}'), ("function", "get_weather", '{"city": "Rome"}')]
    assert choice["finish_reason"] == "tool_calls"
    joined = join(stream(http, "forced required", tool_choice="required"))
    assert simple(joined) == simple(choice["message"]) and joined["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("script", "fields"),
    [
        ("forced named", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ("forced required", {"tool_choice": "required"}),
        ("two calls", {}),  # auto, hermes
        ("think then call", {}),
    ],
)
def test_a_chunk_has_one_tool_call_entry_per_index(http, engine, script, fields):
    """OpenAI and vLLM send one `delta.tool_calls` entry per index per chunk: the call's
    first entry carries id, type, name and its first arguments text. A named function's
    first chunk had two entries of index 0 (id/name, then arguments "{")."""
    engine.scripts["forced named"] = '{"city": "Rome"}'
    engine.scripts["forced required"] = (
        '[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    chunks = stream(http, script, **fields)
    first_pieces = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            indexes = [p["index"] for p in choice["delta"].get("tool_calls") or []]
            assert len(indexes) == len(set(indexes)), choice["delta"]
            for piece in choice["delta"].get("tool_calls") or []:
                first_pieces.setdefault(piece["index"], piece)
    assert first_pieces and all(
        set(p) == {"index", "id", "type", "function"} and p["type"] == "function"
        and p["function"]["name"] for p in first_pieces.values())  # fmt: skip
    if script == "forced named":
        [piece] = first_pieces.values()
        assert piece["function"]["name"] == "get_weather"
        assert piece["function"]["arguments"].startswith("{")
    assert simple(join(chunks)) == simple(chat(http, script, **fields)["message"])


def test_multi_turn_messages_reach_the_engine(http, engine):
    body = {
        "messages": [
            {"role": "user", "content": "one call"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call-1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": "22 C"},
        ],
        "tools": [WEATHER],
    }  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    _, prompt, _ = engine.submitted[-1]
    assert prompt["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call-1"},
    ]  # fmt: skip


def test_openai_sdk_streams_tool_calls(servers):
    client = openai.OpenAI(base_url=f"{servers[0].base_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "two calls"}]
    whole = client.chat.completions.create(model="fake-model", messages=messages,
                                           tools=[WEATHER, TIME])  # fmt: skip
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert whole.choices[0].finish_reason == "tool_calls"
    args: dict[int, str] = {}
    with client.chat.completions.stream(model="fake-model", messages=messages,
                                        tools=[WEATHER, TIME]) as events:  # fmt: skip
        for event in events:
            if event.type == "tool_calls.function.arguments.delta":
                args[event.index] = args.get(event.index, "") + event.arguments_delta
        final = events.get_final_completion()
    assert [(c.function.name, c.function.arguments)
            for c in final.choices[0].message.tool_calls] == calls  # fmt: skip
    assert [args[0], args[1]] == [a for _, a in calls]


def test_langchain_bind_tools_auto(servers):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "22 C"

    llm = langchain_openai.ChatOpenAI(
        base_url=f"{servers[0].base_url}/v1", api_key="x", model="fake-model", max_retries=0
    ).bind_tools([get_weather])
    reply = llm.invoke("one call")
    assert reply.content == "Let me look."
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    # streamed: the chunks add up to the same calls
    total = None
    for chunk in llm.stream("one call"):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", {"city": "Paris"})]
    # the tool result goes back as a tool message (multi-turn)
    follow = llm.invoke(["no call", reply, ToolMessage("22 C", tool_call_id=reply.tool_calls[0]["id"])])
    assert isinstance(follow.content, str)


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 12}}}}}]},
         "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters", "Expected `object | null`, got `str`"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        # An empty tools array cannot satisfy "required" or a named function; it was
        # answered as plain text.
        ({"tools": [], "tool_choice": "required"}, "tools", "asks for a tool call"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools", "asks for a tool call"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "missing required field `function`"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
          "tool_calls": [{"id": "c", "type": "function", "function": {
              "name": "get_weather", "arguments": "{oops"}}]}], "tools": [WEATHER]},
         "messages[1].tool_calls[0].function.arguments", "must be JSON text of an object"),
        # Valid JSON that is not an object: refused as the Responses route refuses it.
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
          "tool_calls": [{"id": "c", "type": "function", "function": {
              "name": "get_weather", "arguments": "[1,2]"}}]}], "tools": [WEATHER]},
         "messages[1].tool_calls[0].function.arguments", "object, got list"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_serving_goes_on(http, fields, param, text):
    body = {"messages": [{"role": "user", "content": "no call"}], **fields}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert text in err["message"]
    if param is not None:
        assert err["param"] == param
    assert chat(http, "no call")["message"]["content"] == "Paris is sunny today.\n"


def test_auto_without_the_flag_is_vllms_400(servers):
    with httpx.Client(base_url=servers[1].base_url, timeout=30) as plain:
        resp = plain.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "one call"}], "tools": [WEATHER]})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["param"] == "tool_choice"
        assert err["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                  "--tool-call-parser to be set")  # fmt: skip
        # without a reasoning parser the think block is content
        resp = plain.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "think"}]})
        assert resp.json()["choices"][0]["message"] == {
            "role": "assistant", "content": SCRIPTS["think"]}


def test_tokenize_renders_tools_as_chat_does(tokenizer):
    """/tokenize with `messages` and `tools` (vLLM's field) counts the tools the chat
    template renders, and checks them as the chat route does (the tools were ignored:
    the count was that of a request without them)."""
    from pathlib import Path

    from flowengine.tokenize.chat import apply_chat_template, load_chat_template

    examples = Path(__file__).resolve().parents[2] / "examples"
    template = load_chat_template(str(examples / "templates/tool_chat_template_hermes.jinja"))
    engine = ScriptedEngine(SCRIPTS)
    engine.tokenizer, engine.chat_template = tokenizer, template  # a real template step
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with LiveServer(engine) as live, httpx.Client(base_url=live.base_url, timeout=30) as http:
        resp = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER, TIME]})
        assert resp.status_code == 200, resp.text
        plain = apply_chat_template(tokenizer, messages, chat_template=template)
        ids = apply_chat_template(tokenizer, messages, chat_template=template,
                                  tools=[WEATHER, TIME])
        assert resp.json()["tokens"] == ids and ids != plain
        bad = {**WEATHER, "function": {**WEATHER["function"], "name": "a b"}}
        resp = http.post("/tokenize", json={"messages": messages, "tools": [TIME, bad]})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "tools[1].function.name"
        resp = http.post("/tokenize", json={"messages": messages, "tools": []})
        assert resp.json()["tokens"] == plain


def test_tokenize_takes_a_request_chat_template_as_chat_does(tokenizer):
    """/tokenize with `messages` and `chat_template` (vLLM's field): refused without
    --trust-request-chat-template with the chat route's 400, rendered with it (the
    field was ignored: the count was that of the server's template)."""
    from flowengine.tokenize.chat import apply_chat_template

    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    engine = ScriptedEngine(SCRIPTS)
    engine.tokenizer = tokenizer  # a real template step
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": messages, "chat_template": own}
    with LiveServer(engine) as live, httpx.Client(base_url=live.base_url, timeout=30) as http:
        refused = http.post("/tokenize", json=body)
        chat_refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == chat_refused.status_code == 400, refused.text
        assert refused.json()["error"] == chat_refused.json()["error"]
        assert refused.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in refused.json()["error"]["message"]
        live.server.context.trust_request_chat_template = True
        resp = http.post("/tokenize", json=body)
        assert resp.status_code == 200, resp.text
        ids = apply_chat_template(tokenizer, messages, chat_template=own)
        assert resp.json()["tokens"] == ids != apply_chat_template(tokenizer, messages)
