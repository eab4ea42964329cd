"""The fused MoE kernel compiled for CUDA at full model shapes in bf16, against the
torch reference (flowengine/model/layers/moe.py's fused_moe_torch) run in float32 on
the same bf16 weights: Mixtral-8x7B (8 experts, 4096 -> 14336, top-2) and Qwen3-30B-A3B
(128 experts, 2048 -> 768, top-8), decode- and prefill-sized batches; plus a replay
from a CUDA graph with new routing (the alignment never syncs with the host) on both the
grouped and the alignment-free decode path (T * k <= DECODE_MAX_PAIRS, at T = 1 and 4); and
expert parallelism's two halves (expert_map) summing to the whole. The tuned tile
files in kernels/configs/ apply at these shapes."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

from flowengine.kernels.fused_moe import fused_moe  # noqa: E402
from flowengine.model.layers.moe import fused_moe_torch, select_experts  # noqa: E402

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def _weights(e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    # std 1/sqrt(fan_in) keeps activations O(1) through both projections.
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") * i ** -0.5).bfloat16()
    return w13, w2


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_full_shapes_bf16(model: str, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    e, k, h, i = SHAPES[model]
    w13, w2 = _weights(e, h, i)
    x = torch.randn(num_tokens, h, device="cuda").bfloat16()
    weights, ids = select_experts(torch.randn(num_tokens, e, device="cuda"), k, True)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    # bf16 intermediates rounded once each: relative error a few bf16 ulps (2**-8).
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 2e-2, float(err)


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_decode_path_full_shapes_bf16(model: str, num_tokens: int) -> None:
    # The alignment-free decode path (T * k <= DECODE_MAX_PAIRS) against the float32
    # reference and the grouped path, with and without expert_map (every expert local
    # but numbered in reverse, and half of them on another rank).
    from flowengine.kernels.fused_moe import DECODE_MAX_PAIRS

    torch.manual_seed(100 + num_tokens)
    e, k, h, i = SHAPES[model]
    assert num_tokens * k <= DECODE_MAX_PAIRS
    w13, w2 = _weights(e, h, i)
    x = torch.randn(num_tokens, h, device="cuda").bfloat16()
    weights, ids = select_experts(torch.randn(num_tokens, e, device="cuda"), k, True)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, decode=True)
    assert (out.float() - ref).norm() / ref.norm() < 2e-2
    grouped = fused_moe(x, w13, w2, weights, ids, decode=False)
    assert (out.float() - grouped.float()).norm() / ref.norm() < 1e-2
    rev = torch.arange(e - 1, -1, -1, dtype=torch.int32, device="cuda")
    out_rev = fused_moe(x, w13.flip(0).contiguous(), w2.flip(0).contiguous(), weights, ids,
                        expert_map=rev, decode=True)
    assert torch.equal(out_rev, out)  # same rows, same order of the k-sum
    half = e // 2
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[:half] = torch.arange(half, dtype=torch.int32, device="cuda")
    part = fused_moe(x, w13[:half].contiguous(), w2[:half].contiguous(), weights, ids,
                     expert_map=emap, decode=True)
    local = torch.where(ids < half, weights, torch.zeros_like(weights))
    ref_half = fused_moe_torch(x.float(), w13.float(), w2.float(), local, ids)
    assert (part.float() - ref_half).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("decode", [True, False])
def test_cuda_graph_replay_with_new_routing(decode: bool) -> None:
    e, k, h, i = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(e, h, i)
    x = torch.randn(8, h, device="cuda").bfloat16()
    logits = torch.randn(8, e, device="cuda")
    weights, ids = select_experts(logits, k, True)
    static_w, static_ids = weights.clone(), ids.clone()
    fused_moe(x, w13, w2, static_w, static_ids, decode=decode)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, static_w, static_ids, decode=decode)
    for _ in range(3):
        new_w, new_ids = select_experts(torch.randn(8, e, device="cuda"), k, True)
        static_w.copy_(new_w)
        static_ids.copy_(new_ids)
        graph.replay()
        ref = fused_moe_torch(x.float(), w13.float(), w2.float(), new_w, new_ids)
        assert (out.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("model", list(SHAPES))
def test_expert_parallel_halves_sum_to_the_whole(model: str) -> None:
    # --enable-expert-parallel at TP 2: each rank's kernel call with its half of the
    # experts and expert_map (-1 for the other half) adds up to the unsplit layer.
    torch.manual_seed(7)
    e, k, h, i = SHAPES[model]
    w13, w2 = _weights(e, h, i)
    x = torch.randn(64, h, device="cuda").bfloat16()
    weights, ids = select_experts(torch.randn(64, e, device="cuda"), k, True)
    half = e // 2
    parts = []
    for rank in range(2):
        emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
        emap[rank * half:(rank + 1) * half] = torch.arange(half, dtype=torch.int32,
                                                           device="cuda")
        sl = slice(rank * half, (rank + 1) * half)
        parts.append(fused_moe(x, w13[sl].contiguous(), w2[sl].contiguous(), weights, ids,
                               expert_map=emap).float())
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert (parts[0] + parts[1] - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_router_gemv_topk_full_shape_in_a_cuda_graph(num_tokens: int) -> None:
    # Qwen3-30B-A3B's router (2048 -> 128, top-8, renormalised) in one launch against
    # F.linear in bf16 then select_experts; captured in a graph and replayed with new
    # inputs, so the counter must come back to zero every launch.
    from flowengine.kernels.fused_moe import route_topk_gemv

    e, k, h, _ = SHAPES["qwen3-30b-a3b"]
    w = (torch.randn(e, h, device="cuda") * h ** -0.5).bfloat16()
    x = torch.randn(num_tokens, h, device="cuda").bfloat16()
    counter = torch.zeros(16, dtype=torch.int32, device="cuda")
    route_topk_gemv(x, w, k, True, counter)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk_gemv(x, w, k, True, counter)
    for _ in range(3):
        x.copy_(torch.randn(num_tokens, h, device="cuda").bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        logits = torch.nn.functional.linear(x, w).float()
        want_w, want_ids = select_experts(logits, k, True)
        assert torch.equal(counter, torch.zeros_like(counter))
        # bf16 logits (steps of 1/128 near 1) tie often among 128 experts and a rounding
        # may flip near ties, and torch.topk orders ties its own way (seen: 6 of 8
        # positions equal at T = 1), so: the picked logits, in order, are the top-k
        # values to a bf16 step, and their weights the reference's to 2e-2.
        got = logits.gather(1, ids)
        torch.testing.assert_close(got, logits.gather(1, want_ids), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(weights, want_w, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens, device="cuda"))


def test_rotary_qk_norm_full_shape_bf16() -> None:
    # Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128): the fused per-head RMSNorm +
    # RoPE + KV write against RMSNorm (kernels/rms_norm.py) + rotary_embedding_and_cache.
    from flowengine.kernels.rms_norm import rms_norm
    from flowengine.kernels.rope_cache import build_rope_cache
    from flowengine.kernels.rotary import rotary_embedding_and_cache

    t, hq, hkv, d = 7, 32, 4, 128
    cos, sin = build_rope_cache(d, 40960, 1000000.0, device="cuda")
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    q_w = (1 + 0.3 * torch.randn(d, device="cuda")).bfloat16()
    k_w = (1 + 0.3 * torch.randn(d, device="cuda")).bfloat16()
    positions = torch.randint(0, 40960, (t,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:t]
    cache = torch.zeros(2, 4, 16, hkv, d, device="cuda").bfloat16()
    want_cache = cache.clone()

    def split(a: torch.Tensor):
        return (a[:, :hq * d].view(t, hq, d), a[:, hq * d:(hq + hkv) * d].view(t, hkv, d),
                a[:, (hq + hkv) * d:].view(t, hkv, d))

    ref = qkv.clone()
    q, k, v = split(ref)
    q_n, k_n = rms_norm(q.contiguous(), q_w, 1e-6), rms_norm(k.contiguous(), k_w, 1e-6)
    rotary_embedding_and_cache(positions, q_n, k_n, v, want_cache, slots, cos, sin)
    q, k, v = split(qkv)
    rotary_embedding_and_cache(positions, q, k, v, cache, slots, cos, sin,
                               qk_norm=(q_w, k_w, 1e-6))
    assert (q.float() - q_n.float()).abs().max() <= 2e-2 * q_n.float().abs().max()
    assert (cache.float() - want_cache.float()).abs().max() <= 2e-2 * want_cache.float().abs().max()
