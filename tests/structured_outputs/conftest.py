from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vocab_size(default_model_path: str) -> int:
    from flowengine.model.model_config import ModelConfig

    return ModelConfig.from_pretrained(default_model_path).vocab_size
