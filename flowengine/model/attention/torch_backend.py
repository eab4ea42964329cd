"""The torch reference attention backend: paged KV-cache writes and attention in plain torch.

Runs on any device (CPU in tests and CPU serving). Computes in float32 whatever the
cache dtype (`_prefill_dtype`; the CPU backend may pick bf16 for prefills). Decode
tokens (one new token per request) of a step are attended in one batched
`scaled_dot_product_attention` call; each prefill chunk gets its own call, except that
a run of fresh prompts of one length shares one. The host loop is over requests, never
over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowengine.model.attention.backend import register_attn_backend
from flowengine.model.attention.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new keys/values at their slots.

    k, v: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim] (any float dtype, float8_e4m3fn included); slot_mapping: [T] int64, slot = block_id * block_size +
    offset, -1 = padding token (not written).
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    if kv_cache.dtype == torch.float8_e4m3fn:
        # --kv-cache-dtype fp8: clamp to E4M3's range (it has no infinity; scale 1.0),
        # and copy the bytes (index_copy_ has no float8 kernel on the CPU).
        k_flat.view(torch.uint8).index_copy_(0, slot_mapping, _to_fp8(k).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slot_mapping, _to_fp8(v).view(torch.uint8))
        return
    k_flat.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    return x.float().clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks listed in `block_table` ([R, nb] int32), in order.

    Returns two [R, nb * block_size, num_kv_heads, head_dim] tensors (cache dtype).
    """
    num_reqs, num_blocks = block_table.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    ids = block_table.reshape(-1).long()
    # index_select on the block dimension copies whole blocks; it is several times
    # faster on CPU than advanced indexing with a 2-D index.
    shape = (num_reqs, num_blocks * block_size, num_kv_heads, head_dim)
    return (kv_cache[0].index_select(0, ids).view(shape),
            kv_cache[1].index_select(0, ids).view(shape))


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None, scale: float, soft_cap: float | None,
            is_causal: bool = False) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v over [..., H, n, D] inputs of one dtype whose
    head axis matches or groups (GQA: keys' heads divide the queries'). mask: bool,
    broadcastable to [..., H, n, L], True = attend. soft_cap: Gemma 2's attention
    logit soft-capping, cap * tanh(x / cap), which scaled_dot_product_attention cannot
    apply, so it takes the explicit path."""
    gqa = query.shape[-3] != keys.shape[-3]
    if soft_cap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if is_causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values)


class TorchAttentionBackend:
    """Reference implementation of `AttentionBackend` (see its docstring for semantics)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, N, B, Hkv, D] -> [T, Hq, D] q.dtype.

        sliding_window: a token at position p attends only to positions
        p - sliding_window < j <= p (Mistral/Gemma; None: the whole context).
        logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax
        (Gemma 2; None: off). Rows of padding tokens (beyond query_start_loc[-1]) are
        returned as zeros.
        """
        # Prefill chunks attend in _prefill_dtype: q, k and v converted once for the
        # step, not per request (k and v as the cache write would round them).
        dtype = (torch.float32 if logits_soft_cap is not None
                 else self._prefill_dtype(kv_cache))
        qp, kp, vp = q, k, v
        if meta.max_query_len > 1 and dtype != q.dtype:
            qp, kp, vp = q.to(dtype), k.to(dtype), v.to(dtype)
        self._write_kv(kp, vp, kv_cache, meta.slot_mapping)
        query_start = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        block_size = kv_cache.shape[2]
        out = torch.empty_like(q)
        num_real = query_start[-1]
        if num_real < q.shape[0]:
            out[num_real:] = 0
        decode_reqs: list[int] = []
        i = 0
        while i < len(seq_lens):
            start, end = query_start[i], query_start[i + 1]
            n, j = end - start, i + 1
            if n == 1:
                decode_reqs.append(i)
            elif n > 1 and seq_lens[i] == n and (sliding_window is None or sliding_window >= n):
                # Fresh prompts of n tokens each in a row (no cached prefix, no window
                # inside them): one causal SDPA call over [r, H, n, D].
                while (j < len(seq_lens) and seq_lens[j] == n
                       and query_start[j + 1] - query_start[j] == n):
                    j += 1
                end = query_start[j]
                out[start:end] = self._prefill_fresh(qp[start:end], kp[start:end],
                                                     vp[start:end], j - i, scale,
                                                     logits_soft_cap)
            elif n > 1:
                out[start:end] = self._prefill(
                    qp[start:end], kp[start:end], vp[start:end], kv_cache,
                    meta.block_tables[i], seq_lens[i], block_size, scale,
                    sliding_window, logits_soft_cap,
                )
            i = j
        if decode_reqs:
            self._decode(q, kv_cache, meta, decode_reqs, query_start, seq_lens, scale, out,
                         sliding_window, logits_soft_cap)
        return out

    @staticmethod
    def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """The step's KV-cache write (write_kv_cache)."""
        write_kv_cache(k, v, kv_cache, slot_mapping)

    @staticmethod
    def _prefill_dtype(kv_cache: torch.Tensor) -> torch.dtype:
        """The dtype a prefill's attention computes in: float32 here, whatever the cache."""
        return torch.float32

    @staticmethod
    def _prefill_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_reqs: int,
                       scale: float, soft_cap: float | None) -> torch.Tensor:
        """num_reqs fresh prompts of n tokens each, back to back: q [num_reqs * n, Hq, D],
        k/v [num_reqs * n, Hkv, D] (their whole contexts) -> [num_reqs * n, Hq, D], each
        prompt causal over itself, in one call, in q's dtype (forward's choice)."""
        t, hq, d = q.shape
        n, hkv = t // num_reqs, k.shape[1]
        # [r, n, H, D] -> [r, H, n, D]: 4-D inputs select the fused CPU flash kernel.
        query = q.view(num_reqs, n, hq, d).transpose(1, 2)
        keys = k.view(num_reqs, n, hkv, d).transpose(1, 2)
        values = v.view(num_reqs, n, hkv, d).transpose(1, 2)
        o = _attend(query, keys, values, None, scale, soft_cap, is_causal=True)
        return o.transpose(1, 2).reshape(t, hq, d)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 block_size: int, scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> torch.Tensor:
        """One request's n new tokens over its seq_len-token context -> [n, Hq, D], in
        q's dtype (forward's choice; the cached prefix's keys and values converted)."""
        num_new = q.shape[0]
        num_cached = seq_len - num_new
        if num_cached == 0:
            keys, values = k, v  # nothing cached: the new tokens are the whole context
        else:
            num_blocks = -(-seq_len // block_size)
            keys, values = gather_kv(kv_cache, block_table[None, :num_blocks])
            keys, values = keys[0, :seq_len], values[0, :seq_len]
        # 4-D inputs and enable_gqa select PyTorch's fused CPU flash-attention kernel
        # (3-D inputs fall back to the unfused math path, measured ~2x slower) and
        # read each KV head once for its whole query-head group.
        query = q.transpose(0, 1)[None]  # [1, Hq, n, D]
        keys = keys.to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        values = values.to(q.dtype).transpose(0, 1)[None]
        windowed = sliding_window is not None and sliding_window < seq_len
        if num_cached == 0 and not windowed:
            o = _attend(query, keys, values, None, scale, soft_cap, is_causal=True)
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(num_cached, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]: causal after the prefix
            if windowed:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
            o = _attend(query, keys, values, mask, scale, soft_cap)
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                reqs: list[int], query_start: list[int], seq_lens: list[int],
                scale: float, out: torch.Tensor, sliding_window: int | None = None,
                soft_cap: float | None = None) -> None:
        """All one-token requests at once; results written into out's rows."""
        _, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        max_len = max(seq_lens[i] for i in reqs)
        num_blocks = -(-max_len // block_size)
        device = q.device
        req_idx = torch.tensor(reqs, device=device)
        tok_idx = torch.tensor([query_start[i] for i in reqs], device=device)
        lens = torch.tensor([seq_lens[i] for i in reqs], device=device)
        # NOTE: requests shorter than max_len read slots past their length (the tail of
        # their last block, block-table padding) with softmax weight 0. Those slots must
        # hold finite values, since 0 * NaN is NaN: the runner allocates the cache
        # zeroed and later writes only finite K/V. Masking V here would cost a pass
        # over the gathered context on every decode step.
        keys, values = gather_kv(kv_cache, meta.block_tables[req_idx, :num_blocks])
        # Query heads of one KV head form the "query length" axis: q [R, Hkv, G, D]
        # against K [R, Hkv, L, D], so GQA needs no copy of K/V per query head.
        qd = q.index_select(0, tok_idx).float().view(len(reqs), num_kv_heads, group, head_dim)
        keys = keys.float().transpose(1, 2)
        values = values.float().transpose(1, 2)
        key_pos = torch.arange(num_blocks * block_size, device=device)[None, :]
        mask = key_pos < lens[:, None]
        if sliding_window is not None:  # the new token sits at position len - 1
            mask &= key_pos >= lens[:, None] - sliding_window
        o = _attend(qd, keys, values, mask[:, None, None, :], scale, soft_cap)
        out.index_copy_(0, tok_idx, o.reshape(len(reqs), num_heads, head_dim).to(out.dtype))


register_attn_backend("torch", TorchAttentionBackend)
