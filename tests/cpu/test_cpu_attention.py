"""Decode attention over the paged KV cache in C against the torch reference backend.

Fresh random caches and scattered block tables each run; float32 and bfloat16 caches,
grouped-query heads, soft capping, sliding windows, context lengths around block
edges; output rows of other tokens poisoned before the call and checked untouched.
"""

from __future__ import annotations

import pytest
import torch

from flowengine.model.attention.backend import get_attn_backend
from flowengine.model.attention.cpu_backend import CpuAttentionBackend, paged_decode_attention
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend
from flowengine.model.layers.quant_linear import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="flowengine._cpu_ops not built")

BLOCK = 16


def _case(dtype, hq, hkv, d, lens, block=BLOCK):
    num_reqs = len(lens)
    max_blocks = -(-max(lens) // block)
    num_blocks = num_reqs * max_blocks + 3
    cache = torch.randn(2, num_blocks, block, hkv, d).to(dtype)
    block_tables = torch.randperm(num_blocks)[:num_reqs * max_blocks].view(
        num_reqs, max_blocks).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    # Tokens of the step: a poisoned prefill-like row 0, then one row per request.
    q = torch.randn(num_reqs + 1, hq, d).to(dtype)
    tok_idx = torch.arange(1, num_reqs + 1)
    return cache, block_tables, seq_lens, q, tok_idx


def _reference(q, cache, block_tables, seq_lens, tok_idx, scale, soft_cap=None, window=None):
    num_reqs = len(seq_lens)
    qsl = [0] + list(range(1, num_reqs + 1))
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), seq_lens, block_tables,
                             torch.zeros(len(q), dtype=torch.int64), 1, int(seq_lens.max()),
                             torch.tensor(qsl, dtype=torch.int32), seq_lens)
    out = torch.zeros_like(q)
    TorchAttentionBackend._decode(q, cache, meta, list(range(num_reqs)), tok_idx.tolist(),
                                  seq_lens.tolist(), scale, out, window, soft_cap)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (4, 1, 256), (6, 2, 80)])
def test_matches_reference(dtype, hq, hkv, d):
    lens = [1, 15, 16, 17, 100, 250]
    cache, bt, seq_lens, q, tok_idx = _case(dtype, hq, hkv, d, lens)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(len(lens)), d ** -0.5,
                           out)
    ref = _reference(q, cache, bt, seq_lens, tok_idx, d ** -0.5)
    assert torch.isnan(out[0]).all()  # not this step's decode token: untouched
    # float32: rounding of the online softmax; bfloat16: one rounding of the output.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(out[1:].float(), ref[1:].float(), **tol)


# GQA ratios 1-5 at head_dim 64 (query heads in groups of up to 4 per K/V row load:
# 4 + 1 for 5), 1-3 at 128 (groups of up to 2: 2 + 1 for 3), one head at a time at 80
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 64), (10, 2, 64), (4, 2, 64),
                                      (8, 8, 128), (8, 4, 128), (12, 4, 128), (6, 2, 80)])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_float32_queries_over_a_half_cache(hq, hkv, d, window, kv_dtype):
    """float32 queries over a bf16 cache (`--dtype bfloat16` with quantized weights on
    the CPU) or a float16 one (`--kv-cache-dtype float16`) take the chunked float32
    body, the cache widened exactly as it is read: the reference over the same values in
    float32, within float32 rounding."""
    lens = [1, 15, 16, 17, 100, 250]
    cache, bt, seq_lens, _, tok_idx = _case(kv_dtype, hq, hkv, d, lens)
    q = torch.randn(len(lens) + 1, hq, d)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(len(lens)), d ** -0.5,
                           out, sliding_window=window)
    ref = _reference(q, cache.float(), bt, seq_lens, tok_idx, d ** -0.5, window=window)
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1:], ref[1:], rtol=1e-5, atol=1e-5)


def _assert_same_bits_alone(q, cache, bt, seq_lens, tok_idx, batch, scale, **kwargs):
    """Each request of the batch whose outputs are `batch`, attended alone on one thread
    and on two, gets the same bits."""
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            for i in range(len(seq_lens)):
                alone = torch.full_like(q, float("nan"))
                paged_decode_attention(q, cache, bt[i:i + 1], seq_lens[i:i + 1],
                                       tok_idx[i:i + 1], torch.arange(1), scale, alone,
                                       **kwargs)
                assert torch.equal(alone[i + 1], batch[i + 1]), (threads, i)
        finally:
            torch.set_num_threads(before)


# contexts even enough for a pool chunk per request (two threads or one), and one
# context longer than a thread's share (a chunk per (request, KV head))
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 100, 130, 250, 240],
                                  [1, 15, 16, 17, 100, 250]])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (12, 4, 128)])
def test_a_request_gets_the_same_bits_alone_or_in_a_batch(hq, hkv, d, lens):
    """With at least two requests per thread and no context over a thread's share, a
    pool chunk is one request's KV heads, else one (request, KV head): each request's
    output is the same bits either way (alone it is always the latter), and with one
    thread or two."""
    cache, bt, seq_lens, _, tok_idx = _case(torch.bfloat16, hq, hkv, d, lens)
    q = torch.randn(len(lens) + 1, hq, d)
    batch = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(len(lens)), d ** -0.5,
                           batch)
    _assert_same_bits_alone(q, cache, bt, seq_lens, tok_idx, batch, d ** -0.5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (520, None), (None, 30.0)])
def test_long_contexts_in_parts(kv_dtype, window, soft_cap):
    """Contexts over 256 positions (after the window) are attended in parts of 256 by
    the AVX2 body and merged (flash-decoding's reduction); what a request gets depends
    on its own context only: the reference's values, and the same bits alone, in the
    batch and on one thread or two."""
    lens = [256, 257, 512, 600, 1000, 5]
    cache, bt, seq_lens, _, tok_idx = _case(kv_dtype, 9, 3, 64, lens)
    q = 3 * torch.randn(len(lens) + 1, 9, 64)
    batch = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(len(lens)), 0.125,
                           batch, soft_cap=soft_cap, sliding_window=window)
    ref = _reference(q, cache.float(), bt, seq_lens, tok_idx, 0.125, soft_cap, window)
    assert torch.isnan(batch[0]).all()
    torch.testing.assert_close(batch[1:], ref[1:], rtol=1e-5, atol=1e-5)
    _assert_same_bits_alone(q, cache, bt, seq_lens, tok_idx, batch, 0.125, soft_cap=soft_cap,
                            sliding_window=window)


@pytest.mark.parametrize("block", [1, 8, 32])
@pytest.mark.parametrize("window", [None, 21])
def test_other_block_sizes(block, window):
    # The float32 body walks the block table position by position (block, offset);
    # windows start mid-block.
    lens = [1, 7, 8, 9, 33, 100, 129]
    cache, bt, seq_lens, q, tok_idx = _case(torch.float32, 9, 3, 64, lens, block)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(len(lens)), 0.125, out,
                           sliding_window=window)
    ref = _reference(q, cache, bt, seq_lens, tok_idx, 0.125, window=window)
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1:], ref[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("soft_cap,window", [(30.0, None), (None, 20), (50.0, 7)])
def test_soft_cap_and_sliding_window(soft_cap, window):
    lens = [3, 40, 64]
    cache, bt, seq_lens, q, tok_idx = _case(torch.float32, 8, 2, 64, lens)
    q *= 4  # large scores, so that the cap matters
    out = torch.empty_like(q)
    paged_decode_attention(q, cache, bt, seq_lens, tok_idx, torch.arange(3), 0.125, out,
                           soft_cap=soft_cap, sliding_window=window)
    ref = _reference(q, cache, bt, seq_lens, tok_idx, 0.125, soft_cap, window)
    torch.testing.assert_close(out[1:], ref[1:], rtol=1e-5, atol=1e-5)


def test_backend_forward_mixed_batch_matches_reference():
    # One prefill chunk and two decode tokens through the whole backend (cache writes
    # included), against the torch reference on a copy of the same cache.
    hq, hkv, d = 6, 2, 32
    cache = torch.randn(2, 12, BLOCK, hkv, d)
    cache_ref = cache.clone()
    lens = [20, 33, 5]  # request 0: 4 new tokens; 1 and 2: one each
    qsl = torch.tensor([0, 4, 5, 6], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([16 + 0, 16 + 1, 16 + 2, 16 + 3, 4 * BLOCK + 0, 5 * BLOCK + 4])
    meta = AttentionMetadata(qsl, torch.tensor(lens, dtype=torch.int32), bt, slots, 4, 33, qsl,
                             torch.tensor(lens, dtype=torch.int32))
    q, k, v = torch.randn(6, hq, d), torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    out = CpuAttentionBackend().forward(q, k, v, cache, meta, d ** -0.5)
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, d ** -0.5)
    assert torch.equal(cache, cache_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cpu_default_backend():
    assert isinstance(get_attn_backend(torch.device("cpu")), CpuAttentionBackend)


def test_rejects_unsupported_layout():
    cache, bt, seq_lens, q, tok_idx = _case(torch.float32, 4, 2, 16, [5])
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(q, cache, bt, seq_lens.long(), tok_idx, torch.arange(1), 0.25,
                               torch.empty_like(q))
    with pytest.raises(ValueError, match="does not take"):
        paged_decode_attention(q.half(), cache, bt, seq_lens, tok_idx, torch.arange(1), 0.25,
                               torch.empty_like(q.half()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (30.0, 9)])
def test_backend_verification_step_matches_reference(dtype, soft_cap, window):
    """A verification step (speculative decoding: k + 1 = 5 new tokens per request, one
    request with 2, one with 1) takes the C decode pass with one virtual request per
    token (`_decode_plan`), causal within the step: same cache and output as the torch
    reference, which runs it as prefill chunks."""
    from flowengine.model.attention.cpu_backend import _decode_plan

    hq, hkv, d = 8, 2, 64
    q_lens, lens = [5, 2, 1, 5], [40, 17, 64, 5]
    max_blocks = -(-max(lens) // BLOCK)
    num_blocks = len(lens) * max_blocks + 2
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d).to(dtype)
    cache_ref = cache.clone()
    bt = torch.randperm(num_blocks)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    bt = bt.to(torch.int32)
    slots = torch.cat([bt[r].long()[torch.arange(s - n, s) // BLOCK] * BLOCK
                       + torch.arange(s - n, s) % BLOCK
                       for r, (n, s) in enumerate(zip(q_lens, lens, strict=True))])
    qsl = torch.tensor([0, 5, 7, 8, 13], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(qsl, seq_lens, bt, slots, 5, 64, qsl, seq_lens)
    q = (4 * torch.randn(13, hq, d)).to(dtype)
    k, v = torch.randn(13, hkv, d).to(dtype), torch.randn(13, hkv, d).to(dtype)
    out = CpuAttentionBackend().forward(q, k, v, cache, meta, d ** -0.5,
                                        logits_soft_cap=soft_cap, sliding_window=window)
    tok_idx, req_idx, plan_lens, _ = _decode_plan(meta, q)
    assert req_idx.tolist() == [0] * 5 + [1] * 2 + [2] + [3] * 5
    assert plan_lens.tolist() == [36, 37, 38, 39, 40, 16, 17, 64, 1, 2, 3, 4, 5]
    meta_ref = AttentionMetadata(qsl, seq_lens, bt, slots, 5, 64, qsl, seq_lens)
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta_ref, d ** -0.5,
                                          logits_soft_cap=soft_cap, sliding_window=window)
    assert torch.equal(cache, cache_ref)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=8e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
