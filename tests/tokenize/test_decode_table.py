"""DecodeTable: byte-level token bytes agree with the Rust ByteLevel decoder."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from flowengine.tokenize.decode_table import DecodeTable, bytes_to_unicode, decode_table


def copy_of(tokenizer) -> PreTrainedTokenizerFast:
    """A private tokenizer with the same vocabulary, for tests that add tokens."""
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


def check_every_token(tokenizer) -> None:
    table = DecodeTable(tokenizer)
    assert table.is_byte_level
    decoder = tokenizer.backend_tokenizer.decoder
    backend = tokenizer.backend_tokenizer
    for token_id in range(len(tokenizer)):
        token = backend.id_to_token(token_id)
        expected = decoder.decode([token])
        assert table.token_bytes(token_id).decode("utf-8", "replace") == expected, token_id


def test_every_token_decodes_like_the_rust_decoder(byte_bpe_tokenizer) -> None:
    check_every_token(byte_bpe_tokenizer)


@pytest.mark.slow
def test_every_smollm2_token_decodes_like_the_rust_decoder(smollm2_tokenizer) -> None:
    check_every_token(smollm2_tokenizer)


def test_lossy_utf8_decoding_matches_the_rust_decoder() -> None:
    """Python's "replace" and Rust's from_utf8_lossy put U+FFFD in the same places,
    on random byte strings rich in lead, continuation and never-valid bytes."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    char_of = bytes_to_unicode()
    decoder = decoders.ByteLevel()
    tricky = [0x41, 0x80, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x9F]
    for _ in range(3000):
        data = bytes(
            rng.choice(tricky) if rng.random() < 0.8 else rng.randrange(256)
            for _ in range(rng.randint(1, 8))
        )
        token = "".join(char_of[b] for b in data)
        assert decoder.decode([token]) == data.decode("utf-8", "replace"), (seed, data)


def test_added_token_outside_the_byte_table_keeps_its_utf8(byte_bpe_tokenizer) -> None:
    tok = copy_of(byte_bpe_tokenizer)
    token_id = len(tok)
    tok.add_tokens(["<tool call é>"])  # a space and é: not byte-table characters
    table = decode_table(tok)
    assert table.token_bytes(token_id) == "<tool call é>".encode()
    assert tok.decode([token_id]) == "<tool call é>"


def test_table_is_shared_and_rebuilt_when_tokens_are_added(byte_bpe_tokenizer) -> None:
    tok = copy_of(byte_bpe_tokenizer)
    first = decode_table(tok)
    assert decode_table(tok) is first
    assert first.special_ids == frozenset(tok.all_special_ids) | {0, 1, 2}
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    rebuilt = decode_table(tok)
    assert rebuilt is not first
    assert tok.convert_tokens_to_ids("<|tool|>") in rebuilt.special_ids


def test_other_decoders_are_not_byte_level() -> None:
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    assert not DecodeTable(PreTrainedTokenizerFast(tokenizer_object=backend)).is_byte_level
