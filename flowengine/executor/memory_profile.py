"""KV-cache sizing on CUDA by profiling (DESIGN.md §6).

The KV cache gets what is left of `gpu_memory_utilization` of the device once the
weights, the activations of the largest step and memory outside PyTorch's allocator
(CUDA context, kernel images, other processes) are accounted for. The activation peak
comes from running one dummy forward at `max_num_batched_tokens` tokens plus the
logits and sampler of `max_num_seqs` rows, as vLLM's `profile_run` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.sample.metadata import SamplingState
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory in bytes: the device total, PyTorch's peak allocation during the
    profile (weights included) and memory in use outside PyTorch's allocator."""

    total_bytes: int
    peak_torch_bytes: int
    non_torch_bytes: int


def num_kv_blocks_from_profile(profile: MemoryProfile, gpu_memory_utilization: float,
                               bytes_per_block: int) -> int:
    """KV blocks that fit in `gpu_memory_utilization * total` after the profiled peak.

    Raises ValueError, saying what to change, when not even one block fits.
    """
    budget = int(profile.total_bytes * gpu_memory_utilization)
    available = budget - profile.peak_torch_bytes - profile.non_torch_bytes
    if available < bytes_per_block:
        gib = 2**30
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization={gpu_memory_utilization} "
            f"of {profile.total_bytes / gib:.1f} GiB is {budget / gib:.2f} GiB, but weights "
            f"and activations peak at {profile.peak_torch_bytes / gib:.2f} GiB and "
            f"{profile.non_torch_bytes / gib:.2f} GiB is used outside PyTorch; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or "
            "give num_kv_blocks / kv_cache_memory_bytes"
        )
    return available // bytes_per_block


def _dummy_metadata(seq_lens: list[int], block_size: int, device: torch.device
                    ) -> AttentionMetadata:
    """Prefill of whole sequences over one shared dummy block; no KV write (slot -1)."""
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=qsl[1:])
    num_tokens = int(qsl[-1])
    width = -(-max(seq_lens) // block_size)
    return AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        block_tables=torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )


@torch.inference_mode()
def profile_memory(model: nn.Module, *, num_layers: int, kv_block_shape: tuple[int, ...],
                   dtype: torch.dtype, max_num_tokens: int, max_num_seqs: int,
                   max_model_len: int) -> MemoryProfile:
    """Peak memory of the largest step, measured on the model's CUDA device.

    Runs `max_num_tokens` prompt tokens (split into sequences of at most max_model_len)
    through the model over a one-block dummy KV cache per layer (kv_block_shape: [2, 1,
    block_size, num_kv_heads, head_dim]), then logits and a top-k/top-p sampler pass
    over min(max_num_seqs, max_num_tokens) rows. Call before the KV cache exists.
    """
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    kv_caches = [torch.zeros(kv_block_shape, dtype=dtype, device=device)
                 for _ in range(num_layers)]
    seq_lens = [max_model_len] * (max_num_tokens // max_model_len)
    if max_num_tokens % max_model_len:
        seq_lens.append(max_num_tokens % max_model_len)
    meta = _dummy_metadata(seq_lens, kv_block_shape[2], device)
    positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
    input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, kv_caches, meta)
    num_rows = min(max_num_seqs, max_num_tokens)
    logits = model.compute_logits(hidden[:num_rows])
    if logits is not None:  # None on tensor-parallel ranks other than 0 (no sampler)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        Sampler(seed=0)(logits, [SamplingState(params, [], []) for _ in range(num_rows)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    del kv_caches, hidden, logits, meta, positions, input_ids
    torch.cuda.empty_cache()
    profile = MemoryProfile(total, peak, non_torch)
    logger.info("memory profile: %.2f GiB total, %.2f GiB torch peak, %.2f GiB outside torch",
                total / 2**30, peak / 2**30, non_torch / 2**30)
    return profile
