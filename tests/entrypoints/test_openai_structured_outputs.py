"""Structured outputs over HTTP: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields become the engine's StructuredOutputsParams; a bad constraint is a 400
naming the field, and nothing reaches the engine.

(The fake engine records what it was given; generation under a constraint is
tests/structured_outputs.)
"""

from __future__ import annotations

import pytest
from openai_helpers import assert_error

from flowengine.sampling_params import StructuredOutputsParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _submitted(http, engine, path: str, body: dict) -> StructuredOutputsParams | None:
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    before = len(engine.submitted)
    resp = http.post(path, json={**base, "max_tokens": 2, **body})
    assert resp.status_code == 200, resp.text
    assert len(engine.submitted) == before + 1
    return engine.submitted[-1][2].structured_outputs


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=SCHEMA)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
         StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": '{"type": "array"}'}, StructuredOutputsParams(json='{"type": "array"}')),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutputsParams(regex="[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "a" | "b"'},
         StructuredOutputsParams(grammar='root ::= "a" | "b"')),
        # Checked to be a backend name, then the server's backend compiles it (vLLM v1).
        ({"guided_regex": "a+", "guided_decoding_backend": "outlines"},
         StructuredOutputsParams(regex="a+")),
    ],
)
def test_constraint_fields_reach_the_engine(http, engine, path, body, expected):
    assert _submitted(http, engine, path, body) == expected


def test_structural_tag_response_format(http, engine):
    tag = {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA},
         "end": "</f>"}]}
    so = _submitted(http, engine, CHAT, {"response_format": {"type": "structural_tag",
                                                             "format": tag}})
    assert so == StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                         "format": tag})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"guided_regex": "a("}, "guided_regex", "guided_regex is invalid: Regex parsing error"),
        ({"guided_json": {"type": "objectx"}}, "guided_json", 'Unsupported type "objectx"'),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "guided_grammar is invalid"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "needs json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}},
         "response_format.json_schema.schema", 'not supported (Unimplemented keys: ["not"])'),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one of json, regex, choice"),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
         "give one structured-output constraint, not several (guided_regex, guided_choice)"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
         "not several (response_format, guided_json)"),
        ({"guided_regex": "a", "guided_decoding_backend": "magic"}, "guided_decoding_backend",
         "guided_decoding_backend must be one of"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(http, engine, path, body, param, text):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    before = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, **body}), 400, param=param)
    assert text in err["message"], err["message"]
    assert len(engine.submitted) == before  # nothing was generated
    # The server keeps serving.
    assert http.post(path, json={**base, "max_tokens": 1}).status_code == 200


def test_openai_sdk_response_format_json_schema(client, engine):
    client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                               "strict": True}})
    assert engine.submitted[-1][2].structured_outputs == StructuredOutputsParams(json=SCHEMA)


def test_chat_structural_tag_field_reaches_the_engine(http, engine):
    # vLLM's chat field (the older form beside guided_*): once silently ignored, so the
    # output was unconstrained.
    tag = {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    assert _submitted(http, engine, CHAT, {"structural_tag": tag}) == \
        StructuredOutputsParams(structural_tag=tag)
    text = ('{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, '
            '"end": "</f>"}], "triggers": ["<f>"]}')
    assert _submitted(http, engine, CHAT, {"structural_tag": text}) == \
        StructuredOutputsParams(structural_tag=text)


def test_structural_tag_response_format_older_form(http, engine):
    # structures + triggers (vLLM's older form): was refused, "Structural tag must have
    # a format field", since xgrammar's single-argument API reads only the newer form.
    structures = [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]
    so = _submitted(http, engine, CHAT, {"response_format": {
        "type": "structural_tag", "structures": structures, "triggers": ["<f>"]}})
    assert so == StructuredOutputsParams(structural_tag={
        "type": "structural_tag", "structures": structures, "triggers": ["<f>"]})


def test_older_structural_tag_form_converts_as_xgrammar_does():
    import json

    import xgrammar as xgr

    from flowengine.structured_outputs.xgrammar_backend import structural_tag_spec

    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"},
                             {"begin": "<fx>", "schema": json.dumps(SCHEMA), "end": "</fx>"}]}
    ours = xgr.StructuralTag.from_json(structural_tag_spec(json.dumps(legacy)))
    theirs = xgr.StructuralTag.from_legacy_structural_tag(
        [xgr.StructuralTagItem(begin=b, schema=json.dumps(SCHEMA), end=e)
         for b, e in (("<f>", "</f>"), ("<fx>", "</fx>"))], ["<f"])
    assert ours == theirs
    newer = json.dumps({"type": "structural_tag", "format": {"type": "const_string",
                                                             "value": "x"}})
    assert structural_tag_spec(newer) == newer


def test_chat_structural_tag_field_is_checked(http, engine):
    before = len(engine.submitted)
    err = assert_error(http.post(CHAT, json={"messages": HELLO, "structural_tag": "{x",
                                             "max_tokens": 2}), 400, param="structural_tag")
    assert "structural_tag is not valid JSON" in err["message"], err["message"]
    err = assert_error(http.post(CHAT, json={"messages": HELLO, "guided_regex": "a",
                                             "structural_tag": {"type": "structural_tag"},
                                             "max_tokens": 2}), 400, param="structural_tag")
    assert "not several (guided_regex, structural_tag)" in err["message"]
    assert len(engine.submitted) == before


# Schemas no JSON value matches, and the reason the 400 names. The first four come from
# the testers' report; the rest are the contradictions xgrammar compiled (const 5 with
# type string became the grammar `5`, the required-but-forbidden property `{}`).
UNSATISFIABLE = [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum 5 is greater than maximum 1"),
    ({"enum": []}, "enum is an empty list"),
    ({"type": "string", "minLength": 5, "maxLength": 2},
     "minLength 5 is greater than maxLength 2"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     'allOf members require types that do not overlap: "string", "integer"'),
    ({"type": "string", "const": 5}, 'const 5 is not of type "string"'),
    ({"type": "integer", "enum": ["a", "b"]}, 'no enum value is of type "integer"'),
    ({"anyOf": []}, "anyOf is an empty list"),
    ({"type": []}, "type is an empty list"),
    ({"type": "object", "required": ["a"], "additionalProperties": False},
     'required property "a" is not in properties and additionalProperties is false'),
    ({"type": "object", "properties": {"n": {"type": "array", "minItems": 3, "maxItems": 1}}},
     "at /properties/n: minItems 3 is greater than maxItems 1"),
]


@pytest.mark.parametrize(("schema", "reason"), UNSATISFIABLE)
@pytest.mark.parametrize(("path", "field"), [
    (CHAT, "response_format"), (COMPLETIONS, "guided_json"),
    (COMPLETIONS, "structured_outputs")])
def test_unsatisfiable_schema_is_400_naming_the_reason(http, engine, schema, reason, path,
                                                       field):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    body, param, named = {
        "response_format": ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, "response_format.json_schema.schema",
            "response_format.json_schema.schema"),
        "guided_json": ({"guided_json": schema}, "guided_json", "guided_json"),
        "structured_outputs": ({"structured_outputs": {"json": schema}},
                               "structured_outputs", "structured_outputs.json"),
    }[field]
    before = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, "max_tokens": 3, **body}), 400,
                       param=param)
    assert err["message"] == (f"{named} is unsatisfiable, no JSON value can match it: "
                              f"{reason}"), err["message"]
    assert len(engine.submitted) == before  # nothing was generated
    # The server keeps serving, a satisfiable schema included.
    ok = http.post(path, json={**base, "max_tokens": 1, "guided_json": SCHEMA})
    assert ok.status_code == 200, ok.text
