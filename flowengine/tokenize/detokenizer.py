"""Incremental detokenization: token ids in, UTF-8-safe text deltas out.

Algorithm: vLLM's `detokenize_incrementally` (prefix and read offsets). A token's
text can depend on its neighbours (byte-level BPE splits a character's UTF-8 bytes
across tokens; SentencePiece drops the space of a sequence's first token), so each
step decodes a short window that starts a few tokens back (`prefix_offset`) and
emits only what lies beyond the text already emitted (`read_offset`). When the window
ends in U+FFFD, the last character's bytes are incomplete: nothing is emitted and the
offsets stay, so the next token completes the character. Each step decodes a window
of a few tokens, never the whole text: O(1) work per token.

Byte-level BPE fast path: with a plain ByteLevel decoder a window's text is the lossy
UTF-8 decoding of its tokens' bytes (see decode_table.py), and a read offset always
sits where the bytes so far end in a whole character (a window ending in U+FFFD is
never emitted). The decoding of the window then splits at the read offset, so the
text to emit is the decoding of the bytes past it alone: the detokenizer keeps those
bytes and decodes them, with no call into the tokenizer. It emits exactly what the
window algorithm emits, token by token. It needs the prompt context to end in a whole
character too; a prompt cut inside a character takes the window algorithm.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from flowengine.tokenize.decode_table import DecodeTable, decode_table

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens of left context.
_PROMPT_CONTEXT_TOKENS = 5
# Token strings before prefix_offset are dropped once this many pile up.
_TRIM_THRESHOLD = 64
_REPLACEMENT_CHAR = "\ufffd"

_texts_by_table: weakref.WeakKeyDictionary[DecodeTable, dict[int, str]] = (
    weakref.WeakKeyDictionary()
)


def _token_texts(table: DecodeTable) -> dict[int, str]:
    """Token id -> the lossy UTF-8 decoding of that token's bytes alone, filled lazily
    and shared by every request of one tokenizer (byte-level fast path only)."""
    texts = _texts_by_table.get(table)
    if texts is None:
        texts = _texts_by_table[table] = {}
    return texts


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, delta by delta.

    Args:
        tokenizer: a fast tokenizer (`load_tokenizer`); raises ValueError otherwise.
        prompt_token_ids: the prompt, whose last tokens give the first output token
            its left context (a leading space, the rest of a split character).
        skip_special_tokens: drop the tokenizer's special tokens (the Rust
            tokenizer's special added tokens and the named ones such as EOS) from the
            text, as `tokenizer.decode(ids, skip_special_tokens=True)` does.
        spaces_between_special_tokens: accepted for vLLM API parity. Fast tokenizers
            decode added tokens with no inserted spaces, in Hugging Face `decode` and
            in vLLM v1 alike, and this detokenizer matches `decode`, so with a fast
            tokenizer (the only kind accepted) both values give the same text.

    `output_text` is the concatenation of every delta returned, and equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    once `flush()` has run (for tokenizers whose decoding of a token does not depend
    on its left context; otherwise it is the text in the prompt's context).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        if not tokenizer.is_fast:
            raise ValueError(
                "IncrementalDetokenizer needs a fast tokenizer; load it with load_tokenizer()"
            )
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        table = decode_table(tokenizer)
        self._backend = table.backend
        self._decoder = table.decoder
        self._skip_ids = table.special_ids if skip_special_tokens else frozenset()
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        # NOTE: token strings from prefix_offset on; _read_offset indexes the same list.
        self._tokens: list[str] = self._to_tokens(context)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._prefix_text: str | None = None  # text of tokens[prefix_offset:read_offset]
        self._parts: list[str] = []
        # Byte-level fast path (module docstring): bytes of the tokens past read_offset.
        self._table = table if table.is_byte_level else None
        self._token_texts = _token_texts(table)
        self._pending = b""
        if self._table is not None and self._decode(self._tokens).endswith(_REPLACEMENT_CHAR):
            self._table = None  # the prompt ends inside a character

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = []
        for token_id in token_ids:
            if token_id in self._skip_ids:
                continue
            # An id beyond the tokenizer's vocabulary (padded embedding rows) has no text.
            token = self._backend.id_to_token(token_id)
            tokens.append("" if token is None else token)
        return tokens

    def _decode(self, tokens: list[str]) -> str:
        if self._decoder is None:
            return " ".join(tokens)
        return self._decoder.decode(tokens)

    def _step(self, force: bool) -> str:
        """Emit the text of tokens past read_offset, unless it may end mid-character."""
        prefix_text = self._prefix_text
        if prefix_text is None:  # the window's start moved: decode its prefix once
            prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            self._prefix_text = prefix_text
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not force:
            return ""  # incomplete UTF-8 sequence: wait for the next token's bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int]) -> str:
        """Add generated token ids; return the new text that is safe to show.

        Returns "" while the last character is incomplete; its text comes with a later
        token or with `flush()`.
        """
        if self._table is not None:
            text = self._update_bytes(new_token_ids)
        else:
            deltas = []
            for token in self._to_tokens(new_token_ids):
                self._tokens.append(token)
                delta = self._step(force=False)
                if delta:
                    deltas.append(delta)
            text = "".join(deltas)
        if text:
            self._parts.append(text)
        return text

    def _update_bytes(self, new_token_ids: list[int]) -> str:
        """`update` on the byte-level fast path: token by token, emit the pending bytes'
        text unless it ends in U+FFFD (an incomplete or invalid last character)."""
        table = self._table
        token_texts = self._token_texts
        skip_ids = self._skip_ids
        pending = self._pending
        text = ""
        for token_id in new_token_ids:
            if token_id in skip_ids:
                continue
            if not pending:
                # The usual case: nothing held back, so the pending bytes are this
                # token's alone and their decoding is cached per tokenizer.
                piece = token_texts.get(token_id)
                if piece is None:
                    piece = table.token_bytes(token_id).decode("utf-8", "replace")  # type: ignore[union-attr]
                    token_texts[token_id] = piece
                if piece and piece[-1] != _REPLACEMENT_CHAR:
                    text += piece
                else:  # ends inside a character (or has no bytes): hold its bytes back
                    pending = table.token_bytes(token_id)  # type: ignore[union-attr]
                continue
            pending += table.token_bytes(token_id)  # type: ignore[union-attr]
            new_text = pending.decode("utf-8", "replace")
            if new_text and new_text[-1] != _REPLACEMENT_CHAR:
                text += new_text
                pending = b""
        self._pending = pending
        return text

    def flush(self) -> str:
        """At the end of the request: the held-back text, even if it ends in U+FFFD
        (the model stopped inside a character)."""
        if self._table is not None:
            text = self._pending.decode("utf-8", "replace")
            self._pending = b""
        elif self._read_offset == len(self._tokens):
            return ""
        else:
            text = self._step(force=True)
        if text:
            self._parts.append(text)
        return text

    @property
    def output_text(self) -> str:
        """Everything returned by `update`/`flush` so far, joined (O(length) per call
        after new text: read it at the end, not per token)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""
