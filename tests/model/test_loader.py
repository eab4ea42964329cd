"""load_model: safetensors by name, dummy weights, and the errors for bad checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.model.loader import load_model, safetensors_files
from flowengine.model.model_config import ModelConfig


def _save_tiny(path: str, tie: bool = False) -> dict[str, torch.Tensor]:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return load_file(os.path.join(path, "model.safetensors"))


def _rewrite(path: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_weights_land_in_fused_parameters(tmp_path: object) -> None:
    state = _save_tiny(str(tmp_path))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), "safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    gate, up = (state[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_bfloat16_params_keep_float32_rope_table(tmp_path: object) -> None:
    _save_tiny(str(tmp_path), tie=True)
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), "auto", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert model.lm_head is None  # tied: logits use the embedding matrix


def test_checkpoint_errors_name_the_tensors(tmp_path: object) -> None:
    path = str(tmp_path)
    state = _save_tiny(path)
    config = ModelConfig.from_pretrained(path)

    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    _rewrite(path, missing)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(config)

    _rewrite(path, {**state, "model.layers.9.self_attn.q_proj.weight": torch.zeros(32, 32)})
    with pytest.raises(ValueError, match=r"1 tensor\(s\).*no place for.*layers\.9\.self_attn"):
        load_model(config)

    _rewrite(path, {**state, "model.norm.weight": torch.ones(31)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(31,\).*expects \(32,\)"):
        load_model(config)

    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors or \\*.gguf weights"):
        load_model(config)
    with pytest.raises(ValueError, match="load_format must be"):
        load_model(config, "pt")


def test_tied_checkpoint_may_carry_lm_head(tmp_path: object) -> None:
    state = _save_tiny(str(tmp_path), tie=True)
    _rewrite(str(tmp_path), {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone(),
                             "model.rotary_emb.inv_freq": torch.ones(4)})
    load_model(ModelConfig.from_pretrained(str(tmp_path)))  # both extras are skipped


def test_dummy_weights_are_small_seeded_and_norms_one(tmp_path: object) -> None:
    _save_tiny(str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    a = load_model(config, "dummy", seed=3)
    b = load_model(config, "dummy", seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0


def test_index_file_selects_shards(tmp_path: object) -> None:
    path = str(tmp_path)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "consolidated.safetensors"):
        save_file({"x": torch.zeros(1)}, os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "model-00002-of-00002.safetensors",
                                  "b": "model-00001-of-00002.safetensors"}}, f)
    assert safetensors_files(path) == [os.path.join(path, "model-00001-of-00002.safetensors"),
                                       os.path.join(path, "model-00002-of-00002.safetensors")]
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    assert [os.path.basename(p) for p in safetensors_files(path)] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_truncated_safetensors_is_a_value_error(tmp_path: object) -> None:
    # An interrupted download used to surface as safetensors' own SafetensorError, a
    # traceback out of `flowengine serve` instead of its one-line start-up error.
    path = str(tmp_path)
    _save_tiny(path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors "
                                         r"file \(.*\); the download may be incomplete"):
        load_model(ModelConfig.from_pretrained(path))
