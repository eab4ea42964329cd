"""`<think>` reasoning parsers (qwen3, deepseek_r1): exact splits of hand-written
outputs, and streamed splits equal to the non-streamed one however the text is cut."""

from __future__ import annotations

import json
import random

import pytest

from flowengine.reasoning import REASONING_PARSERS, get_reasoning_parser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # a template that opens the block
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False

CASES = [
    # (parser, prompt, output, reasoning_content, content)
    (QWEN3, None, "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "\n\nHello!"),
    (QWEN3, None, "Hello!", None, "Hello!"),
    (QWEN3, None, "</think> is a tag", None, "</think> is a tag"),
    (QWEN3, None, "<think>cut by max_tokens", "cut by max_tokens", None),
    (QWEN3, None, "<think></think>Only content", None, "Only content"),
    (QWEN3, None, "<thin", None, "<thin"),
    (QWEN3, OPEN_PROMPT, "so 2 + 2 = 4.\n</think>\n\n4", "so 2 + 2 = 4.\n", "\n\n4"),
    (QWEN3, CLOSED_PROMPT, "4", None, "4"),
    (R1, None, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    (R1, None, "<think>Let me think.</think>4", "Let me think.", "4"),
    (R1, None, "still thinking when cut", "still thinking when cut", None),
    (R1, None, "a < b, so </think>\nb", "a < b, so ", "\nb"),
]


@pytest.mark.parametrize(("cls", "prompt", "text", "reasoning", "content"), CASES)
def test_extract_exact(cls, prompt, text, reasoning, content):
    assert cls.extract(text, prompt) == (reasoning, content)


@pytest.mark.parametrize(("cls", "prompt", "text", "reasoning", "content"), CASES)
def test_streamed_split_equals_non_streamed(cls, prompt, text, reasoning, content):
    rng = random.Random()
    for _ in range(40):
        parser = cls(prompt)
        parts = []
        i = 0
        while i < len(text):
            k = rng.randint(1, 5)
            parts.append(parser.feed(text[i : i + k]))
            i += k
        parts.append(parser.finish())
        r = "".join(p[0] for p in parts) or None
        c = "".join(p[1] for p in parts) or None
        assert (r, c) == (reasoning, content)


def test_end_tag_is_held_back_while_it_may_be_arriving():
    parser = QWEN3(None)
    assert parser.feed("<think>abc</th") == ("abc", "")
    assert not parser.is_reasoning_end
    assert parser.feed("ink>Hi") == ("", "Hi")
    assert parser.is_reasoning_end


def test_registry():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize(
    ("cls", "accepted", "refused"),
    [
        (QWEN3, ['{"a": 1}', '<think>hmm, {x}</think>\n\n{"a": 1}'],
         ['hmm</think>{"a": 1}', "no json", '{"a": "x"}']),
        (R1, ['hmm</think>{"a": 1}', '<think>hmm</think>\n{"a": 1}'],
         ['{"a": 1}', 'hmm</think>no json']),
    ],
)
def test_json_constraint_applies_after_the_think_block(cls, accepted, refused):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = xgr.Grammar.from_structural_tag(json.dumps(cls.gated_structural_tag(schema)))
    for text in accepted:
        assert _is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), text


ARITH = 'root ::= num (" + " num)*\nnum ::= [1-9] [0-9]*'
ARITH_LARK = 'start: NUM (" + " NUM)*\nNUM: /[1-9][0-9]*/'


@pytest.mark.parametrize(
    ("so", "valid", "invalid"),
    [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, "555-1234", "555 1234"),
        ({"choice": ["yes", "no", "maybe so"]}, "maybe so", "perhaps"),
        ({"grammar": ARITH}, "12 + 7 + 30", "12 + 07"),
        ({"grammar": ARITH_LARK}, "12 + 7", "12 - 7"),
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                   "required": ["a"]}}, '{"a": 1}', '{"a": "x"}'),
        ({"json_object": True}, '{"b": [1]}', "[1]"),
    ],
    ids=["regex", "choice", "ebnf", "lark", "json", "json_object"],
)
@pytest.mark.parametrize("cls", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_every_constraint_kind_applies_after_the_think_block(cls, so, valid, invalid):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from flowengine.sampling_params import StructuredOutputsParams

    gated = cls.gated_constraint(StructuredOutputsParams(**so))
    assert gated.kind == "structural_tag"
    grammar = xgr.Grammar.from_structural_tag(gated.spec)
    # JSON may follow the block after whitespace; the other kinds start right after it.
    sep = "\n\n" if "json" in so or "json_object" in so else ""
    think = "<think>{maybe} 555-1234? </think>" if cls is QWEN3 else "{maybe} no</think>"
    accepted = [think + sep + valid] + ([valid] if cls is QWEN3 else [])
    refused = [think + sep + invalid, think + "\n" + valid if not sep else think + "x" + valid,
               valid + " " + think]
    if cls is R1:
        refused.append(valid)  # deepseek_r1 always reasons first
    else:
        refused.append("hmm</think>" + valid)  # qwen3 opens its own block
    for text in accepted:
        assert _is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not _is_grammar_accept_string(grammar, text), text
    # The content of an accepted output is exactly in the constraint's language.
    assert cls.extract(think + sep + valid)[1] == sep + valid


def test_a_structural_tag_and_an_llguidance_only_schema_stay_as_given():
    from flowengine.sampling_params import StructuredOutputsParams

    tag = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "const_string", "value": "x"}})
    assert QWEN3.gated_constraint(tag) is tag
    # xgrammar ignores "not": a structural tag (compiled by xgrammar) would not enforce it.
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}})
    assert QWEN3.gated_constraint(schema) is schema
