"""RoPE tables against transformers' own rotary embeddings for every scaling type:
FlowEngine's cos/sin at each position equal the Hugging Face module's (float32,
rounding tolerance), partial rotary included; longrope switches to its long factors
for a whole step once a position reaches the original context, as transformers does."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig

_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "beta_fast": 32.0, "beta_slow": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def _ours(hf_config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig.from_hf_config(hf_config, "/m")
    rope = RotaryEmbedding.from_config(config)
    rows = rope.cos_sin_cache[rope._table_positions(positions)]
    return rows[:, 0], rows[:, 1]


@pytest.mark.parametrize("kind", list(_SCALINGS))
def test_llama_rope_tables_equal_transformers(kind: str) -> None:
    hf_config = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=256,
                            num_attention_heads=4, max_position_embeddings=512,
                            rope_theta=10000.0, rope_scaling=_SCALINGS[kind])
    positions = torch.tensor([0, 1, 7, 100, 255, 511])
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, 6, 64), positions[None])
    ours_cos, ours_sin = _ours(hf_config, positions)
    torch.testing.assert_close(ours_cos, cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_sin, sin[0], atol=1e-6, rtol=0)


def _phi3(partial: float) -> Phi3Config:
    head_dim = 32
    n = int(head_dim * partial) // 2
    return Phi3Config(architectures=["Phi3ForCausalLM"], hidden_size=128,
                      num_attention_heads=4, max_position_embeddings=1024,
                      partial_rotary_factor=partial,
                      original_max_position_embeddings=128,
                      rope_scaling={"type": "longrope",
                                    "short_factor": [1.0 + 0.1 * i for i in range(n)],
                                    "long_factor": [2.0 + 0.5 * i for i in range(n)],
                                    "original_max_position_embeddings": 128})


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("positions", [[0, 5, 127], [3, 128, 700]])
def test_longrope_and_partial_rotary_equal_transformers(partial: float, positions) -> None:
    hf_config = _phi3(partial)
    pos = torch.tensor(positions)
    cos, sin = Phi3RotaryEmbedding(hf_config)(torch.zeros(1, 3, 32), pos[None])
    ours_cos, ours_sin = _ours(hf_config, pos)
    assert ours_cos.shape == (3, int(32 * partial))
    torch.testing.assert_close(ours_cos, cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_sin, sin[0], atol=1e-6, rtol=0)


def test_partial_rotary_leaves_the_tail_of_each_head() -> None:
    config = ModelConfig.from_hf_config(_phi3(0.75), "/m")
    assert config.rotary_dim == 24 and config.rope_original_max_position == 128
    rope = RotaryEmbedding.from_config(config)
    x = torch.randn(3, 2, 32)
    out = rope(torch.tensor([1, 2, 3]), x)
    assert torch.equal(out[..., 24:], x[..., 24:])
    assert not torch.allclose(out[..., :24], x[..., :24])
