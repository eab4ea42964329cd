"""The attention backend interface and the registry that picks one per device.

A backend owns two things for one layer and one step: writing the new tokens' K/V
into the paged KV cache at `slot_mapping`, and attention of the new tokens over each
request's context (cached prefix + new tokens, causal among the new ones). Models call
only `AttentionBackend.forward`; which backend runs is a registry lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from flowengine.model.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention over a flattened mixed prefill/decode batch."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v into `kv_cache`, then attend.

        Args:
            q: [T, num_heads, head_dim] queries of the new tokens (RoPE applied).
            k, v: [T, num_kv_heads, head_dim] keys/values of the new tokens.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] this layer's
                cache (0 = K, 1 = V), same dtype as k/v; written in place at
                `meta.slot_mapping` (slots of -1 are padding and are not written).
            meta: the step's AttentionMetadata.
            scale: softmax scale, normally head_dim ** -0.5.

        Returns:
            [T, num_heads, head_dim], q's dtype. Token t of request i attends to the
            request's context positions 0 .. (seq_lens[i] - n_i + j) where j is t's
            index among the request's n_i new tokens. Query head h reads KV head
            h // (num_heads // num_kv_heads) (grouped-query attention, Ainslie et al.
            2023).
        """
        ...


BackendFactory = Callable[[], AttentionBackend]

def _triton_backend() -> AttentionBackend:
    # Imported on first use: triton (and a CUDA toolchain) is needed only on CUDA.
    from flowengine.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


_REGISTRY: dict[str, BackendFactory] = {"triton": _triton_backend}
# The backend each device type gets when the caller names none: the CPU backend
# (cpu_backend.py registers itself as the CPU's default when imported; until then the
# torch reference), the Triton kernels (flowengine.kernels) on CUDA.
_DEFAULT_FOR_DEVICE: dict[str, str] = {"cpu": "torch", "cuda": "triton"}


def register_attn_backend(name: str, factory: BackendFactory, *,
                          default_for_device: str | None = None) -> None:
    """Make a backend selectable by `name` (e.g. a Triton backend for "cuda")."""
    _REGISTRY[name] = factory
    if default_for_device is not None:
        _DEFAULT_FOR_DEVICE[default_for_device] = name


def get_attn_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """A fresh backend instance for `device`, or the one registered as `name`.

    Raises ValueError naming the registered backends when none fits.
    """
    # Importing the modules registers the torch reference backend and the CPU backend
    # (the reference with decode over the paged cache in C), the CPU's default.
    from flowengine.model.attention import cpu_backend, torch_backend  # noqa: F401

    if name is None:
        name = _DEFAULT_FOR_DEVICE.get(device.type)
        if name is None:
            raise ValueError(
                f"no attention backend is registered for device type {device.type!r}; "
                f"registered: {sorted(_REGISTRY)}; pass one of them by name"
            )
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
