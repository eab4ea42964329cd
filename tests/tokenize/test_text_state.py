"""IncrementalTextState: detokenization and stop strings together, token by token."""

from __future__ import annotations

import pytest

from flowengine.sampling_params import SamplingParams
from flowengine.tokenize.text_state import IncrementalTextState


def run(
    tokenizer, text: str, params: SamplingParams, chunk: int = 1
) -> tuple[list[str], str | None]:
    """Stream the tokens of `text` in chunks; the last chunk finishes the request."""
    ids = tokenizer.encode(text)
    state = IncrementalTextState(tokenizer, tokenizer.encode("Q: "), params)
    deltas, matched = [], None
    for i in range(0, len(ids), chunk):
        delta, m = state.process(ids[i : i + chunk], finished=i + chunk >= len(ids))
        deltas.append(delta)
        matched = matched or m
    assert "".join(deltas) == state.output_text
    assert state.stop_reason == matched
    return deltas, matched


def test_stop_string_across_token_boundaries(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    assert len(tok.encode("world! Hello")) > 2
    deltas, matched = run(tok, "Hello world! Hello there", SamplingParams(stop=["world! Hello"]))
    assert ("".join(deltas), matched) == ("Hello ", "world! Hello")


def test_stop_string_inside_one_token(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    assert tok.convert_ids_to_tokens(tok.encode("Hello")) == ["Hello"]
    deltas, matched = run(tok, "Hello there", SamplingParams(stop=["ell"]))
    assert ("".join(deltas), matched) == ("H", "ell")


@pytest.mark.parametrize(("include", "expected"), [(False, "Café, "), (True, "Café, naïve")])
def test_include_stop_str_in_output(byte_bpe_tokenizer, include: bool, expected: str) -> None:
    params = SamplingParams(stop=["naïve"], include_stop_str_in_output=include)
    deltas, matched = run(byte_bpe_tokenizer, "Café, naïve, résumé", params)
    assert ("".join(deltas), matched) == (expected, "naïve")


def test_earliest_of_several_stop_strings(byte_bpe_tokenizer) -> None:
    params = SamplingParams(stop=["lazy", "fox", "dog"])
    deltas, matched = run(
        byte_bpe_tokenizer, "The quick brown fox jumps over the lazy dog.", params
    )
    assert ("".join(deltas), matched) == ("The quick brown ", "fox")


def test_nothing_after_the_stop_is_ever_emitted(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    state = IncrementalTextState(tok, [], SamplingParams(stop=["世界"]))
    assert state.process(tok.encode("A 世界 B"), finished=False) == ("A ", "世界")
    assert state.process(tok.encode(" more text"), finished=True) == ("", None)
    assert state.output_text == "A "


def test_held_back_prefix_released_on_finish(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    deltas, matched = run(tok, "the end. STO", SamplingParams(stop=["STOP"]))
    assert matched is None
    assert "".join(deltas) == "the end. STO"
    assert deltas[-1].endswith("STO")  # held until the last (finishing) call


def test_split_emoji_then_stop(byte_bpe_tokenizer) -> None:
    deltas, matched = run(byte_bpe_tokenizer, "a🦀b🦀c", SamplingParams(stop=["b🦀"]))
    assert ("".join(deltas), matched) == ("a🦀", "b🦀")
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(("include", "expected"), [(False, "abc"), (True, "abc<|im_end|>")])
def test_stopped_by_token_leaves_its_text_out(
    byte_bpe_tokenizer, include: bool, expected: str
) -> None:
    tok = byte_bpe_tokenizer
    eos = tok.eos_token_id
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    state = IncrementalTextState(tok, [], params)
    delta, matched = state.process([*tok.encode("abc"), eos], finished=True, stopped_by_token=True)
    assert (delta, matched) == (expected, None)


def test_no_stop_strings_streams_everything(byte_bpe_tokenizer) -> None:
    text = "Hello 世界 👋🏽 naïve"
    for chunk in (1, 3):
        deltas, matched = run(byte_bpe_tokenizer, text, SamplingParams(), chunk=chunk)
        assert ("".join(deltas), matched) == (text, None)


def test_stop_strings_wait_for_min_tokens(byte_bpe_tokenizer) -> None:
    """vLLM v1: stop strings are checked only after min_tokens tokens, so a stop string
    in the text of the first min_tokens tokens does not end the completion."""
    tok = byte_bpe_tokenizer
    text = "Hello world! Hello there"
    ids = tok.encode(text)
    first = tok.encode("Hello")
    assert ids[: len(first)] == first  # "Hello" is the completion's first token(s)
    deltas, matched = run(tok, text, SamplingParams(stop=["Hello"]))
    assert ("".join(deltas), matched) == ("", "Hello")
    params = SamplingParams(stop=["Hello"], min_tokens=len(first))
    deltas, matched = run(tok, text, params)
    assert ("".join(deltas), matched) == ("Hello world! ", "Hello")
    params = SamplingParams(stop=["Hello"], min_tokens=len(ids))
    deltas, matched = run(tok, text, params)
    assert ("".join(deltas), matched) == (text, None)


def test_stop_string_may_start_within_min_tokens_and_end_after(byte_bpe_tokenizer) -> None:
    """vLLM v1 checks, once min_tokens tokens exist, every stop string that ends in the
    new text, including one that starts in the text of the first min_tokens tokens;
    such a match used to be missed (the checker saw no text from before the boundary)."""
    tok = byte_bpe_tokenizer
    text = "Hello world! Hello there"
    ids = tok.encode(text)
    head = tok.encode("Hello world")
    assert ids[: len(head)] == head and len(tok.encode("Hello world!")) > len(head)
    for stop, want in ((["world!"], "Hello "), (["d!", "world"], "Hello worl")):
        deltas, matched = run(tok, text, SamplingParams(stop=stop, min_tokens=len(head)))
        assert ("".join(deltas), matched) == (want, stop[0])
    # One that ends within the first min_tokens tokens never matches.
    deltas, matched = run(tok, text, SamplingParams(stop=["world"], min_tokens=len(head)))
    assert ("".join(deltas), matched) == (text, None)
