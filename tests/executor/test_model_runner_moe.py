"""Mixture-of-experts families against Hugging Face transformers, through the ModelRunner.

Each case saves a random-weight transformers model (safetensors, per-expert tensor
names as the hub checkpoints have them) built from a config with the real model's
structure but tiny sizes, loads it with FlowEngine and compares greedy token ids
exactly, and every step's logits to atol 1e-4, with `generate(do_sample=False)` in
float32, for 8 prompts decoded together. The runs use chunked prefill (16-token
budget), non-contiguous blocks and a preemption.
"""

from __future__ import annotations

import pytest
import torch
from runner_driver import GreedyDriver
from test_model_runner_families import _save_random_model
from transformers import (
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock
from flowengine.model.model_config import ModelConfig

_COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4,
               max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)

FAMILIES = {
    # Mixtral-8x7B's structure: 8 experts, top-2 renormalised, GQA.
    "mixtral": MixtralConfig(
        architectures=["MixtralForCausalLM"], **_COMMON,
        num_hidden_layers=2, num_key_value_heads=2,
        intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None),
    # Qwen1.5-MoE-A2.7B's structure: 60 experts top-4 without renormalisation, a shared
    # expert 4x as wide behind a sigmoid gate, q/k/v biases; layer 1 kept dense
    # (mlp_only_layers) so both MLP kinds run.
    "qwen2-moe": Qwen2MoeConfig(
        architectures=["Qwen2MoeForCausalLM"], **_COMMON,
        num_hidden_layers=3, num_key_value_heads=4,
        intermediate_size=80, moe_intermediate_size=16,
        shared_expert_intermediate_size=64, num_experts=60,
        num_experts_per_tok=4, norm_topk_prob=False,
        mlp_only_layers=[1]),
    # Qwen3-30B-A3B's structure: 128 experts top-8 renormalised, per-head q/k norm,
    # head_dim != hidden / heads, every second layer sparse here (decoder_sparse_step 2).
    "qwen3-moe": Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], **_COMMON,
        num_hidden_layers=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, moe_intermediate_size=24,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=2),
    # OLMoE-1B-7B's structure: 64 experts top-8 not renormalised, q/k norm over the whole
    # projection, plus clip_qkv.
    "olmoe": OlmoeConfig(
        architectures=["OlmoeForCausalLM"], **_COMMON,
        num_hidden_layers=2, num_key_value_heads=4,
        intermediate_size=32, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, clip_qkv=3.0),
}

PROMPTS = {
    "short": [5, 17, 3],
    "medium": list(range(40, 70)),
    "one": [9],
    "repeat": [7] * 11,
    "long": [(i * 37 + 11) % 256 for i in range(45)],
    "desc": list(range(200, 180, -1)),
    "two": [250, 1],
    "mix": [3, 141, 59, 26, 53, 58, 97, 93, 23, 84],
}
NUM_NEW = 10


# A random float32 transformers model saved to a folder (safetensors), weights spread
# so that neither argmax nor the router's top-k sees near-ties: the families' helper.
save_random_moe = _save_random_model


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_greedy_matches_transformers(family: str, tmp_path: object) -> None:
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
    assert len(distinct) >= 6  # a degenerate model would make the comparison vacuous


def test_moe_config_fields(tmp_path) -> None:
    save_random_moe(FAMILIES["qwen2-moe"], str(tmp_path))
    c = ModelConfig.from_pretrained(str(tmp_path))
    assert (c.architecture, c.num_experts, c.num_experts_per_tok) == ("Qwen2MoeForCausalLM", 60, 4)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (16, 64)
    assert c.dense_layers == (1,) and not c.norm_topk_prob and c.qkv_bias and not c.o_bias
    assert [c.is_moe_layer(i) for i in range(3)] == [True, False, True]
    q3 = ModelConfig.from_hf_config(FAMILIES["qwen3-moe"], "/m")
    assert q3.dense_layers == (0, 2) and q3.norm_topk_prob and q3.qk_norm and not q3.qk_norm_full
    mix = ModelConfig.from_hf_config(FAMILIES["mixtral"], "/m")
    assert (mix.num_experts, mix.moe_intermediate_size, mix.norm_topk_prob) == (8, 96, True)
    ol = ModelConfig.from_hf_config(FAMILIES["olmoe"], "/m")
    assert ol.qk_norm_full and ol.clip_qkv == 3.0 and not ol.norm_topk_prob


def test_experts_are_stacked_from_per_expert_tensors(tmp_path) -> None:
    from safetensors.torch import load_file

    from flowengine.model.loader import load_model

    save_random_moe(FAMILIES["mixtral"], str(tmp_path))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), "safetensors")
    block = model.model.layers[1].block_sparse_moe
    assert isinstance(block, SparseMoeBlock) and isinstance(block.experts, FusedMoE)
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    base = "model.layers.1.block_sparse_moe"
    assert torch.equal(block.gate.weight, ckpt[f"{base}.gate.weight"])
    for e in range(8):
        w13, w2 = block.experts.w13_weight[e], block.experts.w2_weight[e]
        assert torch.equal(w13[:96], ckpt[f"{base}.experts.{e}.w1.weight"])
        assert torch.equal(w13[96:], ckpt[f"{base}.experts.{e}.w3.weight"])
        assert torch.equal(w2, ckpt[f"{base}.experts.{e}.w2.weight"])


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    from transformers import GPT2Config

    cfg = GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*MixtralForCausalLM"
                                         r".*Qwen3MoeForCausalLM.*OlmoeForCausalLM"):
        ModelConfig.from_hf_config(cfg, "/m")
    from flowengine.model.models import model_class

    with pytest.raises(ValueError, match=r"'Foo' is not supported.*LlamaForCausalLM"):
        model_class("Foo")


# ---------------------------------------------------------------- through the engine (LLM)
_VOCAB = 49152  # the default model's tokenizer (copied beside the weights)


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory, default_model_path: str) -> dict[str, tuple[str, object]]:
    """Every MoE family with the default model's tokenizer, built on first use:
    {family: (path, transformers model)}."""
    import os
    import shutil

    class _Models(dict):
        def __missing__(self, family: str) -> tuple[str, object]:
            cfg = FAMILIES[family].to_dict()
            cfg.update(vocab_size=_VOCAB, max_position_embeddings=512)
            hf_config = type(FAMILIES[family]).from_dict(cfg)
            path = str(tmp_path_factory.mktemp(f"moe-{family}"))
            hf_model = save_random_moe(hf_config, path)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(default_model_path, name), path)
            self[family] = (path, hf_model)
            return self[family]

    return _Models()


def _llm_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[object]:
    from flowengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


_ENGINE_PROMPTS = [[(i * 131 + 7 * j) % _VOCAB for i in range(n)]
                   for j, n in enumerate((3, 60, 1, 17, 33, 8, 45, 24))]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_prefix_caching_and_chunked_prefill_equal_transformers(engine_models, family,
                                                                   hf_greedy):
    from flowengine import LLM

    path, hf_model = engine_models[family]
    shared = [(i * 977 + 5) % _VOCAB for i in range(40)]  # 2 full 16-token blocks + 8
    prompts = [shared + [100 + j, 7, 300 * j + 1] for j in range(4)]
    reference = [hf_greedy(hf_model, p, 8) for p in prompts]
    llm = LLM(path, enable_prefix_caching=True, max_num_batched_tokens=16, max_model_len=256)
    first = _llm_greedy(llm, prompts[:1], 8)
    rest = _llm_greedy(llm, prompts[1:], 8)
    assert [list(o.outputs[0].token_ids) for o in first + rest] == reference
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [32, 32, 32]
    sched = llm.engine.scheduler
    assert sched.num_free_blocks == sched.num_total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_tensor_parallel_2_equals_1(engine_models, family):
    from flowengine import LLM

    path, _ = engine_models[family]
    ids = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, max_model_len=256)
        try:
            ids[tp] = [list(o.outputs[0].token_ids) for o in _llm_greedy(llm, _ENGINE_PROMPTS, 8)]
        finally:
            llm.shutdown()
    assert len({tuple(s) for s in ids[1]}) == len(_ENGINE_PROMPTS)  # not degenerate
    assert ids[2] == ids[1]


@pytest.mark.parametrize("fmt", ["safetensors", "dummy"])
def test_tp_ranks_split_each_experts_intermediate_dim(tmp_path, fmt: str) -> None:
    from flowengine.distributed.tp_group import TensorParallelGroup
    from flowengine.model.loader import load_model

    save_random_moe(FAMILIES["qwen2-moe"], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    full = load_model(config, fmt)
    ranks = [load_model(config, fmt, tp=TensorParallelGroup(r, 2)) for r in range(2)]
    whole = dict(full.named_parameters())
    parts = [dict(m.named_parameters()) for m in ranks]
    base = "model.layers.0.mlp"
    i = 16  # moe_intermediate_size
    w13 = whole[f"{base}.experts.w13_weight"]
    assert w13.shape == (60, 2 * i, 64)
    pieces = [p[f"{base}.experts.w13_weight"] for p in parts]
    assert all(pc.shape == (60, i, 64) for pc in pieces)
    # gate rows then up rows within each rank's slice
    assert torch.equal(torch.cat([pc[:, :i // 2] for pc in pieces], dim=1), w13[:, :i])
    assert torch.equal(torch.cat([pc[:, i // 2:] for pc in pieces], dim=1), w13[:, i:])
    assert torch.equal(torch.cat([p[f"{base}.experts.w2_weight"] for p in parts], dim=2),
                       whole[f"{base}.experts.w2_weight"])
    s = 64  # shared_expert_intermediate_size
    gate_up = whole[f"{base}.shared_expert.gate_up_proj.weight"]
    sp = [p[f"{base}.shared_expert.gate_up_proj.weight"] for p in parts]
    assert torch.equal(torch.cat([x[:s // 2] for x in sp]), gate_up[:s])
    assert torch.equal(torch.cat([x[s // 2:] for x in sp]), gate_up[s:])
    for name in (f"{base}.gate.weight", f"{base}.shared_expert_gate.weight"):
        assert all(torch.equal(p[name], whole[name]) for p in parts)  # whole on every rank
    # the dense layer keeps intermediate_size 80, split 40 + 40
    dense = whole["model.layers.1.mlp.gate_up_proj.weight"]
    dp = [p["model.layers.1.mlp.gate_up_proj.weight"] for p in parts]
    assert dense.shape == (160, 64) and all(x.shape == (80, 64) for x in dp)
    assert torch.equal(torch.cat([x[:40] for x in dp]), dense[:80])


def test_olmoe_qk_norm_is_split_with_the_heads(tmp_path) -> None:
    from flowengine.distributed.tp_group import TensorParallelGroup
    from flowengine.model.loader import load_model

    save_random_moe(FAMILIES["olmoe"], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    full = dict(load_model(config, "safetensors").named_parameters())
    parts = [dict(load_model(config, "safetensors", tp=TensorParallelGroup(r, 2))
                  .named_parameters()) for r in range(2)]
    for name in ("q_norm", "k_norm"):
        key = f"model.layers.0.self_attn.{name}.weight"
        assert full[key].shape == (64,)
        assert torch.equal(torch.cat([p[key] for p in parts]), full[key])


def test_moe_layer_against_a_dense_reference() -> None:
    # Every expert computed for every token, weighted by a dense [T, E] routing matrix.
    torch.manual_seed(1)
    t, e, k, h, i = 13, 6, 3, 16, 10
    x = torch.randn(t, h, dtype=torch.float64)
    w13 = torch.randn(e, 2 * i, h, dtype=torch.float64)
    w2 = torch.randn(e, h, i, dtype=torch.float64)
    logits = torch.randn(t, e, dtype=torch.float64)
    from flowengine.model.layers.moe import fused_moe_torch, select_experts

    for renorm in (False, True):
        weights, ids = select_experts(logits, k, renorm)
        probs = torch.softmax(logits, -1)
        dense = torch.zeros(t, e, dtype=torch.float64)
        top = probs.topk(k, -1)
        vals = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
        dense.scatter_(1, ids, weights.double())  # routing weights are float32
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(weights.double(), vals, atol=1e-6, rtol=0)
        gate_up = torch.einsum("th,eoh->teo", x, w13)
        act = torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]
        expert_out = torch.einsum("tei,ehi->teh", act, w2)
        expected = (dense[..., None] * expert_out).sum(1)
        got = fused_moe_torch(x, w13, w2, weights.double(), ids)
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)
    assert torch.equal(fused_moe_torch(x[:0], w13, w2, weights[:0], ids[:0]), x[:0])
