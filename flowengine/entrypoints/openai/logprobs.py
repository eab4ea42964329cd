"""Engine log-probabilities → OpenAI's two formats.

The engine gives, per generated token, a dict token id → `Logprob(logprob, rank,
decoded_token)` holding the top-N tokens (ranks 1..N) plus the sampled token
(`flowengine.outputs.SampleLogprobs`).

- Chat (OpenAI chat completion object): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...N]}], "refusal": null}`.
- Legacy completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
  dict token text → logprob of the top N plus the sampled token, so with N = 0 the
  sampled token alone: OpenAI's "at most logprobs+1 elements", as vLLM gives it) and
  `text_offset` (character offset of each token in the choice's text).

JSON has no -inf; like vLLM, log-probabilities are clamped at -9999.0.

Chat `bytes` are the token's own bytes (OpenAI: "useful when characters are
represented by multiple tokens and their byte representations must be combined"), so
a token holding part of a UTF-8 character gives that part, not U+FFFD's bytes
(`token_bytes`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from flowengine.outputs import Logprob

MIN_LOGPROB = -9999.0
# num_top for a request's `-1` (the whole vocabulary): every ranked token is listed.
ALL_LOGPROBS = 1 << 62
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"  # SentencePiece's word-boundary mark "▁"


@lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """Character → byte of the byte-level BPE alphabet (GPT-2, RoBERTa, Llama 3, Qwen,
    SmolLM2): printable Latin-1 bytes stand for themselves, the other 68 bytes are
    mapped in order to U+0100 and up, so every byte is one visible character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


def _decoder_kind(tokenizer: Any) -> str:
    """ "byte_level", "byte_fallback" or "text", from a Hugging Face fast tokenizer's
    decoder (cached on the tokenizer object)."""
    kind = getattr(tokenizer, "_flowengine_token_bytes_kind", None)
    if kind is not None:
        return kind
    kind = "text"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        described = repr(decoder)
        if "ByteLevel" in described:
            kind = "byte_level"
        elif "ByteFallback" in described:
            kind = "byte_fallback"
    try:
        tokenizer._flowengine_token_bytes_kind = kind
    except AttributeError:  # a tokenizer that takes no attributes: look it up each time
        pass
    return kind


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The raw bytes of one token (its piece of the UTF-8 output).

    Byte-level BPE tokens are mapped back through the byte alphabet; SentencePiece
    byte-fallback tokens `<0xNN>` are that byte, and "▁" is a space. For other
    tokenizers (or a token outside these forms) the UTF-8 of `text`, the token's
    decoded text.
    """
    kind = _decoder_kind(tokenizer)
    if kind != "text":
        piece = tokenizer.convert_ids_to_tokens([token_id])[0]
        if isinstance(piece, str):
            if kind == "byte_level":
                table = _byte_level_decoding()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
            else:
                if m := _BYTE_FALLBACK.match(piece):
                    return bytes([int(m.group(1), 16)])
                return piece.replace(_SPIECE_SPACE, " ").encode()
    return text.encode()


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _text(token_id: int, lp: Logprob, tokenizer: Any) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked


def _sampled(entry: dict[int, Logprob], token_id: int) -> Logprob:
    lp = entry.get(token_id)
    if lp is None:
        raise ValueError(f"the engine's logprobs lack the sampled token {token_id}")
    return lp


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """The `content` list for the given tokens (one entry per token)."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        lp = _sampled(entry, token_id)
        text = _text(token_id, lp, tokenizer)
        top = []
        for tid, tlp in _top(entry, num_top):
            ttext = _text(tid, tlp, tokenizer)
            top.append(
                {
                    "token": ttext,
                    "logprob": _clamp(tlp.logprob),
                    "bytes": list(token_bytes(tokenizer, tid, ttext)),
                }
            )
        content.append(
            {
                "token": text,
                "logprob": _clamp(lp.logprob),
                "bytes": list(token_bytes(tokenizer, token_id, text)),
                "top_logprobs": top,
            }
        )
    return content


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    tokenizer: Any,
    text_offset: int,
) -> dict[str, list[Any]]:
    """Legacy lists for the given tokens; offsets start at `text_offset` characters.

    Args:
        token_ids: the tokens, one per position.
        logprobs: per position, the engine's token id → Logprob (top-N plus sampled).
        num_top: N, the request's `logprobs`; each `top_logprobs` entry holds the top N
            and the sampled token (the sampled token alone for 0).
        tokenizer: decodes tokens whose Logprob carries no text.
        text_offset: character offset of the first token in the choice's text.

    Raises:
        ValueError: an entry lacks its sampled token.
    """
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        lp = _sampled(entry, token_id)
        text = _text(token_id, lp, tokenizer)
        out["tokens"].append(text)
        out["token_logprobs"].append(_clamp(lp.logprob))
        # NOTE: the sampled token is always listed, also for num_top 0 (OpenAI's
        # legacy API and vLLM: top N "+1"); a None here would read as "no logprob".
        top = {_text(t, tlp, tokenizer): _clamp(tlp.logprob) for t, tlp in _top(entry, num_top)}
        top.setdefault(text, _clamp(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def extend_completion_logprobs(acc: dict[str, list[Any]], more: dict[str, list[Any]]) -> None:
    for key, values in more.items():
        acc[key].extend(values)


def echo_completion_logprobs(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    tokenizer: Any,
) -> dict[str, list[Any]]:
    """Legacy lists for an echoed prompt (completions `echo` with `logprobs`): the
    first token has no logprob (None in token_logprobs and top_logprobs, as OpenAI and
    vLLM give it); offsets start at 0."""
    first = prompt_token_ids[0]
    text = tokenizer.decode([first])
    out: dict[str, list[Any]] = {
        "tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0],
    }  # fmt: skip
    rest = completion_logprobs(
        prompt_token_ids[1:], [e or {} for e in prompt_logprobs[1:]], num_top, tokenizer,
        len(text),
    )
    extend_completion_logprobs(out, rest)
    return out


def prompt_logprobs_json(
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` response field: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}} (JSON keys are strings)."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            str(tid): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                       "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]  # fmt: skip
