"""The torch attention backend against dense causal attention computed from scratch."""

from __future__ import annotations

import math

import pytest
import torch

from flowengine.model.attention.backend import get_attn_backend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 16


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, soft_cap: float | None = None
                     ) -> torch.Tensor:
    """Causal attention of the last q.shape[0] tokens over all of k/v, float64; with
    `window`, query position p sees keys p - window < j <= p; with `soft_cap`, scores
    become cap * tanh(scores / cap).

    q [n, Hq, D]; k, v [L, Hkv, D] -> [n, Hq, D].
    """
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(n, num_heads, q.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        scores = q[:, h].double() @ k[:, h // group].double().T * scale  # [n, L]
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        for j in range(n):
            pos = seq_len - n + j
            scores[j, pos + 1:] = -math.inf
            if window is not None:
                scores[j, :max(pos - window + 1, 0)] = -math.inf
        out[:, h] = scores.softmax(-1) @ v[:, h // group].double()
    return out


# (cached tokens, new tokens) per request, in batch order. The second has runs of fresh
# prompts of one length, which attend in one SDPA call (TorchAttentionBackend._prefill_fresh).
LAYOUTS = [[(0, 7), (9, 5), (12, 1), (0, 1), (30, 1), (3, 6)],
           [(0, 6), (0, 6), (0, 6), (4, 6), (0, 6), (0, 1), (0, 5), (0, 5), (0, 6)]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (3, 2.0), (None, 1.5)])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 4)])
def test_mixed_batch_matches_dense_attention(num_kv_heads: int, group: int, window, soft_cap,
                                             layout) -> None:
    """Fresh prefill, prefill chunk over a cached prefix, decodes, and padding tokens;
    also with a sliding window (shorter than most contexts) and logit soft-capping."""
    num_heads = num_kv_heads * group
    scale = HEAD_DIM ** -0.5
    num_pad = 3
    perm = torch.randperm(NUM_BLOCKS).tolist()  # non-contiguous block ids
    # Blocks no request owns are poisoned: reading one would turn outputs into NaN.
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), math.nan)
    full_k, full_v, block_ids, q_parts, new_k, new_v, slots = [], [], [], [], [], [], []
    for cached, new in layout:
        seq_len = cached + new
        blocks = [perm.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        block_ids.append(blocks)
        k_all = torch.randn(seq_len, num_kv_heads, HEAD_DIM)
        v_all = torch.randn(seq_len, num_kv_heads, HEAD_DIM)
        full_k.append(k_all)
        full_v.append(v_all)
        for pos in range(seq_len):
            slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            if pos < cached:  # the prefix is already in the cache
                kv_cache[0].view(-1, num_kv_heads, HEAD_DIM)[slot] = k_all[pos]
                kv_cache[1].view(-1, num_kv_heads, HEAD_DIM)[slot] = v_all[pos]
            else:
                slots.append(slot)
        new_k.append(k_all[cached:])
        new_v.append(v_all[cached:])
        q_parts.append(torch.randn(new, num_heads, HEAD_DIM))
    pad_q = torch.randn(num_pad, num_heads, HEAD_DIM)
    pad_kv = torch.randn(num_pad, num_kv_heads, HEAD_DIM)
    q = torch.cat(q_parts + [pad_q])
    k = torch.cat(new_k + [pad_kv])
    v = torch.cat(new_v + [pad_kv])
    slot_mapping = torch.tensor(slots + [-1] * num_pad, dtype=torch.int64)
    query_start = torch.tensor([0] + [n for _, n in layout], dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([c + n for c, n in layout], dtype=torch.int32)
    max_blocks = max(len(b) for b in block_ids)
    block_tables = torch.zeros(len(layout), max_blocks + 2, dtype=torch.int32)
    for i, blocks in enumerate(block_ids):
        block_tables[i, :len(blocks)] = torch.tensor(blocks)
    meta = AttentionMetadata(
        query_start_loc=query_start.int(), seq_lens=seq_lens, block_tables=block_tables,
        slot_mapping=slot_mapping, max_query_len=max(n for _, n in layout),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=query_start.int(),
        seq_lens_cpu=seq_lens,
    )
    used = set(sum(block_ids, []))
    # Slots of owned blocks past a request's length, and block 0 (where unused
    # block-table entries point), hold large finite junk: a runner's cache holds stale
    # finite values there (see the NOTE in TorchAttentionBackend._decode), and junk that
    # leaked through the mask would change the outputs far beyond the tolerance.
    for b in used | {0}:
        kv_cache[:, b] = kv_cache[:, b].nan_to_num(1e4)
    cache_before = kv_cache.clone()

    backend = get_attn_backend(torch.device("cpu"))
    assert isinstance(backend, TorchAttentionBackend)
    out = backend.forward(q, k, v, kv_cache, meta, scale, sliding_window=window,
                          logits_soft_cap=soft_cap)

    assert out.shape == q.shape and out.dtype == q.dtype
    for i, (_, new) in enumerate(layout):
        start = int(query_start[i])
        expected = _dense_reference(q[start:start + new], full_k[i], full_v[i], scale,
                                    window, soft_cap)
        torch.testing.assert_close(out[start:start + new].double(), expected,
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(out[-num_pad:], torch.zeros_like(out[-num_pad:]))
    # The cache changed exactly at the new tokens' slots; padding wrote nothing.
    expected_cache = cache_before.view(2, -1, num_kv_heads, HEAD_DIM).clone()
    n_real = len(slots)
    expected_cache[0, slot_mapping[:n_real]] = k[:n_real]
    expected_cache[1, slot_mapping[:n_real]] = v[:n_real]
    assert torch.equal(kv_cache.view_as(expected_cache).nan_to_num(7.0),
                       expected_cache.nan_to_num(7.0))


def test_bfloat16_cache_is_computed_in_float32() -> None:
    """A bf16 step equals the float32 computation on the same (bf16-rounded) inputs."""
    num_heads, num_kv_heads = 4, 2
    kv_cache = torch.zeros(2, 8, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16)
    q = torch.randn(6, num_heads, HEAD_DIM).bfloat16()
    k = torch.randn(6, num_kv_heads, HEAD_DIM).bfloat16()
    v = torch.randn(6, num_kv_heads, HEAD_DIM).bfloat16()
    qsl = torch.tensor([0, 6], dtype=torch.int32)
    seq_lens = torch.tensor([6], dtype=torch.int32)
    meta = AttentionMetadata(qsl, seq_lens, torch.tensor([[5, 2]], dtype=torch.int32),
                             torch.tensor([20, 21, 22, 23, 8, 9]), 6, 6, qsl, seq_lens)
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, 0.25)
    expected = _dense_reference(q.float(), k.float(), v.float(), 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.bfloat16().double(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_cpu_backend_prefills_over_a_bf16_cache_in_bf16(native_bf16, monkeypatch) -> None:
    """float32 activations over a bf16 cache (--dtype bfloat16 on the CPU): two fresh
    prompts of one length (one SDPA call), a third fresh one and a chunk over a cached
    prefix attend in bf16 where the CPU multiplies bf16 natively (every SDPA input
    bf16), else in float32. Either is within bf16 rounding of float64 attention over
    the cache's (bf16) keys and values: the query, the softmax weights and the output
    each rounded once to 8 significant bits (~4e-3 relative each) bound it by 2e-2
    for these O(1) values (max seen 1.0e-2); the float32 path (SDPA, or the C prefill
    kernel on a CPU with AVX2 and without AVX-512) is within 1e-5 as the torch
    reference's."""
    from flowengine.model.attention import cpu_backend, torch_backend

    monkeypatch.setattr(cpu_backend, "_native_bf16", lambda: native_bf16)
    seen: list[tuple[torch.dtype, ...]] = []
    attend = torch_backend._attend

    def spy(query, keys, values, *args, **kwargs):
        seen.append((query.dtype, keys.dtype, values.dtype, query.shape[0]))
        return attend(query, keys, values, *args, **kwargs)

    monkeypatch.setattr(torch_backend, "_attend", spy)
    backend = cpu_backend.CpuAttentionBackend()
    num_heads, num_kv_heads, d, bs = 6, 2, 64, 16
    assert backend._prefill_dtype(torch.zeros(1, dtype=torch.bfloat16)) == (
        torch.bfloat16 if native_bf16 else torch.float32)
    assert backend._prefill_dtype(torch.zeros(1)) == torch.float32
    layout = [(0, 21), (0, 21), (0, 37), (9, 20)]  # (cached, new) per request
    kv_cache = torch.zeros(2, 16, bs, num_kv_heads, d, dtype=torch.bfloat16)
    tables = torch.tensor([[3, 7, 0], [11, 12, 0], [4, 8, 1], [5, 2, 0]], dtype=torch.int32)
    qs, ks, vs, slots, full = [], [], [], [], []
    for i, (cached, new) in enumerate(layout):
        k_all = torch.randn(cached + new, num_kv_heads, d).bfloat16().float()
        v_all = torch.randn(cached + new, num_kv_heads, d).bfloat16().float()
        for pos in range(cached + new):
            slot = int(tables[i, pos // bs]) * bs + pos % bs
            if pos < cached:
                kv_cache[0].view(-1, num_kv_heads, d)[slot] = k_all[pos].bfloat16()
                kv_cache[1].view(-1, num_kv_heads, d)[slot] = v_all[pos].bfloat16()
            else:
                slots.append(slot)
        qs.append(torch.randn(new, num_heads, d))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        full.append((k_all, v_all))
    starts = torch.tensor([0, 21, 42, 79, 99], dtype=torch.int32)
    seq_lens = torch.tensor([21, 21, 37, 29], dtype=torch.int32)
    meta = AttentionMetadata(starts, seq_lens, tables, torch.tensor(slots), 37, 37, starts,
                             seq_lens)
    q = torch.cat(qs)
    out = backend.forward(q, torch.cat(ks), torch.cat(vs), kv_cache, meta, d ** -0.5)
    assert out.dtype == torch.float32
    want = torch.bfloat16 if native_bf16 else torch.float32
    if not native_bf16 and cpu_backend._prefill_kernel_on():
        assert seen == []  # float32: the C prefill kernel, over the cache's values
    else:
        # The two 21-token prompts in one call (batch 2), then the 37-token one, the
        # chunk.
        assert seen == [(want, want, want, 2), (want, want, want, 1), (want, want, want, 1)]
    tol = 2e-2 if native_bf16 else 1e-5
    for i, (k_all, v_all) in enumerate(full):
        a, b = int(starts[i]), int(starts[i + 1])
        expected = _dense_reference(q[a:b], k_all, v_all, d ** -0.5)
        torch.testing.assert_close(out[a:b].double(), expected, atol=tol, rtol=tol)


def test_unknown_backend_name_lists_registered_ones() -> None:
    with pytest.raises(ValueError, match="registered: .*'torch'"):
        get_attn_backend(torch.device("cpu"), name="no-such-backend")
