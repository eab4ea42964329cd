"""A Mistral-shaped model with a 32-token sliding window through the whole engine.

Random weights (float32); prompts longer than the window and generations well past it,
with chunked prefill and prefix caching on, give transformers' greedy ids, while the
KV cache frees blocks out of the window (flowengine/core/sliding_window.py): a pool too
small for the full sequences serves them all at once without a preemption.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from flowengine import LLM, SamplingParams

WINDOW = 32
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, default_model_path: str) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("tiny-mistral-swa"))
    cfg = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, sliding_window=WINDOW,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                        architectures=["MistralForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger weights than the default init: logits far apart (no near-ties for argmax),
    # and attention that depends on which positions it sees.
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise * 2)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path, name), path)
    return path, model.eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 49152, (48,), generator=g).tolist()
    lengths = [5, 20, 33, 47, 70, 101]
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
    # Two prompts sharing 48 tokens (three blocks of 16 out of the window by the end of
    # the first's prefill): the second hits the prefix cache.
    prompts += [shared + [7, 8, 9], shared + [10, 11, 12, 13]]
    return prompts


def _hf_greedy_continuation(model: torch.nn.Module, prompt: list[int],
                            output: list[int]) -> bool:
    """Whether `output` is transformers' greedy continuation of `prompt`: one forward
    over prompt + output (teacher forcing, sliding-window mask included) whose argmax
    at every position from the prompt's last on is the next output token. The same as
    comparing with `generate(do_sample=False)`, in one forward instead of one per token."""
    assert len(output) == MAX_TOKENS
    ids = torch.tensor([prompt + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0]
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return predicted == list(output)


def test_greedy_ids_equal_transformers_past_the_window(tiny_mistral) -> None:
    path, hf_model = tiny_mistral
    prompts = _prompts()
    # 40 blocks of 16 = 640 slots for 8 sequences of up to 141 tokens (720 in all):
    # without freeing they could not all run at once. max_num_batched_tokens 32:
    # long prompts are prefilled in chunks.
    llm = LLM(path, block_size=16, num_kv_blocks=40, max_num_batched_tokens=32,
              enable_prefix_caching=True, max_model_len=256, device="cpu", dtype="float32")
    try:
        sched = llm.engine.scheduler
        assert sched.kv_cache_manager.sliding_window is not None
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # The first shared-prefix prompt alone first, so the second one can hit it.
        first = llm.generate([{"prompt_token_ids": prompts[6]}], greedy, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert list(first[0].outputs[0].token_ids) == list(outs[6].outputs[0].token_ids)
        for prompt, out in zip(prompts, outs, strict=True):
            assert _hf_greedy_continuation(hf_model, prompt, out.outputs[0].token_ids)
        assert sched.num_preemptions == 0
        assert sched.prefix_cache_hits >= 48
        # 40 blocks less the null block: all free, and the stats say the same.
        assert sched.num_free_blocks == sched.num_total_blocks == 39
        stats = sched.make_stats()
        assert (stats.num_total_blocks, stats.num_free_blocks, stats.kv_cache_usage) == (
            39, 39, 0.0)
    finally:
        llm.shutdown()
