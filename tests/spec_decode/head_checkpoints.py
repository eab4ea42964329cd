"""Tiny random-weight checkpoints in the public layouts of EAGLE / EAGLE-3 / Medusa
heads, named exactly as the published repositories name their tensors and config keys
(yuhuili/EAGLE-LLaMA3-Instruct-8B, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, vLLM's Medusa
conversion, FasterDecoding/medusa's medusa_lm_head), and a tiny random Llama target.

`favour` makes a head propose one token X almost always (its output dominated by a
constant direction), so that drafts are accepted whenever the target emits X: the
engine tests then exercise acceptance and rollback, not only rejection.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
INTER = 96


def write_target(path: str, tokenizer_dir: str, vocab_size: int, num_layers: int = 4,
                 seed: int = 0) -> LlamaForCausalLM:
    """A random float32 Llama with the tokenizer of `tokenizer_dir`."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=num_layers, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def _config(path: str, **fields) -> None:
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(fields, f, indent=2)


def _llama_fields(vocab_size: int, architectures: list[str]) -> dict:
    return dict(architectures=architectures, model_type="llama", hidden_size=HIDDEN,
                intermediate_size=INTER, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, num_hidden_layers=1, hidden_act="silu",
                max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                vocab_size=vocab_size, torch_dtype="float32")


def _layer(prefix: str, in_width: int, g: torch.Generator, scale: float = 0.2,
           input_norm: bool = True, hidden_norm: bool = False) -> dict[str, torch.Tensor]:
    hd = HIDDEN // HEADS

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t = {
        f"{prefix}.self_attn.q_proj.weight": rnd(HEADS * hd, in_width),
        f"{prefix}.self_attn.k_proj.weight": rnd(KV_HEADS * hd, in_width),
        f"{prefix}.self_attn.v_proj.weight": rnd(KV_HEADS * hd, in_width),
        f"{prefix}.self_attn.o_proj.weight": rnd(HIDDEN, HEADS * hd),
        f"{prefix}.post_attention_layernorm.weight": 1 + rnd(HIDDEN) * 0.1,
        f"{prefix}.mlp.gate_proj.weight": rnd(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": rnd(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": rnd(HIDDEN, INTER),
    }
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = 1 + rnd(HIDDEN) * 0.1
    if hidden_norm:
        t[f"{prefix}.hidden_norm.weight"] = 1 + rnd(HIDDEN) * 0.1
    return t


def write_eagle(path: str, target: LlamaForCausalLM, seed: int = 1,
                favour: int | None = None) -> dict[str, torch.Tensor]:
    """EAGLE-1/2 (SafeAILab cnets.py names): fc over [embed; hidden] with a bias, one
    decoder layer without input_layernorm, the target's embed_tokens saved along (as
    the published checkpoints do; the loader shares the target's)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    t = _layer("layers.0", HIDDEN, g, input_norm=False)
    t["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.2
    t["fc.bias"] = torch.randn(HIDDEN, generator=g) * 0.1
    if favour is not None:
        # The residual stream carries a large multiple of X's LM-head row.
        row = target.lm_head.weight[favour].detach()
        t["fc.bias"] = 50 * row / row.norm()
        t["fc.weight"] *= 0.01
        t["layers.0.self_attn.o_proj.weight"] *= 0.01
    t["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    _config(path, **_llama_fields(vocab, ["LlamaForCausalLM"]), bias=True)
    return t


def write_eagle3(path: str, target: LlamaForCausalLM, draft_vocab: list[int], seed: int = 2,
                 aux_layer_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
    """EAGLE-3 (yuhuili/EAGLE3-* names): fc over three target states, `midlayer.*` with
    a 2h-wide attention input and hidden_norm, norm, its own lm_head over the draft
    vocabulary `draft_vocab` (target ids), d2t (offsets) and t2d (membership)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    dv = len(draft_vocab)
    t = _layer("midlayer", 2 * HIDDEN, g, hidden_norm=True)
    t["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=g) * 0.1
    t["norm.weight"] = torch.ones(HIDDEN)
    t["lm_head.weight"] = torch.randn(dv, HIDDEN, generator=g)
    ids = torch.tensor(draft_vocab, dtype=torch.int64)
    t["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    fields = _llama_fields(vocab, ["LlamaForCausalLMEagle3"])
    fields["draft_vocab_size"] = dv
    if aux_layer_ids is not None:
        fields["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids,
                                  "use_aux_hidden_state": True}
    _config(path, **fields)
    return t


def write_medusa(path: str, vocab_size: int, num_heads: int, num_layers: int = 1,
                 layout: str = "vllm", seed: int = 3, favour: int | None = None
                 ) -> dict[str, torch.Tensor]:
    """Medusa heads in vLLM's layout (`blocks.i.layers.j.linear`, `lm_heads.i`; config
    num_heads / num_hidden_layers) or FasterDecoding's (medusa_lm_head.safetensors with
    `i.j.linear`, `i.num_layers`; config medusa_num_heads / medusa_num_layers)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            w = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.2
            b = torch.randn(HIDDEN, generator=g) * 0.1
            if favour is not None:
                w *= 0.01
                b = torch.full((HIDDEN,), 20.0)
            t[f"blocks.{i}.layers.{j}.linear.weight"] = w
            t[f"blocks.{i}.layers.{j}.linear.bias"] = b
        head = torch.randn(vocab_size, HIDDEN, generator=g) * 0.2
        if favour is not None:
            head[favour] = 1.0
        t[f"lm_heads.{i}.weight"] = head
    if layout == "vllm":
        save_file(t, os.path.join(path, "model.safetensors"))
        _config(path, architectures=["MedusaModel"], model_type="medusa", hidden_size=HIDDEN,
                vocab_size=vocab_size, num_heads=num_heads, num_hidden_layers=num_layers,
                truncated_vocab_size=vocab_size)
        return t
    fd = {}
    for name, v in t.items():
        parts = name.split(".")
        fd[(f"{parts[1]}.{parts[3]}.{'.'.join(parts[4:])}" if parts[0] == "blocks"
            else f"{parts[1]}.{num_layers}.weight")] = v
    save_file(fd, os.path.join(path, "medusa_lm_head.safetensors"))
    _config(path, medusa_num_heads=num_heads, medusa_num_layers=num_layers,
            base_model_name_or_path="tiny-llama")
    return t
