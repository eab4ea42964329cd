"""POST /v1/responses (OpenAI Responses) through the official `openai` SDK against a live
server on the fake engine: texts equal the chat route's, the typed event sequence,
previous_response_id over the store, GET/DELETE, errors in OpenAI's shape.

The fake engine echoes its rendered prompt ("role: content" lines, then "assistant:"),
one byte per token, so every expected text is exact.
"""

from __future__ import annotations

import httpx
import msgspec
import openai
import orjson
import pytest
from frontdoor_helpers import MODEL, rendered, typed_events
from openai_helpers import API_KEY, assert_error, strict, wait_until

from flowengine.entrypoints.openai.app import AppOptions, OpenAIApp
from flowengine.entrypoints.openai.protocol_responses import ResponseDeleted, ResponseObject

# The fake engine samples letters at random unless greedy: every request asks temperature 0.
GREEDY = {"temperature": 0}
STREAM_TYPES_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_TYPES_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def chat_text(oai: openai.OpenAI, messages, max_tokens: int, **extra) -> tuple[str, str]:
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_create_equals_chat_and_is_incomplete_at_max_output_tokens(oai, http, engine):
    r = oai.responses.create(model=MODEL, input="hello there", max_output_tokens=9, **GREEDY)
    expected, finish = chat_text(oai, [{"role": "user", "content": "hello there"}], 9)
    assert expected == rendered([{"role": "user", "content": "hello there"}])[:9] == "user: hel"
    assert finish == "length"
    assert r.output_text == expected
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.id.startswith("msg_")
    assert [(p.type, p.text) for p in item.content] == [("output_text", expected)]
    num_prompt = len(rendered([{"role": "user", "content": "hello there"}]))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (num_prompt, 9)
    assert r.usage.total_tokens == num_prompt + 9
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.max_output_tokens == 9 and r.temperature == 0.0 and r.store is True
    # The wire body matches the documented schema exactly (unknown fields fail).
    raw = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, **GREEDY})
    assert raw.status_code == 200, raw.text
    body = strict(raw.content, ResponseObject)
    assert body.output[0].content[0].text == "use"
    # The engine got the chat route's request: same messages, same sampling.
    _, prompt, params = engine.submitted[-1]
    assert prompt == [{"role": "user", "content": "hi"}]
    assert params.max_tokens == 3


def test_completed_on_stop_string_equals_chat(oai):
    messages = [{"role": "user", "content": "abc xyz"}]
    r = oai.responses.create(
        model=MODEL, input="abc xyz", max_output_tokens=50, temperature=0,
        extra_body={"stop": ["xyz"]},
    )  # fmt: skip
    expected, finish = chat_text(oai, messages, 50, stop=["xyz"])
    assert finish == "stop"
    assert r.output_text == expected == "user: abc "
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output[0].status == "completed"
    assert r.completed_at is not None and r.completed_at >= r.created_at


def test_instructions_and_message_items(oai, engine):
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"role": "user", "content": "three"},
    ]  # fmt: skip
    r = oai.responses.create(
        model=MODEL, input=items, instructions="sys", max_output_tokens=40, temperature=0
    )
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "one\ntwo"},  # parts joined as the chat route joins them
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "three"},
    ]
    assert engine.submitted[-1][1] == messages
    expected, _ = chat_text(oai, messages, 40)
    assert r.output_text == expected == rendered(messages)[:40]
    assert r.instructions == "sys"


def test_empty_instructions_are_no_system_message(oai, engine):
    # instructions "" adds no empty system message, which would replace the chat
    # template's default system prompt (vLLM skips it too; found by a fresh tester:
    # the answer differed from the same request without instructions).
    r = oai.responses.create(model=MODEL, input="hi", instructions="", max_output_tokens=5,
                             temperature=0)
    assert engine.submitted[-1][1] == [{"role": "user", "content": "hi"}]
    assert r.instructions == ""


def test_stream_event_sequence(oai, http):
    whole = oai.responses.create(model=MODEL, input="stream me", max_output_tokens=12, **GREEDY)
    events = list(
        oai.responses.create(
            model=MODEL, input="stream me", max_output_tokens=12, stream=True, **GREEDY
        )
    )
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == [
        *STREAM_TYPES_HEAD,
        *["response.output_text.delta"] * num_deltas,
        *STREAM_TYPES_TAIL,
        "response.incomplete",  # stopped at max_output_tokens
    ]
    assert num_deltas >= 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert final.id == created.id and final.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expected = rendered([{"role": "user", "content": "stream me"}])[:12]
    assert text == whole.output_text == final.output_text == expected == "user: stream"
    item_id = events[2].item.id
    for e in events[3:-2]:
        assert (e.item_id, e.output_index, e.content_index) == (item_id, 0, 0)
    assert events[-2].item.id == item_id and events[-2].item.content[0].text == text
    assert events[-4].text == text  # response.output_text.done
    assert final.usage.output_tokens == 12
    # The wire: `event: <type>` + `data: <json>`, and no `data: [DONE]`.
    raw = http.post(
        "/v1/responses",
        json={"input": "abc", "stream": True, "max_output_tokens": 50, "stop": ["abc"], **GREEDY},
    )
    assert raw.headers["content-type"] == "text/event-stream"
    wire = typed_events(raw.content)
    assert [t for t, _ in wire][-1] == "response.completed"
    done = wire[-1][1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "user: "
    strict(orjson.dumps(done), ResponseObject)


def test_previous_response_id_store_get_delete(oai, engine):
    first = oai.responses.create(
        model=MODEL, input="alpha", instructions="first rules", max_output_tokens=4, **GREEDY
    )
    assert first.output_text == "syst"
    second = oai.responses.create(
        model=MODEL, input="beta", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    # The stored conversation then the new input; the first's instructions not carried.
    history = [
        {"role": "user", "content": "alpha"},
        {"role": "assistant", "content": "syst"},
        {"role": "user", "content": "beta"},
    ]
    assert engine.submitted[-1][1] == history
    assert second.previous_response_id == first.id
    assert second.output_text == rendered(history)[:6]
    third = oai.responses.create(
        model=MODEL, input="gamma", previous_response_id=second.id, instructions="new",
        max_output_tokens=3, **GREEDY,
    )  # fmt: skip
    assert engine.submitted[-1][1] == [
        {"role": "system", "content": "new"},
        *history,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "gamma"},
    ]
    assert third.output_text == "sys"
    # GET returns the very body POST returned.
    got = oai.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    # store=false: not kept, so neither retrievable nor continuable.
    unstored = oai.responses.create(
        model=MODEL, input="x", store=False, max_output_tokens=2, **GREEDY
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.retrieve(unstored.id)
    assert unstored.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    # DELETE: gone afterwards.
    raw = oai.responses.with_raw_response.delete(first.id)
    deleted = strict(raw.http_response.content, ResponseDeleted)
    assert (deleted.id, deleted.object, deleted.deleted) == (first.id, "response.deleted", True)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(first.id)
    # A streamed response is stored once it finished.
    events = list(
        oai.responses.create(model=MODEL, input="s", stream=True, max_output_tokens=2, **GREEDY)
    )
    assert oai.responses.retrieve(events[-1].response.id).output_text == "us"


def test_cancel_is_vllms_400_for_a_stored_response_and_404_for_an_unknown_one(oai):
    # OpenAI cancels background responses only and this server runs none: the SDK's
    # cancel gets vLLM's 400 for a stored response (found by a fresh tester: the route
    # was a 404 "no route", as if the response did not exist).
    done = oai.responses.create(model=MODEL, input="abc", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.cancel(done.id)
    assert err.value.body["message"].startswith("Cannot cancel a synchronous response.")
    assert err.value.body["param"] == "response_id"
    assert oai.responses.retrieve(done.id).status == done.status  # still stored, unchanged
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.cancel("resp_unknown")
    assert err.value.body["code"] == "response_not_found"


def test_store_size_comes_from_the_options(engine):
    from flowengine.entrypoints.openai.context import ServingContext
    from flowengine.entrypoints.openai.generation import Admission
    from flowengine.metrics import ServingMetrics

    ctx = ServingContext(engine, (MODEL,), Admission(None), ServingMetrics(engine.get_stats, MODEL))
    app = OpenAIApp(ctx, AppOptions(responses_store_max=2, responses_store_max_bytes=1000))
    assert (app.responses_store.max_entries, app.responses_store.max_bytes) == (2, 1000)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        # Tools are the chat route's: auto needs --enable-auto-tool-choice (not set here).
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice",
         "--enable-auto-tool-choice"),
        ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"},
         "tools[0].type", "web_search"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input[0].arguments", "object"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
         "input[0].call_id", "function_call"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type", "web_search_call"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]", "input_image"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema",
         "schema"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "grammar"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
         "text.format.schema", "schema"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "auto"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include[0]", "include"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs", "<= 20"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"input": "x", "temperature": -1}, "temperature", ">= 0"),
        ({"input": []}, "input", "empty"),
        ({"instructions": "x"}, "input", "input"),
        ({"input": [{"content": "no role"}]}, "input[0].role", "role"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(http, body, param, words):
    err = assert_error(http.post("/v1/responses", json=body), 400, param=param)
    assert words in err["message"]
    # The engine keeps serving.
    ok = http.post("/v1/responses", json={"input": "ok", "max_output_tokens": 2, **GREEDY})
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "us"


def test_sdk_errors(oai, server):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", tools=[{"type": "function", "name": "f",
                                                             "parameters": {}}])  # fmt: skip
    assert err.value.body["param"] == "tool_choice"  # auto, which this server does not parse
    assert "--enable-auto-tool-choice" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="no-such-model", input="x")
    assert err.value.body["code"] == "model_not_found"
    anonymous = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.responses.create(model=MODEL, input="x")
    # The prompt over the context: a 400 before any event.
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x" * 600, stream=True)
    assert "max_model_len" in err.value.message
    ok = oai.responses.create(model=MODEL, input="fine", max_output_tokens=2, **GREEDY)
    assert ok.output_text == "us"


def test_engine_failure_mid_stream_is_response_failed(oai, engine):
    engine.fail_after_tokens = 3
    try:
        events = list(
            oai.responses.create(model=MODEL, input="boom", stream=True, max_output_tokens=20)
        )
        with pytest.raises(openai.InternalServerError):
            oai.responses.create(model=MODEL, input="boom", max_output_tokens=20)
    finally:
        engine.fail_after_tokens = None
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        oai.responses.retrieve(failed.id)
    ok = oai.responses.create(model=MODEL, input="after", max_output_tokens=2, **GREEDY)
    assert ok.output_text == "us"


def test_closing_a_stream_aborts_its_request(server, engine):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream(
            "POST", "/v1/responses",
            json={"input": "long", "stream": True, "max_output_tokens": 400},
            headers={"authorization": f"Bearer {API_KEY}"},
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            lines = resp.iter_lines()
            created = next(line for line in lines if line.startswith("data: "))
            response_id = orjson.loads(created[len("data: ") :])["response"]["id"]
    wait_until(lambda: response_id in engine.aborted, timeout_s=10)


def test_openapi_documents_the_routes(http):
    doc = http.get("/openapi.json").json()
    assert set(doc["paths"]["/v1/responses"]) == {"post"}
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    request = doc["components"]["schemas"]["ResponsesRequest"]
    assert request["required"] == ["input"]
    tools = request["properties"]["tools"]["anyOf"][0]
    assert tools["items"] == {"$ref": "#/components/schemas/ResponsesTool"}
    assert doc["components"]["schemas"]["ResponsesTool"]["properties"]["type"] == {
        "const": "function"}
    assert msgspec.json.decode(orjson.dumps(doc))["openapi"] == "3.1.0"


def test_sdk_stream_helper_accumulates_the_response(oai):
    """`client.responses.stream` (the SDK's accumulating helper) on a completed response."""
    with oai.responses.stream(
        model=MODEL, input="hello", max_output_tokens=50, extra_body={"stop": ["ll"]}, **GREEDY
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas) == "user: he"


def test_logprobs_equal_the_chat_routes(oai, http):
    messages = [{"role": "user", "content": "abc"}]
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    expected = [t.model_dump() for t in chat.choices[0].logprobs.content]
    assert len(expected) == 5 and len(expected[0]["top_logprobs"]) == 2
    body = {
        "input": "abc", "max_output_tokens": 5, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"], **GREEDY,
    }  # fmt: skip
    raw = http.post("/v1/responses", json=body)
    part = strict(raw.content, ResponseObject).output[0].content[0]
    assert [msgspec.to_builtins(lp) for lp in part.logprobs] == expected
    # Streamed: each delta carries its tokens' log-probabilities; they join to the same.
    events = typed_events(http.post("/v1/responses", json={**body, "stream": True}).content)
    deltas = [d for t, d in events if t == "response.output_text.delta"]
    assert [lp for d in deltas for lp in d["logprobs"]] == expected
    done = next(d for t, d in events if t == "response.output_text.done")
    assert done["logprobs"] == expected
    assert events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == expected
    # top_logprobs alone computes nothing (OpenAI's and vLLM's rule: include asks).
    r = oai.responses.create(
        model=MODEL, input="abc", max_output_tokens=5, top_logprobs=2, **GREEDY
    )
    assert r.output[0].content[0].logprobs == [] and r.top_logprobs == 2


def test_text_format_is_the_chat_routes_response_format(oai, http, engine):
    # text.format json_schema / json_object constrain the output as the chat route's
    # response_format does (found by a fresh tester: every format but text was a 400,
    # so the SDK's responses.parse(text_format=...) could not work; vLLM serves it).
    from flowengine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    raw = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                           "text": {"format": fmt}, **GREEDY})
    body = strict(raw.content, ResponseObject)
    assert engine.submitted[-1][2].structured_outputs == StructuredOutputsParams(json=schema)
    assert body.text.format == {**fmt, "description": None}  # echoed, as OpenAI does
    r = oai.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                             text={"format": {"type": "json_object"}}, **GREEDY)
    assert engine.submitted[-1][2].structured_outputs == StructuredOutputsParams(
        json_object=True)
    assert r.text.format.type == "json_object"
    oai.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                         text={"format": {"type": "text"}}, **GREEDY)
    assert engine.submitted[-1][2].structured_outputs is None
