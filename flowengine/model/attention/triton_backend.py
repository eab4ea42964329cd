"""The Triton attention backend for CUDA: the kernels of flowengine.kernels behind the
`AttentionBackend` interface (backend.py), same semantics as the torch reference.

Per layer and step: `reshape_and_cache` writes the new tokens' K/V (or, given the
RoPE tables, `rotary_embedding_and_cache` rotates q and writes the rotated K with V in
one launch), then one attention launch covers the batch. The rule (`uses_decode_kernel`):

- decode-only steps (max_query_len == 1): the decode kernel (split-KV /
  flash-decoding, one range when the batch alone fills the GPU);
- steps whose requests all have few new tokens — max_query_len <= MAX_QUERY_LEN (8)
  and max_query_len x QPK <= MAX_PACKED_ROWS (64): the verification steps of
  speculative decoding (k + 1 tokens per request, the verification CUDA graphs) and
  decode batches with short chunks — also the decode kernel, with max_query_len > 1:
  the q tokens x QPK heads of a KV head share one tile and every K/V tile is read
  once (kernels/decode_attention.py). At batch 1 the unified kernel has only
  num_kv_heads programs walking the whole context; split-KV fills the GPU.
  FLOWENGINE_VERIFY_ATTENTION=unified (read once at import) sends these steps to the
  unified kernel instead, as before issue 16's fix (for side-by-side benchmarks);
- anything else (a longer prefill chunk): the unified paged-attention kernel.

Both kernels read K/V through the block tables; neither synchronises with the host,
so a decode or verification step can be captured in a CUDA graph (fix
`num_kv_splits` for that).
"""

from __future__ import annotations

import os

import torch

from flowengine.kernels.decode_attention import (
    MAX_PACKED_ROWS,
    MAX_QUERY_LEN,
    choose_num_kv_splits,
    decode_attention,
)
from flowengine.kernels.paged_attention import paged_attention
from flowengine.kernels.reshape_and_cache import reshape_and_cache
from flowengine.kernels.rotary import rotary_embedding_and_cache
from flowengine.model.attention.metadata import AttentionMetadata

# Decode-only steps whose attended context is shorter than this are not split (a
# range is >= MIN_TOKENS_PER_SPLIT = 64 tokens anyway; measured at batch 1 x 1k on an
# H200: 7.8 µs split against 52 µs unsplit, so splitting pays from short contexts on).
SPLIT_KV_MIN_SEQ_LEN = 128

# "decode" (default): steps with a few new tokens per request (verification) run the
# split-KV decode kernel; "unified": they run the unified kernel (the old routing).
VERIFY_ATTENTION = os.environ.get("FLOWENGINE_VERIFY_ATTENTION", "decode")
if VERIFY_ATTENTION not in ("decode", "unified"):
    raise ValueError(
        f"FLOWENGINE_VERIFY_ATTENTION must be 'decode' or 'unified', got {VERIFY_ATTENTION!r}"
    )


def uses_decode_kernel(max_query_len: int, qpk: int) -> bool:
    """Whether a step whose longest request has `max_query_len` new tokens, with `qpk`
    query heads per KV head, runs the split-KV decode kernel (else the unified one)."""
    if max_query_len == 1:
        return True
    return (VERIFY_ATTENTION == "decode" and max_query_len <= MAX_QUERY_LEN
            and max_query_len * qpk <= MAX_PACKED_ROWS)


class TritonAttentionBackend:
    """`AttentionBackend` on Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1).

    Args:
        split_kv_min_seq_len: steps on the decode kernel (decode-only and verification,
            `uses_decode_kernel`) with max_seq_len at or above this split their contexts
            (choose_num_kv_splits); shorter ones run the decode kernel with one range.
        num_kv_splits: fixed split count (power of 2, <= MAX_KV_SPLITS) for steps on the
            decode kernel, overriding the choice from batch size and context length; set
            it when capturing CUDA graphs, whose launch shapes must not change between
            replays. 1 never splits.

    Attributes:
        unified_only: while True, every step with max_query_len > 1 runs the unified
            kernel (not the decode kernel for short queries), whose grid and tile then
            depend on the padded shapes only; set while capturing the mixed-step CUDA
            graphs (cuda_graphs.MixedCudaGraphs), False otherwise.
    """

    name = "triton"
    # forward() takes `rotary=` and applies RoPE in the same launch as the KV write.
    fuses_rotary = True
    # ... and, given `qk_norm=`, Qwen3's per-head q/k RMSNorm in that launch too.
    fuses_qk_norm = True

    def __init__(
        self,
        *,
        split_kv_min_seq_len: int = SPLIT_KV_MIN_SEQ_LEN,
        num_kv_splits: int | None = None,
    ) -> None:
        self.split_kv_min_seq_len = split_kv_min_seq_len
        self.num_kv_splits = num_kv_splits
        self.unified_only = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Write k/v into `kv_cache` at `meta.slot_mapping`, then attend.

        Args:
            q: [T, num_heads, head_dim] float32/float16/bfloat16, RoPE applied.
            k, v: [T, num_kv_heads, head_dim], q's dtype.
            kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], q's dtype.
            meta: the step's AttentionMetadata (int32 query_start_loc, seq_lens,
                block_tables; int64 slot_mapping).
            scale: softmax scale, normally head_dim ** -0.5.
            out: optional [T, num_heads, head_dim] output buffer.
            sliding_window, logits_soft_cap: as the torch backend (a token at position p
                sees p - sliding_window < j <= p; scores soft-capped); both kernels take
                them, and a window bounds the context that decides the split count.
            rotary: (positions [T] int64, cos [max_position, head_dim // 2] float32,
                sin likewise) when q and k are not rotated yet: one kernel rotates q in
                place and writes the rotated k with v into the cache (k itself is left
                as it is); None: q and k come rotated.
            qk_norm: (q_weight, k_weight, eps) with `rotary`: per-head RMSNorm of q and
                k before the rotation, in the same launch (kernels/rotary.py).

        Returns:
            [T, num_heads, head_dim] in q's dtype; rows of padding tokens (beyond
            query_start_loc[-1]) are zeros, as in the torch reference.

        Raises:
            ValueError: shapes, dtypes or devices disagree (from the kernel wrappers).
        """
        if rotary is None:
            reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        else:
            positions, cos, sin = rotary
            rotary_embedding_and_cache(positions, q, k, v, kv_cache, meta.slot_mapping,
                                       cos, sin, qk_norm=qk_norm)
        is_decode_only = meta.max_query_len == 1
        on_decode_kernel = is_decode_only or (
            not self.unified_only
            and uses_decode_kernel(meta.max_query_len, q.shape[1] // kv_cache.shape[3]))
        if out is None:
            out = torch.empty_like(q)
        if is_decode_only:
            # NOTE: decode steps may be CUDA-graph captured, where a host-side padding
            # count would be frozen; zeroing the whole (small) output is replay-safe.
            out.zero_()
        else:
            num_real_tokens = int(meta.query_start_loc_cpu[-1])
            if num_real_tokens < q.shape[0]:
                out[num_real_tokens:].zero_()

        attended = (meta.max_seq_len if sliding_window is None
                    else min(meta.max_seq_len, sliding_window + meta.max_query_len - 1))
        if on_decode_kernel:
            # Measured on an H200 (docs/benchmarks.md, issue 14): the decode kernel is as
            # fast as the unified one or faster at every batch size even unsplit (batch
            # 512: 524 against 587 µs), and much faster over an fp8 cache.
            if self.num_kv_splits is not None:
                num_splits = self.num_kv_splits
            elif attended >= self.split_kv_min_seq_len:
                num_splits = choose_num_kv_splits(
                    meta.num_reqs, kv_cache.shape[3], attended, q.device
                )
            else:
                num_splits = 1
            return decode_attention(
                q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                max_seq_len=meta.max_seq_len, scale=scale, num_kv_splits=num_splits,
                out=out, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                max_query_len=meta.max_query_len,
            )
        return paged_attention(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            max_query_len=meta.max_query_len, scale=scale, out=out,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )
