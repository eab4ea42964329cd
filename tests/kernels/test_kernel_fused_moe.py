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
