"""Tokenizers for the text-side tests.

`byte_bpe_tokenizer` is a GPT-2-style byte-level BPE trained here in milliseconds on a
small mixed-script corpus, so the fuzz tests need no download. `smollm2_tokenizer`
is the default model's real tokenizer, when the model can be resolved.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you doing today?",
    "Café, naïve, résumé, über, façade, jalapeño, crème brûlée.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "世界你好，今天天气很好。東京は晴れです。",
    "Emoji: 👋🏽 🙂 😀 🎉 👨‍👩‍👧‍👦 🇯🇵 🇫🇷 ❤️ 🔥",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم",
    "def main():\n    print('hi')\n    return 0\n",
]


def _train_byte_bpe() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="session")
def byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab 700, 3 special tokens, EOS = <|im_end|>), no chat template."""
    return _train_byte_bpe()


@pytest.fixture
def fresh_byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A private copy, for tests that set attributes such as chat_template."""
    return _train_byte_bpe()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The default model's tokenizer (SmolLM2-135M-Instruct), via the model resolver."""
    resolve = pytest.importorskip("flowengine.model.resolve")
    from flowengine.tokenize.tokenizer import load_tokenizer

    resolved = resolve.resolve_model(None)
    return load_tokenizer(str(resolved.path))
