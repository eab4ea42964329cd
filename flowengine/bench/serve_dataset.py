"""Prompts for the serving benchmark: random prompts of a target token length, or JSONL.

Random prompts are random pronounceable words, cut to the target number of tokens
with the tokenizer the server uses: its `/tokenize` and `/detokenize` routes (vLLM's
and ours) or a local Hugging Face tokenizer (`--tokenizer`). Without either, a word
counts as one token (the report says the lengths are approximate). Lengths are drawn
uniformly in [len * (1 - range_ratio), len * (1 + range_ratio)], as vLLM's random
dataset does.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

_ONSETS = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "st",
    "tr",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: prompt text, its length in tokens, tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The server's `/tokenize` and `/detokenize` (raises httpx errors if missing)."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self.client = client
        self.model = model

    def encode(self, text: str) -> list[int]:
        resp = self.client.post("/tokenize", json={"model": self.model, "prompt": text})
        resp.raise_for_status()
        return resp.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        resp = self.client.post("/detokenize", json={"model": self.model, "tokens": ids})
        resp.raise_for_status()
        return resp.json()["prompt"]


class HFTokenizer:
    """A local Hugging Face tokenizer (no special tokens added).

    A directory with a tokenizer.json is read by `tokenizers` alone (0.1 s): importing
    transformers and its AutoTokenizer took 10-17 s of a client's start on the H200
    host, before the first request, in every served run. The same Rust tokenizer, so
    the same ids and texts; anything else goes through AutoTokenizer.
    """

    def __init__(self, name_or_path: str) -> None:
        path = os.path.join(name_or_path, "tokenizer.json")
        self._fast = None
        if os.path.isfile(path):
            from tokenizers import Tokenizer as RustTokenizer

            self._fast = RustTokenizer.from_file(path)
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids)
        return self.tokenizer.decode(ids)


class WordTokenizer:
    """Fallback: one token per whitespace-separated word (approximate lengths)."""

    def __init__(self) -> None:
        self.vocab: list[str] = []
        self.index: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.index:
                self.index[word] = len(self.vocab)
                self.vocab.append(word)
            ids.append(self.index[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)


def pick_tokenizer(client: httpx.Client, model: str, local: str | None) -> tuple[Tokenizer, str]:
    """(tokenizer, description): local if given, else the server's, else words."""
    if local:
        return HFTokenizer(local), f"local tokenizer {local}"
    server = ServerTokenizer(client, model)
    try:
        server.encode("probe")
    except (httpx.HTTPError, KeyError, ValueError):
        return WordTokenizer(), "words (the server has no /tokenize; lengths are approximate)"
    return server, "the server's /tokenize"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1.0 - range_ratio)))
    return rng.randint(low, max(low, int(mean * (1.0 + range_ratio))))


def random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` random prompts of about `input_len` tokens each.

    Raises ValueError for non-positive lengths or a range_ratio outside [0, 1).
    """
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        target = _length(rng, input_len, range_ratio)
        # Every word is at least one token, so `target` words always suffice.
        text = " ".join(_word(rng) for _ in range(target))
        ids = tokenizer.encode(text)[:target]
        requests.append(
            BenchRequest(tokenizer.decode(ids), len(ids), _length(rng, output_len, range_ratio))
        )
    return requests


def jsonl_requests(
    path: str | Path, num_prompts: int, default_output_len: int, tokenizer: Tokenizer
) -> list[BenchRequest]:
    """Requests from a JSONL file: {"prompt": str, "output_len"?: int} per line.

    Cycles through the file up to `num_prompts`. Raises ValueError for a line
    without a "prompt" string.
    """
    rows: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = orjson.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{path}:{n}: each line needs a 'prompt' string")
                rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    out = []
    for i in range(num_prompts):
        row = rows[i % len(rows)]
        out.append(
            BenchRequest(
                row["prompt"],
                len(tokenizer.encode(row["prompt"])),
                int(row.get("output_len", default_output_len)),
            )
        )
    return out
