"""Kernel tests: fresh random inputs every run, the seed printed so a failure can be
replayed with FLOWENGINE_TEST_SEED=<seed>; tensors on CPU under the Triton
interpreter (tests/conftest.py turns it on without a GPU), on CUDA otherwise."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def random_seed() -> Iterator[int]:
    seed = int(os.environ.get("FLOWENGINE_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    # Shown by pytest only when the test fails (captured stdout).
    print(f"random seed: {seed} (replay with FLOWENGINE_TEST_SEED={seed})")
    yield seed


@pytest.fixture
def device() -> torch.device:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    return torch.device("cuda")
