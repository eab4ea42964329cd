"""Speculative decoding on CUDA: greedy token ids identical to no speculation (issue 16).

Random-weight Llama-3-style models shaped for clear greedy margins (gpu_models.py), in
bf16 with CUDA graphs for plain decode steps: the target (8 layers) alone; with a
draft model that is the target itself (high acceptance: the accepted path), with a
2-layer draft of other random weights (mostly rejections: the rollback path), and with
n-gram drafts; with random-weight EAGLE and EAGLE-3 heads in their public layouts
(their own paged KV cache; EAGLE-3 reading three of the target's layers, and a draft
vocabulary of 8000 tokens through d2t). Plans with drafts replay the verification CUDA
graphs. 16 prompts of 5..300 tokens, max_num_batched_tokens=256 (chunked prefill), 48
tokens each, one batch. Run: pytest -s tests/gpu/test_spec_decode_gpu.py
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

from gpu_models import save_model  # noqa: E402

from flowengine import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 48


def greedy_map(path: str) -> torch.Tensor:
    """[V] int64: the shaped model's greedy next token after each token id, to first
    order (gpu_models.py: the LM head holds the embedding rows permuted, so the largest
    logit is that of perm^-1(current token))."""
    from pathlib import Path

    from safetensors.torch import load_file

    weights = {}
    for file in Path(path).glob("*.safetensors"):
        weights.update(load_file(file, device="cuda" if torch.cuda.is_available() else "cpu"))
    embed = weights["model.embed_tokens.weight"].float()
    head = weights["lm_head.weight"].float()
    return (embed @ head.T).argmax(dim=1).cpu()


def _prompts(next_token: torch.Tensor) -> list[list[int]]:
    """16 prompts of 5..300 tokens; the odd ones quote a greedy chain (x, f(x), f(f(x)),
    ...) and end with its start again, so n-gram drafts find the chain's continuation."""
    rng = random.Random(16)
    prompts = []
    for i in range(16):
        n = rng.randint(5, 300)
        if i % 2:
            chain = [rng.randrange(32000)]
            for _ in range(n // 2 + MAX_TOKENS):
                chain.append(int(next_token[chain[-1]]))
            noise = [rng.randrange(32000) for _ in range(n // 4)]
            prompts.append(chain + noise + chain[:4])
        else:
            prompts.append([rng.randrange(32000) for _ in range(n)])
    return prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    paths = {"target": str(root / "target"), "small": str(root / "small")}
    save_model("llama3", paths["target"], seed=0, device="cuda")
    save_model("llama3", paths["small"], seed=1, device="cuda", num_hidden_layers=2)
    return paths


def _generate(path: str, **kwargs) -> tuple[list[list[int]], object]:
    llm = LLM(path, max_num_batched_tokens=256, num_kv_blocks=2048, max_num_seqs=16,
              placement="inproc", **kwargs)  # in process: the scheduler's stats are read
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts(greedy_map(path))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        use_tqdm=False)
    stats = llm.engine.scheduler.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    ids = [o.outputs[0].token_ids for o in outs]
    del llm
    torch.cuda.empty_cache()
    return ids, stats


def _write_head(path: str, target: str, method: str) -> None:
    """A random-weight EAGLE (SafeAILab names) or EAGLE-3 (yuhuili/EAGLE3-* names) head
    for the target in `target`, bf16 safetensors + config.json."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab, hd = cfg["intermediate_size"], cfg["vocab_size"], h // heads
    g = torch.Generator().manual_seed(5)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    eagle3 = method == "eagle3"
    prefix, width = ("midlayer", 2 * h) if eagle3 else ("layers.0", h)
    t = {f"{prefix}.self_attn.q_proj.weight": rnd(heads * hd, width),
         f"{prefix}.self_attn.k_proj.weight": rnd(kv * hd, width),
         f"{prefix}.self_attn.v_proj.weight": rnd(kv * hd, width),
         f"{prefix}.self_attn.o_proj.weight": rnd(h, heads * hd),
         f"{prefix}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
         f"{prefix}.mlp.gate_proj.weight": rnd(inter, h),
         f"{prefix}.mlp.up_proj.weight": rnd(inter, h),
         f"{prefix}.mlp.down_proj.weight": rnd(h, inter)}
    # The target's geometry and RoPE (transformers 5 writes it as rope_parameters).
    fields = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                  "rope_scaling", "rope_parameters",
                                  "max_position_embeddings", "vocab_size") if k in cfg}
    if eagle3:
        draft_vocab = 8000
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t.update({"midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
                  "fc.weight": rnd(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
                  "lm_head.weight": rnd(draft_vocab, h),
                  "d2t": ids - torch.arange(draft_vocab)})
        fields.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    else:
        t["fc.weight"] = rnd(h, 2 * h)
        fields["architectures"] = ["LlamaForCausalLM"]
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**fields, "model_type": "llama", "num_hidden_layers": 1}, f)


@pytest.fixture(scope="module")
def reference(models) -> list[list[int]]:
    return _generate(models["target"])[0]


@pytest.mark.parametrize("draft", ["self", "small", "ngram", "eagle", "eagle3"])
def test_greedy_ids_equal_no_speculation(models, reference, draft: str, tmp_path) -> None:
    if draft == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2}
    elif draft in ("eagle", "eagle3"):
        _write_head(str(tmp_path / draft), models["target"], draft)
        config = {"method": draft, "model": str(tmp_path / draft), "num_speculative_tokens": 4}
    else:
        config = {"model": models["target" if draft == "self" else "small"],
                  "num_speculative_tokens": 4}
    ids, stats = _generate(models["target"], speculative_config=config)
    rate = stats.spec_decode_num_accepted_tokens_total / max(
        1, stats.spec_decode_num_draft_tokens_total)
    print(f"\n{draft}: drafts {stats.spec_decode_num_drafts_total}, draft tokens "
          f"{stats.spec_decode_num_draft_tokens_total}, accepted "
          f"{stats.spec_decode_num_accepted_tokens_total} ({rate:.0%}), per position "
          f"{stats.spec_decode_num_accepted_tokens_per_pos}")
    assert ids == reference
    assert stats.spec_decode_num_drafts_total > 0
    if draft == "self":
        assert rate > 0.9
