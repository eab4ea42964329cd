"""Verification steps (speculative decoding, issue 16) on the split-KV decode kernel,
compiled for CUDA: k + 1 new tokens per request packed with the QPK heads of a KV head
into one tile, at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128) in bf16
and over an E4M3 cache, batch 1 to 256, contexts up to 4k, against the float64
reference of tests/kernels/kernel_refs.py and against the unified kernel; and the
backend's verification step replayed from a CUDA graph (fixed shapes, varying query
lengths and contexts, padding rows zeroed). Run: pytest tests/gpu/test_decode_attention_verify_gpu.py
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))  # kernel_refs.py

from kernel_refs import (  # noqa: E402
    AttentionCase,
    assert_close,
    make_attention_case,
    ref_paged_attention,
)

from flowengine.kernels.decode_attention import decode_attention  # noqa: E402
from flowengine.kernels.paged_attention import paged_attention  # noqa: E402
from flowengine.model.attention import triton_backend  # noqa: E402
from flowengine.model.attention.metadata import AttentionMetadata  # noqa: E402
from flowengine.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
# bf16 output (2**-8) after P was rounded to bf16 for P @ V (as tests/gpu/test_kernels_gpu.py).
BF16_ATTN_TOL = {"rtol": 2e-2, "atol": 1.5e-2}


@pytest.fixture(autouse=True)
def random_seed() -> Iterator[int]:
    seed = int(os.environ.get("FLOWENGINE_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"random seed: {seed} (replay with FLOWENGINE_TEST_SEED={seed})")
    yield seed


def _randint(low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, ()).item())


def _metadata(case: AttentionCase, max_query_len: int) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        block_tables=case.block_tables, slot_mapping=case.slot_mapping,
        max_query_len=max_query_len, max_seq_len=max(case.ctx_lens),
        query_start_loc_cpu=case.query_start_loc.cpu(), seq_lens_cpu=case.seq_lens.cpu(),
    )


@pytest.mark.parametrize(
    ("batch", "qpk", "q", "fp8", "num_kv_splits", "window", "soft_cap"),
    [(1, 4, 5, False, 16, None, None), (1, 4, 5, True, 64, None, None),
     (1, 4, 8, False, 32, 500, None), (16, 8, 5, False, None, None, 30.0),
     (64, 4, 5, False, 1, None, None), (64, 4, 3, True, None, 300, None),
     (256, 4, 5, False, 1, None, None), (4, 2, 8, False, 8, None, None)],
)
def test_verification_matches_reference(batch: int, qpk: int, q: int, fp8: bool,
                                        num_kv_splits: int | None, window: int | None,
                                        soft_cap: float | None) -> None:
    # Every request q tokens but one with fewer (a proposer that found fewer drafts).
    q_lens = [q] * batch
    q_lens[-1] = max(1, q - 2)
    seq_lens = [_randint(q, 4096) for _ in range(batch - 1)] + [4096]
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=NUM_KV_HEADS * qpk, num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device=CUDA,
        num_padding_tokens=3,
    )
    if fp8:  # the reference reads the same E4M3 values, widened exactly
        case.kv_cache = case.kv_cache.to(torch.float8_e4m3fn)
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=max(seq_lens), scale=case.scale, num_kv_splits=num_kv_splits, out=out,
        sliding_window=window, logits_soft_cap=soft_cap, max_query_len=q,
    )
    num_real = sum(q_lens)
    expected = ref_paged_attention(case, sliding_window=window, soft_cap=soft_cap)
    assert_close(out[:num_real], expected, **BF16_ATTN_TOL)
    assert out[num_real:].isnan().all(), "padding rows must be left untouched"
    if not fp8:  # the unified kernel on the same inputs agrees to bf16 rounding
        unified = torch.full_like(case.query, float("nan"))
        paged_attention(
            case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
            case.block_tables, max_query_len=q, scale=case.scale, out=unified,
            sliding_window=window, logits_soft_cap=soft_cap,
        )
        assert_close(out[:num_real], unified[:num_real].double(), **BF16_ATTN_TOL)


@pytest.mark.parametrize("routing", ["decode", "unified"])
def test_backend_verification_replayed_from_cuda_graph(
    routing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capture one verification step (16 requests x 5 token rows) as the runner does
    (all padding at capture, split count fixed), then replay it on new contexts and
    query lengths 1..5 written into the same buffers: same cache bytes, outputs as the
    reference, padding rows zeroed; both routings."""
    monkeypatch.setattr(triton_backend, "VERIFY_ATTENTION", routing)
    num_reqs, q, max_blocks = 16, 5, 4096 // BLOCK_SIZE + 1
    num_tokens = num_reqs * q
    num_blocks = num_reqs * max_blocks + 2

    def new_case() -> AttentionCase:
        q_lens = [_randint(1, q) for _ in range(num_reqs)]
        seq_lens = [_randint(ql, 4096) for ql in q_lens]
        return make_attention_case(
            q_lens, seq_lens, num_q_heads=4 * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device=CUDA,
            num_blocks=num_blocks, max_blocks_per_req=max_blocks,
            num_padding_tokens=num_tokens - sum(q_lens), fill_new_tokens=False,
        )

    static = new_case()
    # As DecodeCudaGraphs captures: the host-side token count is 0 (all padding), so
    # the backend zeroes the whole output on every replay.
    meta = dataclasses.replace(_metadata(static, q), max_seq_len=4096,
                               query_start_loc_cpu=torch.zeros(num_reqs + 1, dtype=torch.int32))
    backend = TritonAttentionBackend(num_kv_splits=4)
    args = (static.query, static.key, static.value, static.kv_cache, meta, static.scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(*args)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args)

    for _ in range(2):
        case = new_case()
        for name in ("query", "key", "value", "kv_cache", "query_start_loc", "seq_lens",
                     "block_tables", "slot_mapping"):
            getattr(static, name).copy_(getattr(case, name))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        flat = case.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
        real = case.slot_mapping >= 0
        flat[0, case.slot_mapping[real]] = case.key[real]
        flat[1, case.slot_mapping[real]] = case.value[real]
        torch.testing.assert_close(static.kv_cache, case.kv_cache, rtol=0, atol=0, equal_nan=True)
        num_real = sum(case.q_lens)
        assert_close(out[:num_real], ref_paged_attention(case), **BF16_ATTN_TOL)
        assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))
