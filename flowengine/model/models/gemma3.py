"""Gemma 3's text model (Gemma3ForCausalLM, e.g. gemma-3-1b-it; Gemma Team 2025, "Gemma 3
Technical Report"): the Gemma 2 decoder (gemma2.py) with per-head q/k RMSNorms (Gemma's
(1 + w) form) instead of attention soft-capping, five local sliding-window layers per
global one (`layer_types`), and separate RoPE bases: rope_local_base_freq (10k) for
local layers, the global layers' rope_parameters (1M, optionally linear-scaled).

The multimodal checkpoints (Gemma3ForConditionalGeneration) are not served.
"""

from __future__ import annotations

from flowengine.model.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text over a paged KV cache; the differences from Gemma 2 are ModelConfig
    switches (qk_norm, rope_local_theta, no soft-capping by default)."""
