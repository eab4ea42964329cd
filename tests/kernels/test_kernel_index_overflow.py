"""32-bit index overflow: block ids whose offset block_id * block_stride exceeds 2**31.

The interpreter wraps int32 arithmetic like the GPU does, so a missing `.to(tl.int64)`
shows here as an access far outside the cache. The pool is ~8.6 GB of *virtual*
memory: torch.empty leaves pages unmapped until touched, and only the few blocks in
use are touched (about 1 MB resident). Each check runs in a child process, because a
regression dereferences a wild pointer: the child's crash fails the test instead of
killing the whole pytest run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_refs import AttentionCase, assert_close, make_attention_case, ref_paged_attention

from flowengine.kernels.decode_attention import decode_attention
from flowengine.kernels.paged_attention import paged_attention
from flowengine.kernels.reshape_and_cache import reshape_and_cache

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 1, 32
BLOCK_STRIDE = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM  # elements per block
FIRST_BLOCK = 2**31 // BLOCK_STRIDE  # every block id used is at or past 2**31 elements
FP16_TOL = {"rtol": 1e-2, "atol": 3e-3}
SKIP_EXIT_CODE = 77  # the child could not reserve the virtual pool


def _huge_case(q_lens: list[int], seq_lens: list[int]) -> AttentionCase:
    try:
        case = make_attention_case(
            q_lens, seq_lens, num_q_heads=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE, dtype=torch.float16, num_blocks=FIRST_BLOCK + 64,
            min_block_id=FIRST_BLOCK, poison_unused_blocks=False, fill_new_tokens=False,
        )
    except (RuntimeError, MemoryError) as exc:  # overcommit disabled (vm.overcommit_memory=2)
        print(f"cannot reserve an 8.6 GB virtual pool: {exc}")
        sys.exit(SKIP_EXIT_CODE)
    assert int(case.block_tables.min()) * BLOCK_STRIDE >= 2**31
    reshape_and_cache(case.key, case.value, case.kv_cache, case.slot_mapping)
    flat = case.kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[0, case.slot_mapping], case.key)
    assert torch.equal(flat[1, case.slot_mapping], case.value)
    return case


def check_paged_attention() -> None:
    case = _huge_case([1, 20, 5], [70, 20, 120])
    out = torch.full_like(case.query, float("nan"))
    paged_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_query_len=20, scale=case.scale, out=out,
    )
    assert_close(out, ref_paged_attention(case), **FP16_TOL)


def check_decode_attention() -> None:
    case = _huge_case([1, 1], [300, 41])
    out = torch.full_like(case.query, float("nan"))
    decode_attention(
        case.query, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables,
        max_seq_len=300, scale=case.scale, num_kv_splits=4, out=out,
    )
    assert_close(out, ref_paged_attention(case), **FP16_TOL)


def test_kernels_past_int32_offsets(random_seed: int) -> None:
    here = Path(__file__).parent
    code = (
        f"import sys, torch; sys.path.insert(0, {str(here)!r}); torch.manual_seed({random_seed})\n"
        "import test_kernel_index_overflow as t; t.check_paged_attention(); "
        "t.check_decode_attention()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        # CPU tensors in the child, so the interpreter even on a GPU machine (the
        # full-size device check is tests/gpu/test_kernels_gpu.py).
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    if proc.returncode == SKIP_EXIT_CODE:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (negative = killed by that signal, e.g. -11 for a wild "
        f"int32 offset):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
