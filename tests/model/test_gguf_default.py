"""The converted default model holds exactly the dequantized GGUF weights."""

from __future__ import annotations

import json
import os

import pytest
from gguf.quants import dequantize
from safetensors import safe_open

from flowengine.model.default_model import find_default_gguf
from flowengine.model.gguf_loader import open_gguf, unpermute_qk
from flowengine.model.resolve import cache_dir, resolve_model


@pytest.mark.slow
def test_converted_default_model_equals_dequantized_gguf() -> None:
    resolved = resolve_model(None)
    reader = open_gguf(resolved.gguf_file or find_default_gguf(cache_dir()))
    tensors = {t.name: t for t in reader.tensors}
    with open(os.path.join(resolved.path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert "output.weight" not in tensors
    checks = {
        "model.embed_tokens.weight": ("token_embd.weight", None),
        "model.layers.0.self_attn.q_proj.weight": ("blk.0.attn_q.weight", 9),
        "model.layers.29.self_attn.k_proj.weight": ("blk.29.attn_k.weight", 3),
        "model.layers.7.mlp.down_proj.weight": ("blk.7.ffn_down.weight", None),
        "model.norm.weight": ("output_norm.weight", None),
    }
    with safe_open(os.path.join(resolved.path, "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
        for hf_name, (gguf_name, num_heads) in checks.items():
            t = tensors[gguf_name]
            expected = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            if num_heads is not None:
                expected = unpermute_qk(expected, num_heads)
            actual = f.get_tensor(hf_name)
            assert actual.dtype.name == "float32"
            assert (actual == expected).all(), hf_name
