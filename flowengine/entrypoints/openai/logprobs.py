"""Engine log-probabilities → OpenAI's two formats.

The engine gives, per generated token, a dict token id → `Logprob(logprob, rank,
decoded_token)` holding the top-N tokens (ranks 1..N) plus the sampled token
(`flowengine.outputs.SampleLogprobs`).

- Chat (OpenAI chat completion object): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...N]}], "refusal": null}`.
- Legacy completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
  dict token text → logprob of the top N plus the sampled token, None when N is 0)
  and `text_offset` (character offset of each token in the choice's text).

JSON has no -inf; like vLLM, log-probabilities are clamped at -9999.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flowengine.outputs import Logprob

MIN_LOGPROB = -9999.0


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
                {"token": ttext, "logprob": _clamp(tlp.logprob), "bytes": list(ttext.encode())}
            )
        content.append(
            {
                "token": text,
                "logprob": _clamp(lp.logprob),
                "bytes": list(text.encode()),
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
    """Legacy lists for the given tokens; offsets start at `text_offset` characters."""
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
        if num_top > 0:
            top = {_text(t, tlp, tokenizer): _clamp(tlp.logprob) for t, tlp in _top(entry, num_top)}
            top.setdefault(text, _clamp(lp.logprob))
            out["top_logprobs"].append(top)
        else:
            out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def extend_completion_logprobs(acc: dict[str, list[Any]], more: dict[str, list[Any]]) -> None:
    for key, values in more.items():
        acc[key].extend(values)
