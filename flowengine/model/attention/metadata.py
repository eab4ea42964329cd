"""Inputs that every attention backend reads for one step (DESIGN.md §6).

The batch is flattened: one token dimension `T` for all requests, prefill chunks and
decode tokens together, requests in scheduling order. For request `i` the new tokens
are rows `query_start_loc[i]:query_start_loc[i+1]`; its context (cached prefix plus
new tokens) has `seq_lens[i]` tokens, found in KV blocks `block_tables[i, :]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs.

    Attributes:
        query_start_loc: [R + 1] int32, cumulative new-token counts (starts at 0).
        seq_lens: [R] int32, context length per request including the new tokens.
        block_tables: [R, max_blocks_per_req] int32, KV block ids (unused entries 0).
        slot_mapping: [T] int64, cache slot `block_id * block_size + offset` where each
            new token's K/V is written; -1 marks a padding token (skip the write).
        max_query_len: largest new-token count of any request (host int).
        max_seq_len: largest `seq_lens` value (host int).
        query_start_loc_cpu, seq_lens_cpu: host copies, for code that loops on the host
            (the torch reference backend) without a device sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


# KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0
# holds K, 1 holds V. Slot s lives at block s // block_size, offset s % block_size.
KV_CACHE_LAYOUT = "[2, num_blocks, block_size, num_kv_heads, head_dim]"
