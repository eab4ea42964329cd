"""The backend interface on the default model's tokenizer: both backends, every kind.

Masks are checked token by token against the tokenizer (exact sets where the grammar
fixes them), matchers by accepting the tokens of a valid text, refusing an invalid
token, terminating only where the grammar ends, rollback and reset.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from flowengine.request import Request
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.structured_outputs.backend import (
    GrammarOptions,
    bitmask_words,
    choice_to_ebnf,
    select_backend,
    unsupported_json_features,
)
from flowengine.structured_outputs.guidance_backend import GuidanceBackend
from flowengine.structured_outputs.manager import StructuredOutputManager
from flowengine.structured_outputs.validate import validate_structured_outputs
from flowengine.structured_outputs.xgrammar_backend import XgrammarBackend

OPTS = GrammarOptions()


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend(request, tokenizer, vocab_size):
    if request.param == "xgrammar":
        return XgrammarBackend(tokenizer, vocab_size)
    return GuidanceBackend(tokenizer, vocab_size, eos_token_id=tokenizer.eos_token_id)


def allowed(matcher, vocab_size: int) -> set[int]:
    bitmask = torch.zeros(2, bitmask_words(vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def test_choice_mask_is_exactly_the_prefix_tokens(backend, tokenizer, vocab_size):
    eos = tokenizer.eos_token_id
    matcher = backend.compile("choice", json.dumps(["yes", "no"]), OPTS).new_matcher([eos])
    first = allowed(matcher, vocab_size)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    texts = {i: tokenizer.convert_tokens_to_string([t]) for i, t in enumerate(vocab)
             if i not in tokenizer.all_special_ids}
    expected = {i for i, s in texts.items() if s and ("yes".startswith(s) or "no".startswith(s))}
    assert first == expected
    assert eos not in first and not matcher.is_terminated()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    for t in yes:
        assert matcher.accept_token(t)
    assert allowed(matcher, vocab_size) == {eos}  # the choice is complete: only EOS
    assert not matcher.accept_token(tokenizer.encode("no", add_special_tokens=False)[0])
    assert matcher.accept_token(eos)
    assert matcher.is_terminated()


def test_choice_outside_the_basic_plane_is_its_utf8(backend, tokenizer, vocab_size):
    # An emoji is one code point past U+FFFF; written as a JSON surrogate pair
    # ("\\ud83d\\ude00") the grammar took the two halves as code points, and the
    # output was six bytes of invalid UTF-8 (U+FFFD in the text).
    eos = tokenizer.eos_token_id
    matcher = backend.compile("choice", json.dumps(["maybe 😀", "no"]), OPTS).new_matcher([eos])
    ids = tokenizer.encode("maybe 😀", add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in [*ids, eos])
    assert matcher.is_terminated()


def test_regex_and_rollback_and_reset(backend, tokenizer, vocab_size):
    eos = tokenizer.eos_token_id
    matcher = backend.compile("regex", r"[0-9]{3}-[0-9]{2}", OPTS).new_matcher([eos])
    start = allowed(matcher, vocab_size)
    ids = tokenizer.encode("123-45", add_special_tokens=False)
    for t in ids[:-1]:
        assert matcher.accept_token(t)
    middle = allowed(matcher, vocab_size)
    assert eos not in middle
    assert matcher.accept_token(ids[-1])
    assert eos in allowed(matcher, vocab_size)
    matcher.rollback(1)
    assert allowed(matcher, vocab_size) == middle
    matcher.reset()
    assert allowed(matcher, vocab_size) == start
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])


def test_json_schema_and_grammar(backend, tokenizer, vocab_size):
    eos = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    # Without "any whitespace", xgrammar writes JSON with its default separators
    # (", " and ": "), llguidance compactly.
    compact = '{"n": 7}' if backend.name == "xgrammar" else '{"n":7}'
    grammars = [
        (backend.compile("json", json.dumps(schema, sort_keys=True),
                         GrammarOptions(disable_any_whitespace=True)), compact),
        (backend.compile("grammar", 'root ::= "{\\"n\\":" [0-9] "}"', OPTS), '{"n":7}'),
    ]
    for grammar, text in grammars:
        matcher = grammar.new_matcher([eos])
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(t)
        assert allowed(matcher, vocab_size) == {eos}
        bad = grammar.new_matcher([eos])
        for t in tokenizer.encode(text[:text.index(":") + 1], add_special_tokens=False):
            assert bad.accept_token(t)
        assert not bad.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])


def test_json_object_is_an_object_only(backend, tokenizer, vocab_size):
    """json_object is "any JSON object" (OpenAI's response_format json_object, vLLM's
    '{"type": "object"}' schema): an array or a scalar is refused at its first token
    (xgrammar's builtin JSON grammar let the model answer `[]`); disable_any_whitespace
    is honoured (no space before the first key)."""
    eos = tokenizer.eos_token_id
    for opts in (OPTS, GrammarOptions(disable_any_whitespace=True)):
        grammar = backend.compile("json_object", "", opts)
        first = allowed(grammar.new_matcher([eos]), vocab_size)
        for text in ("[", "[]", "1", '"', "null", "true"):
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids[0] not in first, f"{text!r} may start a json_object"
        text = '{"a": [1, {"b": null}]}' if backend.name == "xgrammar" else '{"a":[1,{"b":null}]}'
        matcher = grammar.new_matcher([eos])
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(t), text
        assert eos in allowed(matcher, vocab_size)
    spaced = backend.compile("json_object", "", GrammarOptions(disable_any_whitespace=True))
    matcher = spaced.new_matcher([eos])
    assert matcher.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    assert not matcher.accept_token(tokenizer.encode(" ", add_special_tokens=False)[0])


def test_invalid_constraints_raise_naming_the_field(backend):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is invalid"):
        backend.compile("regex", "a(", OPTS)
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar is invalid"):
        backend.compile("grammar", "root ::= (\"a\" | ", OPTS)
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        backend.compile("json", '{"type": "objectx"}', OPTS)


def test_unsupported_schema_features_are_named():
    schema = {"type": "object", "properties": {
        "a": {"not": {"type": "string"}},
        "b": {"type": "string", "format": "email", "maxLength": 9},
        "c": {"type": "integer", "multipleOf": 3},  # honoured for integers
        "d": {"type": "number", "multipleOf": 0.5},
        "enum_data": {"enum": [{"not": 1}]}}}  # data, not a keyword
    assert unsupported_json_features(schema) == [
        "format with minLength/maxLength", "multipleOf", "not"]
    spec = json.dumps(schema)
    assert select_backend("auto", "json", spec) == "guidance"
    assert select_backend("auto", "json", '{"type": "object"}') == "xgrammar"
    assert select_backend("xgrammar", "json", spec) == "xgrammar"
    with pytest.raises(ValueError, match=r"response_format\.json_schema\.schema uses "
                                         r"format with minLength/maxLength, multipleOf, not, "
                                         r"which the xgrammar backend does not support"):
        validate_structured_outputs(StructuredOutputsParams(json=schema), "xgrammar",
                                    field="response_format.json_schema.schema")
    with pytest.raises(ValueError, match=r'structured_outputs\.json uses a JSON-schema feature '
                                         r'that is not supported \(Unimplemented keys: \["not"\]'):
        validate_structured_outputs(StructuredOutputsParams(json=schema), "auto")


def test_a_pattern_with_length_bounds_goes_to_llguidance(tokenizer, vocab_size):
    # xgrammar dropped minLength/maxLength beside a pattern (Pydantic's
    # Field(pattern=..., max_length=...)): '"aaa"' passed maxLength 2. "auto" now
    # sends such a schema to llguidance, which honours both.
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^a+$", "minLength": 2, "maxLength": 3}}}
    assert unsupported_json_features(schema) == ["pattern with minLength/maxLength"]
    spec = json.dumps(schema)
    assert select_backend("auto", "json", spec) == "guidance"
    eos = tokenizer.eos_token_id
    compiled = GuidanceBackend(tokenizer, vocab_size, eos_token_id=eos).compile(
        "json", spec, OPTS)
    for text, ok in (("aa", True), ("aaa", True), ("a", False), ("aaaa", False)):
        ids = tokenizer.encode(json.dumps({"code": text}), add_special_tokens=False)
        matcher = compiled.new_matcher([eos])
        assert all(matcher.accept_token(t) for t in [*ids, eos]) == ok, text


def test_all_of_several_schemas_goes_to_llguidance(tokenizer, vocab_size):
    # xgrammar took allOf [A, B] as anyOf: {"a": 1} passed without B's required "b".
    both = {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    assert unsupported_json_features(both) == ["allOf"]
    assert unsupported_json_features({"allOf": [{"type": "integer"}]}) == []  # a wrapper
    spec = json.dumps(both)
    assert select_backend("auto", "json", spec) == "guidance"
    eos = tokenizer.eos_token_id
    compiled = GuidanceBackend(tokenizer, vocab_size, eos_token_id=eos).compile(
        "json", spec, OPTS)
    for value, ok in (({"a": 1}, False), ({"b": "x"}, False), ({"a": 1, "b": "x"}, True)):
        ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        matcher = compiled.new_matcher([eos])
        assert all(matcher.accept_token(t) for t in [*ids, eos]) == ok, value


def test_unique_items_is_refused_not_ignored():
    # xgrammar ignores uniqueItems (it let "[1, 1]" through, so a schema of a set, e.g.
    # Pydantic's set[int], gave duplicates) and llguidance does not implement it: the
    # request is refused naming it. uniqueItems false asks for nothing.
    sets = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert unsupported_json_features(sets) == ["uniqueItems"]
    assert select_backend("auto", "json", json.dumps(sets)) == "guidance"
    with pytest.raises(ValueError, match=r'Unimplemented keys: \["uniqueItems"\]'):
        validate_structured_outputs(StructuredOutputsParams(json=sets), "auto")
    with pytest.raises(ValueError, match="uses uniqueItems, which the xgrammar backend"):
        validate_structured_outputs(StructuredOutputsParams(json=sets), "xgrammar")
    lists = {**sets, "uniqueItems": False}
    assert unsupported_json_features(lists) == []
    assert validate_structured_outputs(StructuredOutputsParams(json=lists)) == "xgrammar"


def test_validation_is_cached_per_constraint_and_names_each_callers_field(monkeypatch):
    """The frontend checks a repeated (backend, kind, spec, options) once; a cached
    failure still names the field of the request that repeats it."""
    from flowengine.structured_outputs import xgrammar_backend

    calls = []
    real = xgrammar_backend.validate_xgrammar
    monkeypatch.setattr(xgrammar_backend, "validate_xgrammar",
                        lambda *a: (calls.append(a), real(*a))[1])
    good = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                       "x-cache-test": len(calls)})
    for _ in range(3):
        assert validate_structured_outputs(StructuredOutputsParams(json=good)) == "xgrammar"
    assert len(calls) == 1
    bad = '{"type": "object", "properties": {"a": {"type": "strin"}}}'
    for field in ("response_format.json_schema.schema", "guided_json", None):
        with pytest.raises(ValueError) as info:
            validate_structured_outputs(StructuredOutputsParams(json=bad), "xgrammar",
                                        field=field)
        assert str(info.value).startswith(field or "structured_outputs.json")
    assert len(calls) == 2
    # the options are part of the key: a different option is checked again
    validate_structured_outputs(StructuredOutputsParams(json=good, disable_any_whitespace=True))
    assert len(calls) == 3
    # a spec over 64 KiB is checked every time (the cache's size stays bounded)
    huge = json.dumps({"type": "object", "description": "x" * (64 * 1024)})
    for _ in range(2):
        validate_structured_outputs(StructuredOutputsParams(json=huge))
    assert len(calls) == 5


def test_strict_format_patterns_are_exactly_the_format_checkers():
    import datetime
    import ipaddress
    import re

    from flowengine.structured_outputs.backend import STRICT_FORMAT_PATTERNS

    date, ipv4 = (re.compile(STRICT_FORMAT_PATTERNS[k]) for k in ("date", "ipv4"))
    for year in [*range(0, 420), *range(1890, 2110), 9600, 9999]:
        for month in range(14):
            for day in range(33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = bool(datetime.date.fromisoformat(text))
                except ValueError:
                    valid = False
                assert bool(date.fullmatch(text)) == valid, text
    for octet in range(300):
        for text in (f"{octet}.1.22.3", f"0{octet}.1.2.3", f"9.8.7.{octet}", f"1.2.3.00{octet}"):
            try:
                valid = bool(ipaddress.IPv4Address(text))
            except ValueError:
                valid = False
            assert bool(ipv4.fullmatch(text)) == valid, text


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_ipv4_and_date_formats_are_exact(name, tokenizer, vocab_size):
    # xgrammar's own ipv4 and date grammars take "014" octets and "2023-02-30";
    # llguidance's date takes "2023-02-29" and year 0000.
    backend = (XgrammarBackend(tokenizer, vocab_size) if name == "xgrammar" else
               GuidanceBackend(tokenizer, vocab_size, eos_token_id=tokenizer.eos_token_id))
    eos = tokenizer.eos_token_id

    def accepts(schema: dict, value: str) -> bool:
        spec = json.dumps({"type": "object", "properties": {"v": schema}, "required": ["v"]})
        matcher = backend.compile("json", spec, OPTS).new_matcher([eos])
        ids = tokenizer.encode(json.dumps({"v": value}), add_special_tokens=False)
        return all(matcher.accept_token(t) for t in [*ids, eos])

    nested = {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "null"}]}
    for ok in ("54.242.131.14", "0.0.0.0", "255.255.255.255"):
        assert accepts(nested, ok), ok
    for bad in ("54.242.131.014", "01.2.3.4", "256.1.1.1"):
        assert not accepts(nested, bad), bad
    date = {"type": "string", "format": "date"}
    for ok in ("2024-02-29", "2000-02-29", "2023-12-31", "0001-01-01"):
        assert accepts(date, ok), ok
    for bad in ("2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01"):
        assert not accepts(date, bad), bad
    assert not accepts(date, "0000-01-01")
    if name == "guidance":  # a length bound sends a formatted string to llguidance
        bounded = {"type": "string", "format": "date", "maxLength": 10}
        assert accepts(bounded, "2024-02-29") and not accepts(bounded, "2023-02-29")


def test_choice_ebnf_escapes():
    assert choice_to_ebnf(['a"b', "c\\d", "é\n"]) == 'root ::= "a\\"b" | "c\\\\d" | "é\\n"'


def _request(req_id: str, so: StructuredOutputsParams, eos: int, outputs=()) -> Request:
    r = Request(req_id, [1, 2, 3], SamplingParams(structured_outputs=so), eos_token_id=eos,
                max_tokens=64)
    r.output_token_ids = list(outputs)
    return r


def test_manager_compiles_once_per_spec_off_the_calling_thread(tokenizer, vocab_size):
    threads = []

    def loader():
        threads.append(threading.current_thread().name)
        return tokenizer

    manager = StructuredOutputManager("auto", vocab_size=vocab_size, tokenizer_loader=loader)
    eos = tokenizer.eos_token_id
    so = StructuredOutputsParams(regex="[a-c]{2}")
    reqs = [_request(f"r{i}", so, eos) for i in range(3)]
    for r in reqs:
        manager.add_request(r)
    assert manager.num_compiling == 3
    while manager.num_compiling:
        manager.wait_for_compiles(5.0)
        for r in reqs:
            assert manager.poll(r) in (None, "compiling")
    assert manager.num_compiled == 1 and manager.num_matchers == 3
    assert threads and threads[0].startswith("fe-grammar")  # not the scheduler's thread
    mask = torch.frombuffer(bytearray(manager.fill_bitmask(["r0", "r2"])), dtype=torch.int32)
    assert mask.shape == (2 * bitmask_words(vocab_size),)
    ab = tokenizer.encode("ab", add_special_tokens=False)
    assert manager.accept_tokens("r0", ab)
    assert not manager.accept_tokens("r1", tokenizer.encode("zz", add_special_tokens=False))
    manager.remove("r0")
    assert not manager.has_matcher("r0") and manager.has_matcher("r2")
    # Replay after a restart: delivered tokens are accepted before the first mask...
    replay = _request("r3", so, eos, outputs=ab)
    manager.add_request(replay)
    manager.wait_for_compiles(5.0)
    assert manager.poll(replay) is None
    assert allowed(manager._matchers["r3"], vocab_size) == {eos}
    # Past the end (ignore_eos): the mask allows only the stop token, and only it is taken.
    assert manager.accept_tokens("r3", [eos]) and manager._matchers["r3"].is_terminated()
    row = torch.frombuffer(bytearray(manager.fill_bitmask(["r3"])), dtype=torch.int32)
    assert torch.nonzero(((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1)
                         .flatten()).flatten().tolist() == [eos]
    assert manager.accept_tokens("r3", [eos, eos])
    assert not manager.accept_tokens("r3", ab[:1])
    # ... and tokens that do not match fail the request with a message.
    wrong = _request("r4", so, eos, outputs=tokenizer.encode("zz", add_special_tokens=False))
    manager.add_request(wrong)
    manager.wait_for_compiles(5.0)
    assert "does not match its grammar" in manager.poll(wrong)
    # An invalid grammar fails only its own request.
    broken = _request("r5", StructuredOutputsParams(regex="a("), eos)
    manager.add_request(broken)
    manager.wait_for_compiles(5.0)
    assert "structured_outputs.regex is invalid" in manager.poll(broken)
    assert not manager.has_matcher("r5") and manager.num_compiling == 0
    manager.shutdown()


def test_json_schema_properties_are_generated_in_the_schema_order(backend, tokenizer,
                                                                  vocab_size):
    """A schema's properties come out in the order it lists them (vLLM passes the
    schema as given): "reasoning" before "answer" is how a caller asks the model to
    think first. The canonical spec once sorted the keys, so "answer" came first."""
    eos = tokenizer.eos_token_id
    schema = {"type": "object",
              "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    for so in (StructuredOutputsParams(json=schema),
               StructuredOutputsParams(json=json.dumps(schema))):
        assert list(json.loads(so.spec)["properties"]) == ["reasoning", "answer"]
        grammar = backend.compile("json", so.spec, OPTS)
        matcher = grammar.new_matcher([eos])
        for t in tokenizer.encode('{"reasoning":"2+2=4","answer":4}', add_special_tokens=False):
            assert matcher.accept_token(t)
        assert eos in allowed(matcher, vocab_size)
