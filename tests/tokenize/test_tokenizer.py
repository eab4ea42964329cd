"""load_tokenizer, encode and TokenizerInfo on a tokenizer saved to a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowengine.tokenize.tokenizer import TokenizerInfo, encode, load_tokenizer


@pytest.fixture
def model_dir(tmp_path: Path, byte_bpe_tokenizer) -> Path:
    byte_bpe_tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_load_from_directory_round_trips(model_dir: Path, byte_bpe_tokenizer) -> None:
    tok = load_tokenizer(str(model_dir))
    assert tok.is_fast
    text = "Hello 世界 👋🏽"
    assert encode(tok, text) == byte_bpe_tokenizer.encode(text)
    assert tok.decode(encode(tok, text)) == text


def test_encode_uses_the_tokenizers_special_token_default(byte_bpe_tokenizer) -> None:
    # This tokenizer has no post-processor, so add_special_tokens adds nothing either way.
    assert encode(byte_bpe_tokenizer, "Hello") == byte_bpe_tokenizer.encode("Hello")
    assert encode(byte_bpe_tokenizer, "Hello", add_special_tokens=False) == [318]
    with pytest.raises(TypeError, match="prompt must be a str"):
        encode(byte_bpe_tokenizer, [1, 2, 3])  # type: ignore[arg-type]


def test_info_merges_generation_config_eos_ids(model_dir: Path) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 7]}))
    tok = load_tokenizer(str(model_dir))
    info = TokenizerInfo.from_tokenizer(tok, str(model_dir))
    assert info == TokenizerInfo(
        eos_token_id=2, eos_token_ids=(2, 0, 7), bos_token_id=1, vocab_size=577
    )
    assert info.extra_eos_token_ids == (0, 7)


def test_info_without_generation_config(model_dir: Path) -> None:
    tok = load_tokenizer(str(model_dir))
    info = TokenizerInfo.from_tokenizer(tok, str(model_dir))
    assert (info.eos_token_id, info.eos_token_ids, info.extra_eos_token_ids) == (2, (2,), ())


def test_info_falls_back_to_generation_config_eos(model_dir: Path) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    tok = load_tokenizer(str(model_dir))
    tok.eos_token = None
    info = TokenizerInfo.from_tokenizer(tok, str(model_dir))
    assert (info.eos_token_id, info.eos_token_ids) == (0, (0,))


def test_missing_path_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="does not exist; give an existing model directory"):
        load_tokenizer(str(tmp_path / "no-such-model"))


def test_directory_without_tokenizer_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="(?s)could not load a tokenizer from .*containing tokenizer"):
        load_tokenizer(str(tmp_path))
