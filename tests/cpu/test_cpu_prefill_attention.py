"""Prefill attention over the paged KV cache in C (`paged_prefill_attention`) against the
torch reference backend (PyTorch's SDPA with a causal or windowed mask).

Each case is a fresh random step: prompt chunks fresh and after a cached prefix, of
lengths around the kernel's 16-token query blocks and 64-position segments and the
cache's 16-slot blocks, mixed with one-token (decode) requests and padding rows, over a
cache whose block tables are scattered; grouped-query ratios 1 to 7, head_dim 40 to
256, sliding windows, float32 and bf16 caches. The whole backend runs on one copy of the
cache and the reference on another: the caches must end equal and the outputs agree to
float32 rounding (the sums run in another order).
"""

from __future__ import annotations

import pytest
import torch

from flowengine.model.attention.cpu_backend import (
    CpuAttentionBackend,
    _prefill_kernel_on,
    paged_prefill_attention,
)
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend
from flowengine.model.layers.quant_linear import kernels_available

pytestmark = pytest.mark.skipif(
    not kernels_available() or not _prefill_kernel_on(),
    reason="needs flowengine._cpu_ops on a CPU with AVX2 + FMA and without AVX-512")

BLOCK = 16
F32_TOL = dict(rtol=2e-5, atol=2e-5)


def _step(hq, hkv, d, q_lens, lens, dtype=torch.float32, pad=0, seed=0):
    """A step: request r has q_lens[r] new tokens ending its lens[r]-token context
    (the prefix before them already in the cache). Returns the tensors and metadata."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // BLOCK)
    num_blocks = len(lens) * max_blocks + 3
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[:len(lens) * max_blocks]
    bt = bt.view(len(lens), max_blocks).to(torch.int32)
    slots = torch.cat([bt[r].long()[torch.arange(s - n, s) // BLOCK] * BLOCK
                       + torch.arange(s - n, s) % BLOCK
                       for r, (n, s) in enumerate(zip(q_lens, lens, strict=True))])
    num_tokens = sum(q_lens)
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=torch.int64)])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(qsl, seq_lens, bt, slots, max(q_lens), max(lens), qsl, seq_lens)
    rows = num_tokens + pad
    q = 2 * torch.randn(rows, hq, d, generator=g)
    k = torch.randn(rows, hkv, d, generator=g)
    v = torch.randn(rows, hkv, d, generator=g)
    if dtype != torch.float32:  # the reference attends a fresh prompt's own k/v as given
        k, v = k.to(dtype).float(), v.to(dtype).float()
    return cache, meta, q, k, v


def _both(hq, hkv, d, q_lens, lens, window=None, dtype=torch.float32, pad=0, seed=0):
    cache, meta, q, k, v = _step(hq, hkv, d, q_lens, lens, dtype, pad, seed)
    cache_ref = cache.clone()
    out = CpuAttentionBackend().forward(q, k, v, cache, meta, d ** -0.5,
                                        sliding_window=window)
    # the reference on its own metadata object (the backend caches plans on meta)
    _, meta_ref, *_ = _step(hq, hkv, d, q_lens, lens, dtype, pad, seed)
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta_ref, d ** -0.5,
                                          sliding_window=window)
    assert torch.equal(cache, cache_ref)
    return out, ref, meta


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (8, 2, 64), (12, 4, 72),
                                      (4, 1, 256), (7, 1, 40)])
@pytest.mark.parametrize("window", [None, 21, 100])
def test_mixed_step_matches_reference(hq, hkv, d, window):
    # fresh prompts of 9, 16, 64, 65 and 130 tokens; chunks of 17 and 63 after cached
    # prefixes of 47 and 140; two decode tokens
    q_lens = [9, 16, 1, 64, 17, 65, 1, 130, 63]
    lens = [9, 16, 40, 64, 64, 65, 200, 130, 203]
    out, ref, meta = _both(hq, hkv, d, q_lens, lens, window, pad=3)
    assert meta._cpu_prefill_plan.chunks.tolist() == [0, 1, 3, 4, 5, 7, 8]
    assert meta._cpu_prefill_plan.decode == [2, 6]
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))  # padding rows
    torch.testing.assert_close(out, ref, **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 30])
def test_half_cache_matches_reference(window, dtype):
    """A bf16 cache on a CPU without native bf16 products, or a float16 cache: the
    kernel reads K/V from the cache (values widened exactly), float32 sums, as the
    reference does given the same values."""
    out, ref, _ = _both(9, 3, 64, [128, 1, 50], [128, 77, 180], window, dtype)
    torch.testing.assert_close(out, ref, **F32_TOL)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    q_lens = torch.randint(1, 150, (n,), generator=g).tolist()
    q_lens[0] = max(q_lens[0], 2)  # at least one prompt chunk
    lens = [ql + int(torch.randint(0, 120, (1,), generator=g)) for ql in q_lens]
    out, ref, _ = _both(9, 3, 64, q_lens, lens, seed=seed)
    torch.testing.assert_close(out, ref, **F32_TOL)


def test_unlisted_rows_untouched_and_one_request_alone():
    """Rows of requests not listed are not written; a request's rows are the same bits
    whether it is attended alone or with others."""
    hq, hkv, d = 9, 3, 64
    q_lens, lens = [40, 70, 20], [40, 100, 20]
    cache, meta, q, k, v = _step(hq, hkv, d, q_lens, lens)
    CpuAttentionBackend._write_kv(k, v, cache, meta.slot_mapping)
    starts = meta.query_start_loc_cpu.long()
    args = (cache, meta.block_tables, starts, meta.seq_lens_cpu)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, *args, torch.tensor([0, 2]), d ** -0.5, out)
    assert torch.isnan(out[40:110]).all()
    assert not torch.isnan(out[:40]).any() and not torch.isnan(out[110:]).any()
    alone = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, *args, torch.tensor([2]), d ** -0.5, alone)
    assert torch.equal(alone[110:], out[110:])


def test_soft_cap_falls_back_to_the_reference():
    cache, meta, q, k, v = _step(8, 2, 64, [30, 1], [30, 50])
    cache_ref = cache.clone()
    out = CpuAttentionBackend().forward(q, k, v, cache, meta, 0.125, logits_soft_cap=20.0)
    _, meta_ref, *_ = _step(8, 2, 64, [30, 1], [30, 50])
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta_ref, 0.125,
                                          logits_soft_cap=20.0)
    assert not hasattr(meta, "_cpu_prefill_plan")  # the kernel did not run
    torch.testing.assert_close(out, ref, **F32_TOL)


def test_rejects_what_it_does_not_take():
    cache, meta, q, k, v = _step(4, 2, 64, [20], [20])
    starts, bt, sl = meta.query_start_loc_cpu.long(), meta.block_tables, meta.seq_lens_cpu
    out = torch.empty_like(q)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="does not take"):
        paged_prefill_attention(q.bfloat16(), cache, bt, starts, sl, one, 0.125,
                                out.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        paged_prefill_attention(q, cache, bt, starts.int(), sl, one, 0.125, out)
    with pytest.raises(ValueError, match="disagree"):
        paged_prefill_attention(q, cache, bt, starts, sl, torch.tensor([1]), 0.125, out)
    odd = torch.randn(20, 4, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_prefill_attention(odd, torch.zeros(2, 4, BLOCK, 2, 12), bt, starts, sl, one,
                                0.125, torch.empty_like(odd))
    with pytest.raises(IndexError, match="more blocks"):
        paged_prefill_attention(q, cache, bt, starts, torch.tensor([40], dtype=torch.int32),
                                one, 0.125, out)
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_attention(q, cache, bt, starts, torch.tensor([10], dtype=torch.int32),
                                one, 0.125, out)
