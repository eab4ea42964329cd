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
