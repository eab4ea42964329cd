"""IncrementalDetokenizer: deltas join to `decode(ids)`, never a partial character."""

from __future__ import annotations

import random

import pytest

from flowengine.tokenize.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"

# Pieces that stress byte-level BPE: multi-byte UTF-8, emoji with skin tones, ZWJ
# sequences and flags (several code points per glyph), CJK, combining marks, RTL.
PIECES = [
    "a", "b", "z", " ", "  ", ",", ".", "!", "\n", "\t", "Hello", " world", "the",
    "é", "e\u0301", "n\u0303", "ß", "ç", "Ω", "я", "ح", "ש",
    "世", "界", "日本", "語", "한", "テ",
    "👋", "👋🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇯🇵", "🇫🇷", "❤\ufe0f", "🦀", "😀",
    "\u200d", "∑", "→", "𝔘", "\U0010fffd",
]  # fmt: skip


def random_text(rng: random.Random, max_pieces: int = 24) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, max_pieces)))


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """ids split one at a time (half the cases) or in random chunks of 1-4."""
    one_by_one = rng.random() < 0.5
    chunks, i = [], 0
    while i < len(ids):
        k = 1 if one_by_one else rng.randint(1, 4)
        chunks.append(ids[i : i + k])
        i += k
    return chunks


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detok.update(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    return deltas


def check_fuzz(tokenizer, num_cases: int) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for case in range(num_cases):
        text = random_text(rng)
        prompt_ids = tokenizer.encode(random_text(rng, 6)) if rng.random() < 0.7 else []
        ids = tokenizer.encode(text)
        deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), random_chunks(rng, ids))
        expected = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        where = f"seed={seed} case={case} text={text!r}"
        assert "".join(deltas) == expected, where
        assert not any(FFFD in d for d in deltas), where


def test_fuzz_byte_bpe_joined_deltas_equal_decode(byte_bpe_tokenizer) -> None:
    check_fuzz(byte_bpe_tokenizer, num_cases=400)


@pytest.mark.slow
def test_fuzz_smollm2_joined_deltas_equal_decode(smollm2_tokenizer) -> None:
    check_fuzz(smollm2_tokenizer, num_cases=200)


def test_split_character_is_held_until_complete(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    # 🦀 is not in the training corpus: its 4 UTF-8 bytes stay separate tokens.
    ids = tok.encode("x🦀")
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(ids) >= 3, pieces
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update([t]) for t in ids]
    assert deltas[0] == "x"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "🦀"
    assert detok.output_text == "x🦀"
    assert detok.flush() == ""


def test_flush_releases_incomplete_character(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    ids = tok.encode("ok🦀")
    truncated = ids[:-1]  # the model stopped inside the character
    detok = IncrementalDetokenizer(tok, [])
    text = detok.update(truncated)
    assert FFFD not in text
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert detok.output_text == tok.decode(truncated)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_bpe_tokenizer, skip: bool) -> None:
    tok = byte_bpe_tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start, *tok.encode("assistant\nHi 世界"), im_end, *tok.encode(" bye"), im_end]
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"), skip_special_tokens=skip)
    text = "".join(detok.update([t]) for t in ids) + detok.flush()
    if skip:
        assert text == "assistant\nHi 世界 bye"
    else:
        assert text == "<|im_start|>assistant\nHi 世界<|im_end|> bye<|im_end|>"
    assert text == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_gives_left_context_to_first_token(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    prompt = tok.encode("Hello")
    ids = tok.encode(" world")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.update(ids) == " world"


def test_out_of_vocabulary_id_has_no_text(byte_bpe_tokenizer) -> None:
    # Model vocabularies are often padded past the tokenizer's (SmolLM2: 49152 rows).
    tok = byte_bpe_tokenizer
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update([*tok.encode("ab"), len(tok) + 5, *tok.encode("c")]) == "abc"


class _SpyDecoder:
    """Wraps the Rust decoder and records the length of every window decoded."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.window_lengths: list[int] = []

    def decode(self, tokens: list[str]) -> str:
        self.window_lengths.append(len(tokens))
        return self.decoder.decode(tokens)


def window_detokenizer(tok, prompt_ids: list[int], **kwargs) -> IncrementalDetokenizer:
    """A detokenizer forced onto the window algorithm (off the byte-level fast path)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    detok._table = None
    return detok


def test_decoded_window_stays_bounded_on_long_output(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    ids = tok.encode("Hello world 世界 👋🏽 naïve 🦀 " * 200)
    detok = window_detokenizer(tok, tok.encode("prompt"))
    spy = _SpyDecoder(detok._decoder)
    detok._decoder = spy
    text = "".join(detok.update([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids)
    # A window spans the previous emission plus the pending bytes of one character.
    assert max(spy.window_lengths) <= 12
    # One decode per token, plus one of the window's prefix after each emission.
    num_emissions = sum(1 for part in detok._parts if part)
    assert len(spy.window_lengths) <= len(ids) + num_emissions + 1


def test_byte_level_fast_path_calls_no_decoder(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    ids = tok.encode("Hello world 世界 👋🏽 naïve 🦀 ")
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    assert detok._table is not None
    spy = _SpyDecoder(detok._decoder)
    detok._decoder = spy
    text = "".join(detok.update([t]) for t in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert spy.window_lengths == []


def check_fast_path_equals_window(tokenizer, num_cases: int) -> None:
    """Same deltas, update by update, from the fast path and the window algorithm,
    including ids cut inside characters and special tokens kept or skipped."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    specials = sorted(tokenizer.all_special_ids)
    for case in range(num_cases):
        prompt_ids = tokenizer.encode(random_text(rng, 6)) if rng.random() < 0.7 else []
        ids = tokenizer.encode(random_text(rng))
        if rng.random() < 0.3:
            ids = ids[: rng.randint(1, len(ids))]  # may stop inside a character
        if rng.random() < 0.3:
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        skip = rng.random() < 0.8
        chunks = random_chunks(rng, ids)
        fast = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
        window = window_detokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
        where = f"seed={seed} case={case} ids={ids} prompt={prompt_ids}"
        assert fast._table is not None, where
        assert stream(fast, chunks) == stream(window, chunks), where


def test_fast_path_deltas_equal_window_algorithm(byte_bpe_tokenizer) -> None:
    check_fast_path_equals_window(byte_bpe_tokenizer, num_cases=300)


@pytest.mark.slow
def test_fast_path_deltas_equal_window_algorithm_smollm2(smollm2_tokenizer) -> None:
    check_fast_path_equals_window(smollm2_tokenizer, num_cases=200)


def test_prompt_cut_inside_a_character_takes_the_window_algorithm(byte_bpe_tokenizer) -> None:
    tok = byte_bpe_tokenizer
    ids = tok.encode("x🦀")  # 🦀's 4 bytes are separate tokens (see above)
    prompt, output = ids[:2], ids[2:]  # the prompt ends after 🦀's first byte
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok._table is None
    # vLLM's rule: the character completed by the output is the prompt's, not emitted.
    assert "".join(detok.update([t]) for t in output) + detok.flush() == ""
