"""Random-weight Hugging Face models with clear greedy margins, their references, and
an overlapped engine loop, for the GPU equivalence tests.

Why the weights are shaped: with plain random weights, bf16 rounding differences
between two correct implementations (different kernels, fused ops) move the logits by
~5-10% of their standard deviation, while the gap between the two largest of 32000
random logits is below 2% of it at ~5% of positions; a few of 512 greedy positions
then flip. Here the embedding (std EMBED_STD) dominates the residual stream and the
LM head holds the embedding rows, permuted and normalised: the largest logit is that
of perm^-1(current token), many standard deviations above the rest, while the other
logits still depend on the whole context (measured on CPU in float32: another prefix
moves the logit vector by ~50% of its centred L2 norm, positions shifted by one by
~20%, bf16 rounding by ~1.5%), which the logits checks measure.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from flowengine.engine.engine_core import EngineCore
from flowengine.messages import NewRequest
from flowengine.sampling_params import SamplingParams

VOCAB_SIZE = 32000
EMBED_STD = 0.5
LM_HEAD_NORM = 1.0  # each LM-head row has this L2 norm

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=1024, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)

FAMILIES: dict[str, PretrainedConfig] = {
    # Llama 3.1 shapes in small: GQA 4:1, head_dim 64, llama3 RoPE scaling.
    "llama3": LlamaConfig(
        **_COMMON, intermediate_size=2816, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen3: per-head q/k RMSNorm, head_dim 128 != hidden / heads.
    "qwen3": Qwen3Config(**_COMMON, intermediate_size=3072, head_dim=128,
                         max_position_embeddings=40960, rope_theta=1000000.0,
                         rms_norm_eps=1e-6),
}

# The mixture-of-experts families at their real models' full widths (hidden size, heads,
# experts, expert width, top-k), 2 decoder layers, a 32000-token vocabulary
# (tests/gpu/test_families_gpu.py).
_MOE_COMMON = dict(vocab_size=VOCAB_SIZE, num_hidden_layers=2, tie_word_embeddings=False,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None,
                   max_position_embeddings=32768)
MOE_FAMILIES: dict[str, PretrainedConfig] = {
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral": MixtralConfig(**_MOE_COMMON, hidden_size=4096, intermediate_size=14336,
                             num_attention_heads=32, num_key_value_heads=8,
                             num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                             sliding_window=None),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts top-4 unnormalised, shared expert 5632 wide.
    "qwen2-moe": Qwen2MoeConfig(**_MOE_COMMON, hidden_size=2048, intermediate_size=5632,
                                moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632,
                                num_attention_heads=16, num_key_value_heads=16,
                                num_experts=60, num_experts_per_tok=4, norm_topk_prob=False),
    # Qwen/Qwen3-30B-A3B
    "qwen3-moe": Qwen3MoeConfig(**_MOE_COMMON, hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=128,
                                num_experts_per_tok=8, norm_topk_prob=True,
                                rms_norm_eps=1e-6, rope_theta=1e6),
    # allenai/OLMoE-1B-7B-0924
    "olmoe": OlmoeConfig(**_MOE_COMMON, hidden_size=2048, intermediate_size=1024,
                         num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                         num_experts_per_tok=8, norm_topk_prob=False),
}


# The dense families beyond Llama/Qwen3 at their real models' full widths, 2 decoder
# layers, a 32000-token vocabulary, embeddings untied (save_model's LM head of permuted
# embedding rows would otherwise overwrite the tied embedding and make every greedy
# token the current one); sliding windows shortened to 128 so that prompts of 200 and
# 300 tokens pass them (tests/gpu/test_families_gpu.py).
_DENSE_COMMON = dict(vocab_size=VOCAB_SIZE, num_hidden_layers=2, tie_word_embeddings=False,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
DENSE_FAMILIES: dict[str, PretrainedConfig] = {
    # google/gemma-2-9b: soft-caps 50 / 30, head_dim 256, query_pre_attn_scalar 256.
    "gemma2": Gemma2Config(**_DENSE_COMMON, hidden_size=3584, intermediate_size=14336,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                           query_pre_attn_scalar=256, sliding_window=128,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                           max_position_embeddings=8192),
    # google/gemma-3-12b (text): q/k norm, local 10k / global 1M linear x8 RoPE.
    "gemma3": Gemma3TextConfig(**_DENSE_COMMON, hidden_size=3840, intermediate_size=15360,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                               query_pre_attn_scalar=256, sliding_window=128,
                               layer_types=["sliding_attention", "full_attention"],
                               max_position_embeddings=131072,
                               rope_parameters={
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}}),
    # microsoft/phi-4 (14B): fused qkv / gate_up checkpoint tensors.
    "phi4": Phi3Config(**_DENSE_COMMON, hidden_size=5120, intermediate_size=17920,
                       num_attention_heads=40, num_key_value_heads=10,
                       max_position_embeddings=16384, rope_theta=250000.0),
    # ibm-granite/granite-3.1-8b-instruct: its four multipliers.
    "granite": GraniteConfig(**_DENSE_COMMON, hidden_size=4096, intermediate_size=12800,
                             num_attention_heads=32, num_key_value_heads=8,
                             embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0078125, logits_scaling=16.0,
                             max_position_embeddings=131072, rope_theta=10000000.0),
    # allenai/OLMo-2-1124-7B: full-width q/k norm, norms after attention and MLP.
    "olmo2": Olmo2Config(**_DENSE_COMMON, hidden_size=4096, intermediate_size=11008,
                         num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=4096, rope_theta=500000.0,
                         rms_norm_eps=1e-6),
    # Qwen/Qwen2.5-7B: q/k/v biases, GQA 7:1.
    "qwen2": Qwen2Config(**_DENSE_COMMON, hidden_size=3584, intermediate_size=18944,
                         num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6),
}


def write_trivial_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level fast tokenizer with one token "<i>" per id (LLM needs a tokenizer;
    the tests pass token ids)."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>").save_pretrained(path)


def save_model(family: str, path: str, seed: int, device: str = "cpu",
               embed_std: float = EMBED_STD, **overrides: object) -> None:
    """Save a bf16 random-weight model of `family` (FAMILIES, MOE_FAMILIES or
    DENSE_FAMILIES; safetensors)
    plus a tokenizer.

    overrides: config fields to change (e.g. Llama-3.1-8B sizes); device: where the
    float32 weights are initialized (an 8B model initializes in seconds on a GPU);
    embed_std: the embedding's standard deviation (deeper, wider models add more to
    the residual stream per layer and need a larger one for the same margins).
    """
    torch.manual_seed(seed)
    base = {**FAMILIES, **MOE_FAMILIES, **DENSE_FAMILIES}[family]
    config = base.__class__(**{**base.to_dict(), **overrides})
    vocab_size = config.vocab_size
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, embed_std)
        rows = embed[torch.randperm(vocab_size, device=embed.device)]
        model.lm_head.weight.copy_(rows / rows.norm(dim=-1, keepdim=True) * LM_HEAD_NORM)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    write_trivial_tokenizer(path, vocab_size)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """32 prompts of 5..700 tokens: 6 groups of 4 sharing a 64..600-token prefix (prefix
    cache hits), then 8 standalone ones including the extremes 5 and 700."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

    prompts = []
    for prefix_len in (64, 128, 200, 333, 480, 600):
        prefix = tokens(prefix_len)
        prompts += [prefix + tokens(rng.randint(5, 100)) for _ in range(4)]
    lengths = [5, 700, *(rng.randint(5, 700) for _ in range(6))]
    prompts += [tokens(n) for n in lengths]
    return prompts


@dataclass
class Reference:
    """Transformers' greedy continuation and, per generated token, the gap between
    the two largest logits in units of the logits' standard deviation."""

    token_ids: list[int]
    margins: list[float]


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    margins = []
    for logits in out.logits:
        row = logits[0].float()
        top2 = row.topk(2).values
        margins.append(float((top2[0] - top2[1]) / row.std()))
    return Reference(out.sequences[0, len(prompt):].tolist(), margins)


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(token_ids), vocab] float32 of one sequence."""
    ids = torch.tensor([token_ids], device=model.device)
    return model(ids).logits[0].float()


def logits_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want| / std(want), ||got - want|| / ||want - mean(want)||)."""
    diff = got.float() - want
    centred = want - want.mean()
    return float(diff.abs().max() / want.std()), float(diff.norm() / centred.norm())


def generate_overlapped(engine: EngineCore, prompts: list[list[int]], max_tokens: int,
                        prefix: str) -> list[list[int]]:
    """Greedy outputs with two steps in flight (async scheduling; step N+1 launched
    before step N's tokens reach the host), the Scheduler actor's loop run in place."""
    scheduler, executor = engine.scheduler, engine.executor
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(NewRequest(f"{prefix}{i}", prompt, params, 0.0))
    outputs: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    scheduler.async_scheduling = True
    in_flight: deque = deque()
    try:
        while scheduler.has_unfinished_requests() or in_flight:
            while len(in_flight) < 2:
                plan = scheduler.schedule()
                if not plan.num_scheduled_tokens:
                    break  # its finished ids come again in the next plan
                in_flight.append((plan, executor.launch(plan)))
            if not in_flight:
                raise RuntimeError("unfinished requests but nothing schedulable")
            plan, handle = in_flight.popleft()
            result = handle.result()
            if result.error is not None:
                raise RuntimeError(f"step {plan.step_id} failed: {result.error}")
            if plan.num_scheduled_tokens:
                for delta in scheduler.update_from_output(plan, result):
                    outputs[delta.req_id].extend(delta.new_token_ids)
    finally:
        scheduler.async_scheduling = False
    return [outputs[f"{prefix}{i}"] for i in range(len(prompts))]
