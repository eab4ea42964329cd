"""IBM Granite 3.x (GraniteForCausalLM): the Llama decoder with four scalar multipliers
(modeling_granite.py): embeddings times `embedding_multiplier`, each attention and MLP
output times `residual_multiplier` before its residual add, softmax scale
`attention_multiplier` instead of head_dim ** -0.5, logits divided by `logits_scaling`.
They are ModelConfig fields read by the Llama code; checkpoint names are Llama's.
"""

from __future__ import annotations

from flowengine.model.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite over a paged KV cache; arguments and errors as LlamaForCausalLM."""
