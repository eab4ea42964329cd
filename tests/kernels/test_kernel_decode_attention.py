"""Split-KV decode attention against the float64 reference (kernel_refs.py): decode
steps and verification steps (several new tokens per request)."""

from __future__ import annotations

import pytest
import torch
from kernel_refs import assert_close, make_attention_case, ref_paged_attention

from flowengine.kernels.decode_attention import (
    MAX_KV_SPLITS,
    MAX_PACKED_ROWS,
    MAX_QUERY_LEN,
    DecodeLaunchConfig,
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
    cpu = torch.device("cpu")  # 8 "SMs" assumed: 4 x 8 = 32 programs wanted
    assert choose_num_kv_splits(1, 1, 100_000, cpu) == 32
    assert choose_num_kv_splits(1, 2, 100_000, cpu) == 16
    assert choose_num_kv_splits(3, 1, 100_000, cpu) == 8  # 11 wanted, rounded down
    assert choose_num_kv_splits(1, 1, 600, cpu) == 8  # ranges of >= 64 tokens: 10 -> 8
    assert choose_num_kv_splits(1, 1, 100, cpu) == 2
    assert choose_num_kv_splits(64, 8, 100_000, cpu) == 1  # enough programs already
    assert choose_num_kv_splits(2, 8, 100_000, cpu) == 1  # 16 = 2 per SM: no split
    assert choose_num_kv_splits(1, 8, 100_000, cpu) == 4
    assert choose_num_kv_splits(1, 1, 1, cpu) == 1
    assert MAX_KV_SPLITS == 64


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


# GQA ratios 1-8 and head_dim 64 / 128 with every stage-1 tile shape, one split (stage 1
# writes the output, no merge launch) and many (more splits than tiles in the longest
# context: most ranges empty).
@pytest.mark.parametrize(
    ("qpk", "head_dim", "num_kv_splits", "tile_n"),
    [(1, 128, 1, 16), (2, 64, 16, 64), (4, 128, 16, 32), (8, 64, 1, 64), (8, 128, 8, 16)],
)
def test_gqa_head_dims_and_launch_configs(
    qpk: int, head_dim: int, num_kv_splits: int, tile_n: int, device: torch.device
) -> None:
    seq_lens = [int(torch.randint(100, 200, ()).item()), 1, 33]
    case = make_attention_case(
        [1] * 3, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim,
        block_size=16, dtype=torch.float32, device=device,
    )
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=max(seq_lens), scale=case.scale, num_kv_splits=num_kv_splits, out=out,
        launch_config=DecodeLaunchConfig(tile_n=tile_n, num_warps=4, num_stages=1),
    )
    assert_close(out, ref_paged_attention(case), **FP32_TOL)


def test_single_split_skips_padding_request(device: torch.device) -> None:
    """num_kv_splits=1 writes from stage 1: an empty request (CUDA-graph padding) must
    still write nothing."""
    case = make_attention_case(
        [1, 1], [70, 9], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float16, num_padding_tokens=1, device=device,
    )
    qsl = torch.cat([case.query_start_loc, case.query_start_loc[-1:]])
    seq_lens = torch.cat([case.seq_lens, torch.tensor([5], dtype=torch.int32, device=device)])
    block_tables = torch.cat([case.block_tables, case.block_tables[:1]])
    out = torch.full_like(case.query, float("nan"))
    decode_attention(case.query, case.kv_cache, qsl, seq_lens, block_tables, max_seq_len=70,
                     scale=case.scale, num_kv_splits=1, out=out)
    assert_close(out[:2], ref_paged_attention(case), **FP16_TOL)
    assert out[2:].isnan().all(), "the padding row must be left untouched"


def test_rejects_bad_tile(device: torch.device) -> None:
    case = make_attention_case(
        [1], [4], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, device=device,
    )
    with pytest.raises(ValueError, match="tile_n"):
        decode_attention(
            case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
            case.block_tables, max_seq_len=4, scale=1.0,
            launch_config=DecodeLaunchConfig(tile_n=24),
        )


# Verification steps (speculative decoding, issue 16): max_query_len > 1 packs each
# request's new tokens x QPK heads into one tile with per-row causal limits. Requests
# with fewer tokens than the maximum (a proposer that found fewer drafts), a token
# alone, an empty padding request and padding tokens: their rows stay untouched.
@pytest.mark.parametrize(
    ("qpk", "max_q", "num_kv_splits", "window", "soft_cap"),
    [(4, 5, 4, None, None), (1, 2, 1, None, None), (2, 5, 8, 30, 2.0), (3, 8, 2, None, None),
     (8, 8, 16, 100, None)],
)
def test_verification_tokens_match_reference(
    qpk: int, max_q: int, num_kv_splits: int, window: int | None, soft_cap: float | None,
    device: torch.device,
) -> None:
    q_lens = [max_q, max(1, max_q - 2), 1, max_q]
    seq_lens = [int(torch.randint(150, 260, ()).item()), 7 + max_q, 41, max_q]
    case = make_attention_case(
        q_lens, seq_lens, num_q_heads=2 * qpk, num_kv_heads=2, head_dim=32,
        block_size=16, dtype=torch.float32, num_padding_tokens=3, device=device,
    )
    # Append an empty request (CUDA-graph padding): query_start_loc repeats its end.
    qsl = torch.cat([case.query_start_loc, case.query_start_loc[-1:]])
    seq_lens_t = torch.cat([case.seq_lens, torch.tensor([9], dtype=torch.int32, device=device)])
    block_tables = torch.cat([case.block_tables, case.block_tables[:1]])
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, qsl, seq_lens_t, block_tables,
        max_seq_len=max(seq_lens), scale=case.scale, num_kv_splits=num_kv_splits, out=out,
        sliding_window=window, logits_soft_cap=soft_cap, max_query_len=max_q,
    )
    num_real = sum(q_lens)
    expected = ref_paged_attention(case, sliding_window=window, soft_cap=soft_cap)
    assert_close(out[:num_real], expected, **FP32_TOL)
    assert out[num_real:].isnan().all(), "padding rows must be left untouched"
    if window is not None or soft_cap is not None:  # the options did change the result
        assert not torch.allclose(expected, ref_paged_attention(case), atol=1e-3)


def test_verification_fp16_default_splits(device: torch.device) -> None:
    """A 16-bit verification batch with the default split count (Llama-3 GQA ratio)."""
    case = make_attention_case(
        [5, 5, 5], [300, 45, 120], num_q_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=torch.float16, device=device,
    )
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=300, scale=case.scale, out=out, max_query_len=5,
    )
    assert_close(out, ref_paged_attention(case), **FP16_TOL)


def test_rejects_bad_max_query_len(device: torch.device) -> None:
    case = make_attention_case(
        [1], [4], num_q_heads=16, num_kv_heads=1, head_dim=32, block_size=16,
        dtype=torch.float32, device=device,
    )
    for bad in (0, MAX_QUERY_LEN + 1, MAX_PACKED_ROWS // 16 + 1):  # the last: 5 x 16 rows
        with pytest.raises(ValueError, match="max_query_len"):
            decode_attention(
                case.query, case.kv_cache, case.query_start_loc, case.seq_lens,
                case.block_tables, max_seq_len=4, scale=1.0, max_query_len=bad,
            )
