"""Fused MoE kernel (kernels/fused_moe.py) against a float64 dense reference: every
expert applied to every token, weighted by a dense routing matrix. Fresh random inputs
each run; tiny shapes (the interpreter is slow); full shapes under tests/gpu."""

from __future__ import annotations

import pytest
import torch

from flowengine.kernels.fused_moe import BLOCK_M, fused_moe, moe_align_block_size


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    t, e, i = x.shape[0], w13.shape[0], w2.shape[2]
    dense = torch.zeros(t, e, dtype=torch.float64, device=x.device)
    dense.scatter_add_(1, ids.long(), weights.double())
    gate_up = torch.einsum("th,eoh->teo", x.double(), w13.double())
    act = torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]
    return (dense[..., None] * torch.einsum("tei,ehi->teh", act, w2.double())).sum(1)


def _routing(t: int, e: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(t, e, device=device)
    weights, ids = torch.softmax(logits, -1).topk(k, -1)
    return weights.float(), ids


@pytest.mark.parametrize(("t", "e", "k", "h", "i"), [
    (1, 4, 2, 32, 16),  # one decode token
    (7, 8, 2, 48, 40),  # Mixtral-like top-2, hidden/width not multiples of the tiles
    (20, 16, 4, 32, 24),  # Qwen-like many experts: some experts get no tokens
    (33, 3, 3, 16, 16),  # every expert chosen by every token
])
def test_fused_moe_matches_reference_fp32(t, e, k, h, i, device) -> None:
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (t, h) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_half_types(dtype, device) -> None:
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the Triton interpreter's tl.dot mis-computes bfloat16 (CUDA only)")
    t, e, k, h, i = 9, 6, 2, 32, 32
    x = torch.randn(t, h, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device=device) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, device=device) * 0.2).to(dtype)
    weights, ids = _routing(t, e, k, device)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    # half intermediates (gate_up, act, down each rounded once): a few ulps of the dtype
    tol = 3e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               atol=tol, rtol=tol)


def test_alignment_groups_pairs_by_expert_padded_to_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 -> experts 2,0,2,1,0,2
    sorted_ids, block_experts = moe_align_block_size(ids, 4, 4)
    pad = 6
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    # bound 6 + 4 * (4 - 1) = 18 rows, rounded up to 5 blocks of 4
    assert sorted_ids.shape[0] == 20 and set(sorted_ids.tolist()[12:]) == {pad}
    assert block_experts.tolist() == [0, 1, 2, -1, -1]
    assert BLOCK_M >= 16


def test_bad_shapes_are_refused(device) -> None:
    x = torch.randn(3, 16, device=device)
    w13 = torch.randn(2, 32, 16, device=device)
    w2 = torch.randn(2, 16, 8, device=device)  # I = 16 expected
    weights, ids = _routing(3, 2, 1, device)
    with pytest.raises(ValueError, match="fused_moe shapes disagree"):
        fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(fused_moe(x[:0], w13, torch.randn(2, 16, 16, device=device),
                                 weights[:0], ids[:0]), x[:0])


def test_alignment_leaves_out_other_ranks_pairs() -> None:
    ids = torch.tensor([[1, -1], [-1, 0], [1, 0]])  # pairs 0..5 -> 1, x, x, 0, 1, 0
    sorted_ids, block_experts = moe_align_block_size(ids, 2, 4)
    pad = 6
    # bound 6 + 2 * 3 = 12 rows: expert 0's pairs, padding, expert 1's, padding, unused
    assert sorted_ids.tolist() == [3, 5, pad, pad, 0, 4, pad, pad, pad, pad, pad, pad]
    assert block_experts.tolist() == [0, 1, -1]


def test_expert_parallel_ranks_sum_to_the_whole_layer(device) -> None:
    # Expert parallelism: 8 experts on 2 ranks of 4; each rank's output counts only the
    # pairs of its experts (expert_map -1 for the others), and the two add up to all.
    t, e, k, h, i = 9, 8, 3, 32, 16
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    ids[0] = torch.tensor([0, 1, 2])  # token 0 entirely on rank 0: zero on rank 1
    parts = []
    for rank in range(2):
        emap = torch.full((e,), -1, dtype=torch.int32, device=device)
        emap[4 * rank:4 * rank + 4] = torch.arange(4, dtype=torch.int32, device=device)
        parts.append(fused_moe(x, w13[4 * rank:4 * rank + 4], w2[4 * rank:4 * rank + 4],
                               weights, ids, expert_map=emap))
    assert torch.equal(parts[1][0], torch.zeros(h, device=device))
    torch.testing.assert_close((parts[0] + parts[1]).double(),
                               _reference(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-4)


def test_tile_config_override_gives_the_same_result(device) -> None:
    t, e, k, h, i = 40, 4, 2, 64, 48
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    ref = _reference(x, w13, w2, weights, ids)
    for cfg in ({"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "num_warps": 4,
                 "num_stages": 2},
                {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 32, "num_warps": 8,
                 "num_stages": 3}):
        out = fused_moe(x, w13, w2, weights, ids, config=cfg)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_tuned_config_files_are_read_by_vllms_names(tmp_path, monkeypatch) -> None:
    import json

    from flowengine.kernels import fused_moe as fm

    assert fm.config_file_name(128, 768, "NVIDIA H200") == \
        "E=128,N=768,device_name=NVIDIA_H200.json"
    assert fm.config_file_name(8, 7168, "NVIDIA H200", "fp8_w8a8") == \
        "E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
    monkeypatch.setenv("FLOWENGINE_MOE_CONFIG_DIR", str(tmp_path))
    fm.load_configs.cache_clear()
    tiles = {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 256,
                   "num_warps": 4, "num_stages": 4},
             "64": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64,
                    "num_warps": 8, "num_stages": 3, "GROUP_SIZE_M": 1}}
    (tmp_path / "E=4,N=48,device_name=Fake_GPU.json").write_text(json.dumps(tiles))
    configs = fm.load_configs(4, 48, "Fake GPU")
    assert configs == {1: tiles["1"], 64: {k: v for k, v in tiles["64"].items()
                                           if k != "GROUP_SIZE_M"}}
    assert fm.load_configs(4, 96, "Fake GPU") is None  # no file: the default tiles
    (tmp_path / "E=4,N=50,device_name=Fake_GPU.json").write_text('{"1": {"BLOCK_SIZE_M": 24}}')
    with pytest.raises(ValueError, match="E=4,N=50,device_name=Fake_GPU.json"):
        fm.load_configs(4, 50, "Fake GPU")
    fm.load_configs.cache_clear()
    # off CUDA the files are not consulted
    assert fm.get_config(64, 4, 96, 64, 48, torch.device("cpu")) == fm.default_config(64, 96, 64)


def test_shipped_h200_configs_parse(monkeypatch) -> None:
    # The tuned files in kernels/configs (benchmarks/moe_gpu.py on the H200) for Mixtral
    # (8 x 14336) and Qwen3-30B-A3B (128 x 768), buckets 1 .. 1024 tokens.
    from flowengine.kernels import fused_moe as fm

    monkeypatch.delenv("FLOWENGINE_MOE_CONFIG_DIR", raising=False)
    fm.load_configs.cache_clear()
    for e, n in ((8, 14336), (128, 768)):
        configs = fm.load_configs(e, n, "NVIDIA H200")
        assert configs is not None and sorted(configs) == [1, 16, 64, 256, 1024]
        assert all(c["BLOCK_SIZE_M"] in (16, 32, 64) for c in configs.values())
    fm.load_configs.cache_clear()


@pytest.mark.parametrize(("t", "k"), [(1, 1), (1, 2), (1, 8), (2, 8), (5, 2), (8, 1),
                                    (8, 8)])
def test_decode_path_matches_reference_fp32(t, k, device, monkeypatch) -> None:
    # The alignment-free decode path (a GEMV per pair, the k pairs summed in one program),
    # picked by default at T * k <= decode_pair_limit(I): hidden 40 and width 24 are not
    # multiples of its tiles; 10 experts (128 when T * k > 5), so tokens share experts.
    from flowengine.kernels import fused_moe as fm

    calls = []
    real = fm._fused_moe_decode
    monkeypatch.setattr(fm, "_fused_moe_decode",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    e, h, i = (10 if t * k <= 5 else 128), 40, 24
    assert t * k <= fm.decode_pair_limit(i)
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    out = fused_moe(x, w13, w2, weights, ids)
    assert calls == [(t, h)]
    assert out.shape == (t, h) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               atol=2e-5, rtol=1e-4)
    # past the threshold, or with a tile config, the grouped path runs
    fused_moe(x[:1], w13, w2, weights[:1], ids[:1], config=fm.default_config(1, 2 * i, h))
    assert len(calls) == 1


def test_default_path_follows_the_pair_limit(device, monkeypatch) -> None:
    # With room for 48 expert columns, width 24 gets 2 pairs: T * k = 2 takes the decode
    # path, 3 and 4 the grouped one; both agree with the reference.
    from flowengine.kernels import fused_moe as fm

    calls = []
    real = fm._fused_moe_decode
    monkeypatch.setattr(fm, "_fused_moe_decode",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(fm, "DECODE_MAX_PAIR_COLUMNS", 48)
    e, h, i = 6, 32, 24
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    for t, k, decoded in ((1, 2, True), (1, 3, False), (2, 2, False)):
        calls.clear()
        x = torch.randn(t, h, device=device)
        weights, ids = _routing(t, e, k, device)
        out = fused_moe(x, w13, w2, weights, ids)
        assert calls == ([(t, h)] if decoded else [])
        torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("t", "k"), [(1, 1), (2, 2), (3, 8)])
def test_decode_path_with_expert_map(t, k, device) -> None:
    # Expert parallelism on the decode path: 10 experts on two ranks (6 + 4, shuffled
    # ownership); -1 pairs add nothing and the ranks' outputs sum to the whole layer.
    e, h, i = 10, 48, 40
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    owner = torch.randperm(e, device=device) < 6  # True: rank 0
    parts = []
    for rank_experts in (owner, ~owner):
        local = torch.nonzero(rank_experts).flatten()
        emap = torch.full((e,), -1, dtype=torch.int32, device=device)
        emap[local] = torch.arange(local.numel(), dtype=torch.int32, device=device)
        out = fused_moe(x, w13[local], w2[local], weights, ids, expert_map=emap, decode=True)
        grouped = fused_moe(x, w13[local], w2[local], weights, ids, expert_map=emap,
                            decode=False)
        torch.testing.assert_close(out, grouped, atol=2e-5, rtol=1e-4)
        # a token none of whose experts are local gets exact zeros
        for tok in range(t):
            if not rank_experts[ids[tok]].any():
                assert torch.equal(out[tok], torch.zeros(h, device=device))
        parts.append(out)
    torch.testing.assert_close((parts[0] + parts[1]).double(),
                               _reference(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_path_half_precision_rounds_like_the_grouped_path(dtype, device) -> None:
    # gate_up, act and each weighted row rounded once to the dtype, as the grouped path
    # does (compared with it in float16 only: the interpreter's bfloat16 tl.dot, which the
    # grouped path uses and the decode path does not, is wrong on CPU).
    t, e, k, h, i = 4, 6, 2, 64, 32
    x = torch.randn(t, h, device=device).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device=device) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, device=device) * 0.2).to(dtype)
    weights, ids = _routing(t, e, k, device)
    out = fused_moe(x, w13, w2, weights, ids, decode=True)
    assert out.dtype == dtype
    tol = 3e-3 if dtype == torch.float16 else 3e-2  # a few ulps of the dtype
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               atol=tol, rtol=tol)
    if dtype == torch.float16:
        torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids, decode=False),
                                   atol=2e-3, rtol=2e-3)


def test_decode_pair_limit_follows_the_expert_width() -> None:
    from flowengine.kernels.fused_moe import DECODE_MAX_PAIRS, decode_pair_limit

    assert DECODE_MAX_PAIRS == 128
    # Qwen3-30B-A3B (768 wide, top-8): 128 pairs = 16 tokens, its TP-2 slice too; OLMoE
    # (1024): 12 tokens; Mixtral (14336, top-2): 3 tokens, 6 at TP 2; tiny widths: 128
    assert [decode_pair_limit(i) for i in (768, 384, 1024, 14336, 7168, 24, 100000)] == [
        128, 128, 96, 6, 13, 128, 1]


@pytest.mark.parametrize("tiles", [
    dict(),
    dict(gate_up_n=32, gate_up_k=32, gate_up_warps=8, down_n=16, down_k=16),
    dict(gate_up_n=16, gate_up_k=64, down_n=32, down_k=32, down_warps=4),
])
@pytest.mark.parametrize(("t", "k"), [(1, 1), (2, 3), (3, 6), (2, 8)])
def test_decode_tile_variants_match_reference(tiles, t, k, device) -> None:
    # The default tiles and others that split and do not divide hidden 40 / width 72
    # (benchmarks/moe_gpu.py sweeps more on the GPU), k not a power of two (the down
    # kernel pads the k slots to 4 / 8), with and without an expert_map.
    from flowengine.kernels import fused_moe as fm

    e, h, i = 12, 40, 72
    x = torch.randn(t, h, device=device)
    w13 = torch.randn(e, 2 * i, h, device=device) * 0.2
    w2 = torch.randn(e, h, i, device=device) * 0.2
    weights, ids = _routing(t, e, k, device)
    dt = fm.DecodeTiles(**tiles)
    out = fm._fused_moe_decode(x, w13, w2, weights, ids, None, dt)
    torch.testing.assert_close(out.double(), _reference(x, w13, w2, weights, ids),
                               atol=2e-5, rtol=1e-4)
    local = torch.arange(e, device=device) % 2 == 0
    emap = torch.full((e,), -1, dtype=torch.int32, device=device)
    emap[local] = torch.arange(int(local.sum()), dtype=torch.int32, device=device)
    part = fm._fused_moe_decode(x, w13[local], w2[local], weights, ids, emap, dt)
    mine = torch.where(local[ids], weights, torch.zeros_like(weights))
    torch.testing.assert_close(part.double(), _reference(x, w13, w2, mine, ids),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("t", "e", "k", "renorm"), [(1, 128, 8, True), (5, 60, 4, False),
                                                      (3, 8, 2, True), (2, 10, 1, False),
                                                      (4, 64, 8, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_equals_select_experts(t, e, k, renorm, dtype, device) -> None:
    # The one-launch router against the torch one: the same experts in the same order,
    # weights to float32 rounding; Qwen3-MoE, Qwen2-MoE, Mixtral, top-1, OLMoE shapes.
    from flowengine.kernels.fused_moe import route_topk
    from flowengine.model.layers.moe import select_experts

    logits = (torch.randn(t, 2 * e, device=device) * 3).to(dtype)[:, ::2]  # strided rows
    weights, ids = route_topk(logits, k, renorm)
    want_w, want_ids = select_experts(logits, k, renorm)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    else:  # bf16 logits tie often; torch.topk orders equal ones its own way
        assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    if renorm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(t, device=device))


def test_route_topk_takes_the_lowest_expert_among_ties(device) -> None:
    from flowengine.kernels.fused_moe import route_topk

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], device=device)
    weights, ids = route_topk(logits, 4, True)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert route_topk(logits[:0], 2, True)[1].shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 7, True)


@pytest.mark.parametrize(("t", "e", "k", "h", "renorm"), [(1, 128, 8, 64, True),
                                                           (3, 10, 2, 48, True),
                                                           (5, 60, 4, 40, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_gemv_equals_linear_then_select_experts(t, e, k, h, renorm, dtype,
                                                           device) -> None:
    # The router GEMV fused into the routing launch against F.linear in x's dtype (float32
    # reference for float32 inputs) then torch's softmax top-k; the counter is left zero
    # so a second launch (a CUDA-graph replay) routes the same.
    from flowengine.kernels.fused_moe import route_topk_gemv
    from flowengine.model.layers.moe import select_experts

    x = torch.randn(t, h, device=device).to(dtype)
    w = (torch.randn(e, h, device=device) * 0.3).to(dtype)
    counter = torch.zeros(16, dtype=torch.int32, device=device)
    logits = torch.nn.functional.linear(x.float(), w.float())
    for _ in range(2):
        weights, ids = route_topk_gemv(x, w, k, renorm, counter)
        assert torch.equal(counter, torch.zeros_like(counter))
        want_w, want_ids = select_experts(logits.to(dtype), k, renorm)
        got = logits.to(dtype).gather(1, ids)
        if dtype == torch.float32:  # summation order differs: compare the picked logits
            torch.testing.assert_close(got, logits.gather(1, want_ids), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(weights, want_w, atol=1e-5, rtol=1e-4)
        else:  # a bf16 rounding of a logit may flip near ties: the picked ones are top-k
            kth = logits.to(dtype).float().topk(k, -1).values[:, -1:]
            assert bool((got.float() >= kth - 0.02 * kth.abs() - 1e-2).all())
            torch.testing.assert_close(weights.sum(-1) if renorm else weights,
                                       want_w.sum(-1) if renorm else want_w,
                                       atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="counter"):
        route_topk_gemv(x, w, k, renorm, counter[:0])


def test_sparse_moe_block_routes_through_route_and_forward_on_cpu() -> None:
    # Off CUDA the fused-router entry point is the unfused router + FusedMoE.forward.
    from flowengine.distributed.tp_group import SINGLE_RANK
    from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock

    block = SparseMoeBlock(FusedMoE(6, 2, 16, 8, True, SINGLE_RANK))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block.experts.init_buffers()
    x = torch.randn(3, 16)
    want = block.experts(x, torch.nn.functional.linear(x, block.gate.weight))
    torch.testing.assert_close(block(x), want)
    assert torch.equal(block.experts.router_counter, torch.zeros(16, dtype=torch.int32))
