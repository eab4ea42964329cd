"""One float32 engine on the default model for every beam-search test (engine start-up
is most of these tests' CI time)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def beam_llm(default_model_path):
    from flowengine.entrypoints.llm import LLM

    return LLM(default_model_path, dtype="float32", max_model_len=256, block_size=16,
               enable_prefix_caching=True)
