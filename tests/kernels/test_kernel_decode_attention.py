"""Split-KV decode attention against the float64 reference (kernel_refs.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import assert_close, make_attention_case, ref_paged_attention

from flowengine.kernels.decode_attention import (
    MAX_KV_SPLITS,
    choose_num_kv_splits,
    decode_attention,
)

FP32_TOL = {"rtol": 1e-4, "atol": 2e-5}
FP16_TOL = {"rtol": 1e-2, "atol": 3e-3}


@pytest.mark.parametrize(
    ("qpk", "block_size", "num_kv_splits"),
    [(1, 16, 4), (4, 32, 2), (8, 16, 8), (3, 32, 1)],
)
def test_matches_reference(
    qpk: int, block_size: int, num_kv_splits: int, device: torch.device
) -> None:
    # One context long enough for every split, one shorter than a tile (most splits
    # empty), one exactly a block, one token alone.
    seq_lens = [int(torch.randint(150, 260, ()).item()), 7, block_size, 1]
    case = make_attention_case(
        [1] * 4, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=block_size, dtype=torch.float32, device=device,
    )
    out = torch.full_like(case.query, float("nan"))
    result = decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=max(seq_lens), scale=case.scale, num_kv_splits=num_kv_splits, out=out,
    )
    assert result is out
    assert_close(out, ref_paged_attention(case), **FP32_TOL)


def test_fp16_empty_padding_request_and_default_splits(device: torch.device) -> None:
    """A request with no new token (CUDA-graph padding) writes nothing; the default
    split count is used."""
    case = make_attention_case(
        [1, 1, 1], [300, 45, 120], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float16, num_padding_tokens=2, device=device,
    )
    # Append an empty request: query_start_loc repeats its last value.
    qsl = torch.cat([case.query_start_loc, case.query_start_loc[-1:]])
    seq_lens = torch.cat([case.seq_lens, torch.tensor([5], dtype=torch.int32, device=device)])
    block_tables = torch.cat([case.block_tables, case.block_tables[:1]])
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, qsl, seq_lens, block_tables, max_seq_len=300,
        scale=case.scale, out=out,
    )
    assert_close(out[:3], ref_paged_attention(case), **FP16_TOL)
    assert out[3:].isnan().all(), "padding rows must be left untouched"


def test_choose_num_kv_splits() -> None:
    cpu = torch.device("cpu")  # 8 "SMs" assumed: 16 programs wanted
    assert choose_num_kv_splits(1, 1, 100_000, cpu) == 16
    assert choose_num_kv_splits(1, 2, 100_000, cpu) == 8
    assert choose_num_kv_splits(1, 1, 600, cpu) == 2  # >= 256 tokens per range
    assert choose_num_kv_splits(64, 8, 100_000, cpu) == 1  # enough programs already
    assert choose_num_kv_splits(1, 1, 1, cpu) == 1
    assert MAX_KV_SPLITS >= 16


def test_rejects_bad_split_count(device: torch.device) -> None:
    case = make_attention_case(
        [1], [4], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, device=device,
    )
    with pytest.raises(ValueError, match="power of 2"):
        decode_attention(
            case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
            case.block_tables, max_seq_len=4, scale=1.0, num_kv_splits=3,
        )


@pytest.mark.parametrize(
    ("qpk", "num_kv_splits", "window", "soft_cap"),
    [(1, 4, 40, None), (4, 2, 100, 2.0), (2, 8, None, 1.5), (8, 1, 16, None)],
)
def test_sliding_window_and_soft_cap_match_reference(
    qpk: int, num_kv_splits: int, window: int | None, soft_cap: float | None,
    device: torch.device,
) -> None:
    # Contexts longer and shorter than the window; the splits divide the window.
    seq_lens = [int(torch.randint(150, 260, ()).item()), 7, 41, 1]
    case = make_attention_case(
        [1] * 4, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, device=device,
    )
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=max(seq_lens), scale=case.scale, num_kv_splits=num_kv_splits, out=out,
        sliding_window=window, logits_soft_cap=soft_cap,
    )
    expected = ref_paged_attention(case, sliding_window=window, soft_cap=soft_cap)
    assert_close(out, expected, **FP32_TOL)
    assert not torch.allclose(expected, ref_paged_attention(case), atol=1e-3)
