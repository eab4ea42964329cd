"""Model classes by Hugging Face architecture name (config.json's `architectures`).

One file per family; the others reuse the Llama decoder and replace its MLP
(mixture-of-experts families) or its decoder layer (OLMo 2). Classes are imported on first use.
"""

from __future__ import annotations

import importlib

from torch import nn

from flowengine.model.model_config import SUPPORTED_ARCHITECTURES

# architecture -> (module under flowengine.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    """The model class serving `architecture`.

    Raises ValueError listing the supported architectures for any other name.
    """
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; FlowEngine serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"flowengine.model.models.{module}"), name)
