"""Dense families beyond the Llama switches (Granite, OLMo 2, Phi-3/Phi-4, Gemma 2,
Gemma 3) against Hugging Face
transformers, through the ModelRunner: greedy token ids exactly and every step's logits
to atol 1e-4 in float32, 8 prompts decoded together with chunked prefill (16-token
budget), non-contiguous blocks and a preemption (see test_model_runner_moe.py)."""

from __future__ import annotations

import pytest
import torch
from runner_driver import GreedyDriver
from test_model_runner_moe import NUM_NEW, PROMPTS, _hf_greedy, save_random_moe
from transformers import Gemma2Config, Gemma3TextConfig, GraniteConfig, Olmo2Config, Phi3Config

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.model_config import ModelConfig

_COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, intermediate_size=96,
               max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)

FAMILIES = {
    # Granite 3.x's multipliers (granite-3.1-8b: 12, 0.22, 0.0078125, 16), tied
    # embeddings as the 2B/8B checkpoints.
    "granite": GraniteConfig(
        architectures=["GraniteForCausalLM"], **_COMMON,
        num_hidden_layers=3, num_key_value_heads=2,
        embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125 * 8, logits_scaling=16.0,
        tie_word_embeddings=True),
    "olmo2": Olmo2Config(
        architectures=["Olmo2ForCausalLM"], **_COMMON,
        num_hidden_layers=3, num_key_value_heads=2),
    # Phi-4 (14B)'s structure: fused qkv / gate_up checkpoint tensors, GQA, plain RoPE.
    "phi4": Phi3Config(
        architectures=["Phi3ForCausalLM"], **_COMMON,
        num_hidden_layers=2, num_key_value_heads=2),
    # Phi-4-mini's structure: partial rotary 0.75, longrope (short factors within the
    # original 128 positions these prompts stay in), tied embeddings.
    "phi4-mini-longrope": Phi3Config(
        architectures=["Phi3ForCausalLM"],
        **{**_COMMON, "max_position_embeddings": 1024}, num_hidden_layers=2,
        num_key_value_heads=1, partial_rotary_factor=0.75, tie_word_embeddings=True,
        original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "original_max_position_embeddings": 128,
                      "short_factor": [1.0 + 0.05 * i for i in range(6)],
                      "long_factor": [3.0 + i for i in range(6)]}),
    # Gemma 2's structure: local/global layers alternating with an 8-token window (most
    # prompts below are longer), attention soft-cap 50, final soft-cap 30 (both bite at
    # these weight scales), GeGLU, four (1 + w) norms per layer, sqrt(hidden) embedding
    # scale, query_pre_attn_scalar != head_dim, tied embeddings.
    "gemma2": Gemma2Config(
        architectures=["Gemma2ForCausalLM"], **_COMMON,
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
        sliding_window=8, query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # Gemma 3 text's structure: per-head q/k norm, local layers (window 8) with their own
    # RoPE base (10k) and a global layer with 1M linearly scaled by 8 (the 4B+ models).
    "gemma3": Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        **_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=32,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_family_greedy_matches_transformers(family: str, tmp_path: object) -> None:
    hf_model = save_random_moe(FAMILIES[family], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=128),
                         torch.device("cpu"), torch.float32)
    driver = GreedyDriver(runner, token_budget=16, seed=1, preempt={"short": 5})
    seqs = driver.generate(PROMPTS, NUM_NEW)
    assert driver.partial_chunks > 0 and driver.num_preemptions == 1
    distinct = set()
    for rid, prompt in PROMPTS.items():
        expected_ids, expected_logits = _hf_greedy(hf_model, prompt)
        assert seqs[rid].outputs == expected_ids, rid
        distinct.add(tuple(expected_ids))
        for ours, theirs in zip(seqs[rid].logits, expected_logits, strict=True):
            torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=0)
    assert len(distinct) >= 6


def test_granite_multipliers_are_read() -> None:
    c = ModelConfig.from_hf_config(FAMILIES["granite"], "/m")
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier,
            c.logits_scaling) == (12.0, 0.22, 0.0625, 16.0)
    o = ModelConfig.from_hf_config(FAMILIES["olmo2"], "/m")
    assert o.qk_norm_full and o.embedding_multiplier == 1.0 and o.attention_multiplier is None
    g2 = ModelConfig.from_hf_config(FAMILIES["gemma2"], "/m")
    assert (g2.sliding_window, g2.sliding_layers, g2.hidden_act) == (8, (0, 2), "gelu_pytorch_tanh")
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.max_model_len == 256  # windowed layers are applied, not capped
    assert g2.embedding_multiplier == 8.0 and g2.attention_multiplier == 32 ** -0.5
    g3 = ModelConfig.from_hf_config(FAMILIES["gemma3"], "/m")
    assert (g3.rope_local_theta, g3.rope_theta, g3.rope_scaling.rope_type) == (
        10000.0, 1000000.0, "linear")
    assert g3.qk_norm and not g3.qk_norm_full and g3.attn_logit_softcapping is None


def test_phi3_fused_checkpoint_tensors_split_by_rank(tmp_path) -> None:
    from safetensors.torch import load_file

    from flowengine.distributed.tp_group import TensorParallelGroup
    from flowengine.model.loader import load_model

    save_random_moe(FAMILIES["phi4"], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    qkv = ckpt["model.layers.0.self_attn.qkv_proj.weight"]  # [64 + 2 * 32, 64]
    gate_up = ckpt["model.layers.0.mlp.gate_up_proj.weight"]  # [2 * 96, 64]
    assert torch.equal(dict(load_model(config, "safetensors").named_parameters())[
        "model.layers.0.self_attn.qkv_proj.weight"], qkv)
    ranks = [dict(load_model(config, "safetensors", tp=TensorParallelGroup(r, 2))
                  .named_parameters()) for r in range(2)]
    for r, p in enumerate(ranks):
        q, k, v = qkv[:64], qkv[64:96], qkv[96:]
        expected = torch.cat([q[32 * r:32 * (r + 1)], k[16 * r:16 * (r + 1)],
                              v[16 * r:16 * (r + 1)]])
        assert torch.equal(p["model.layers.0.self_attn.qkv_proj.weight"], expected)
        gate, up = gate_up[:96], gate_up[96:]
        assert torch.equal(p["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([gate[48 * r:48 * (r + 1)], up[48 * r:48 * (r + 1)]]))
    dummy = load_model(config, "dummy")  # every fused tensor drawn once, all parts filled
    assert dummy.model.layers[0].self_attn.qkv_proj.weight.abs().min() > 0


def test_gemma2_window_changes_long_prompts_only(tmp_path) -> None:
    # Non-vacuity of the window cases above: without the window FlowEngine's logits
    # move for a prompt past it and stay for one within it.
    import dataclasses

    save_random_moe(FAMILIES["gemma2"], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    full = dataclasses.replace(config, sliding_window=None, sliding_layers=())
    prompts = {"within": [5, 17, 3, 9], "past": PROMPTS["long"]}
    logits = []
    for cfg in (config, full):
        runner = ModelRunner(cfg, CacheConfig(block_size=8, num_blocks=64),
                             torch.device("cpu"), torch.float32)
        seqs = GreedyDriver(runner, token_budget=64).generate(prompts, 1)
        logits.append({rid: s.logits[0] for rid, s in seqs.items()})
    torch.testing.assert_close(logits[0]["within"], logits[1]["within"], atol=1e-5, rtol=0)
    assert (logits[0]["past"] - logits[1]["past"]).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_prefix_caching_and_chunked_prefill_equal_transformers(
        family: str, tmp_path, default_model_path: str, hf_greedy) -> None:
    # Through the engine: the default model's tokenizer beside random weights; a
    # 40-token shared prefix (past Gemma's 8-token window) served from the prefix
    # cache, prefills in 16-token chunks.
    import os
    import shutil

    from test_model_runner_moe import _llm_greedy

    from flowengine import LLM

    vocab = 49152
    cfg = FAMILIES[family].to_dict()
    cfg.update(vocab_size=vocab, max_position_embeddings=max(512, cfg["max_position_embeddings"]))
    hf_model = save_random_moe(type(FAMILIES[family]).from_dict(cfg), str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path, name), str(tmp_path))
    shared = [(i * 977 + 5) % vocab for i in range(40)]
    prompts = [shared + [100 + j, 7, 300 * j + 1] for j in range(4)]
    reference = [hf_greedy(hf_model, p, 8) for p in prompts]
    llm = LLM(str(tmp_path), enable_prefix_caching=True, max_num_batched_tokens=16,
              max_model_len=120)
    first = _llm_greedy(llm, prompts[:1], 8)
    rest = _llm_greedy(llm, prompts[1:], 8)
    assert [list(o.outputs[0].token_ids) for o in first + rest] == reference
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [32, 32, 32]
    sched = llm.engine.scheduler
    assert sched.num_free_blocks == sched.num_total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granite", "olmo2", "phi4-mini-longrope", "gemma2"])
def test_dense_tensor_parallel_2_equals_1(family: str, tmp_path, default_model_path: str
                                          ) -> None:
    # gloo on the CPU, one executor process per rank: head-split q/k norms (OLMo 2),
    # fused checkpoint tensors and partial rotary (Phi-4-mini), windowed soft-capped
    # attention (Gemma 2), multipliers with a tied, vocabulary-split head (Granite).
    import os
    import shutil

    from test_model_runner_moe import _ENGINE_PROMPTS, _llm_greedy

    from flowengine import LLM

    cfg = FAMILIES[family].to_dict()
    cfg.update(vocab_size=49152, max_position_embeddings=max(512, cfg["max_position_embeddings"]),
               num_key_value_heads=2)  # KV heads split 1 + 1
    save_random_moe(type(FAMILIES[family]).from_dict(cfg), str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path, name), str(tmp_path))
    ids = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=tp, max_model_len=120)
        try:
            ids[tp] = [list(o.outputs[0].token_ids) for o in _llm_greedy(llm, _ENGINE_PROMPTS, 8)]
        finally:
            llm.shutdown()
    assert len({tuple(s) for s in ids[1]}) == len(_ENGINE_PROMPTS)
    assert ids[2] == ids[1]
