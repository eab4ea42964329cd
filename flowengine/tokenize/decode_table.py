"""Per-tokenizer facts that incremental detokenization reads for every token.

Two things are computed once per tokenizer instead of once per request or per token:
the ids that `skip_special_tokens` drops, and, for byte-level BPE tokenizers (GPT-2,
Llama 3, Qwen2, SmolLM2), each token's raw bytes, so that a token's text is a table
lookup plus a UTF-8 decode of a few bytes instead of two calls into the Rust decoder.

The byte rule is the one of the `tokenizers` ByteLevel decoder
(`tokenizers/src/pre_tokenizers/byte_level.rs`, `decode_chain`): each character of a
token string maps back to one byte through GPT-2's `bytes_to_unicode` table; a token
with a character outside the table (an added token such as "<|im start|>" with a space)
contributes its own UTF-8 bytes; the concatenated bytes are decoded with
`String::from_utf8_lossy`, which replaces each maximal invalid subsequence with U+FFFD
exactly as Python's `bytes.decode("utf-8", "replace")` does (both follow the Unicode
standard's "substitution of maximal subparts", Unicode 15 §3.9).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (openai/gpt-2 encoder.py):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + num_shifted)
            num_shifted += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class DecodeTable:
    """What `IncrementalDetokenizer` needs from one tokenizer, shared by its requests.

    Attributes:
        backend: the Rust tokenizer (`tokenizers.Tokenizer`); decoder: its decoder or None.
        special_ids: ids dropped by `skip_special_tokens` (the Rust tokenizer's special
            added tokens and the named ones such as EOS), as a frozenset.
        is_byte_level: the decoder is a plain ByteLevel decoder, so `token_bytes` gives
            exact bytes; otherwise `token_bytes` must not be used.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = tokenizer.backend_tokenizer
        self.backend = backend
        # NOTE: each read of `backend.decoder` makes a new Python wrapper; keep one.
        self.decoder = backend.decoder
        self.vocab_size = len(tokenizer)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        special.update(tokenizer.all_special_ids)
        self.special_ids = frozenset(special)
        self.is_byte_level = isinstance(self.decoder, decoders.ByteLevel)
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token under the ByteLevel decoder (b"" for an id beyond the
        vocabulary, such as a padded embedding row). Cached: computed once per id."""
        data = self._bytes.get(token_id)
        if data is None:
            token = self.backend.id_to_token(token_id)
            if token is None:
                data = b""
            else:
                try:
                    data = bytes([_CHAR_TO_BYTE[c] for c in token])
                except KeyError:
                    data = token.encode("utf-8")
            self._bytes[token_id] = data
        return data


_tables: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, DecodeTable] = (
    weakref.WeakKeyDictionary()
)


def decode_table(tokenizer: PreTrainedTokenizerBase) -> DecodeTable:
    """The shared `DecodeTable` of `tokenizer`, rebuilt when tokens were added to it."""
    table = _tables.get(tokenizer)
    if table is None or table.vocab_size != len(tokenizer):
        table = _tables[tokenizer] = DecodeTable(tokenizer)
    return table
