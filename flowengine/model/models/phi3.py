"""Phi-3 and Phi-4 (Phi3ForCausalLM; Abdin et al. 2024, "Phi-3 Technical Report"): the
Llama decoder with checkpoints that store q/k/v as one `self_attn.qkv_proj.weight`
[(H + 2 * H_kv) * head_dim, hidden] and gate/up as one `mlp.gate_up_proj.weight`
[2 * intermediate, hidden] (each tensor-parallel rank reads its rows of every part),
longrope scaling for the 128k variants and partial rotary (Phi-4-mini's 0.75), both
through ModelConfig's RoPE fields.
"""

from __future__ import annotations

from flowengine.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4 over a paged KV cache; arguments and errors as LlamaForCausalLM."""

    fused_checkpoint = True
