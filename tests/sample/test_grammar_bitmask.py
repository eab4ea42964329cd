"""The structured-output bitmask on the logits: exact against a per-token loop."""

from __future__ import annotations

import random

import pytest
import torch

from flowengine.sample.grammar_bitmask import (
    apply_plan_bitmask,
    apply_token_bitmask,
    bitmask_to_device,
)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for k, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[k, t // 32]) & 0xFFFFFFFF if t // 32 < bitmask.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab_size", [64, 100, 130])
def test_apply_token_bitmask_matches_reference(vocab_size):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    logits = torch.randn(6, vocab_size, generator=gen)
    num_words = (vocab_size + 31) // 32 - (1 if vocab_size == 130 else 0)  # 130: mask too short
    bitmask = torch.randint(-(1 << 31), 1 << 31, (3, num_words), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    rows = [4, 0, 2]
    expected = _reference(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert torch.equal(logits[[1, 3, 5]], expected[[1, 3, 5]])  # other rows untouched


def test_apply_plan_bitmask_maps_request_ids_to_rows():
    vocab_size = 70
    logits = torch.zeros(3, vocab_size)
    words = torch.zeros(2, 3, dtype=torch.int32)
    words[0, 0] = 1 << 5  # "b" allows token 5 only
    words[1, 2] = 1 << 1  # "z" allows token 65 only; z does not sample in this step
    apply_plan_bitmask(logits, ["a", "b", "c"], ["b", "z"], words.numpy().tobytes())
    assert torch.equal(logits[0], torch.zeros(vocab_size))
    assert torch.equal(logits[2], torch.zeros(vocab_size))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5]
    before = logits.clone()
    apply_plan_bitmask(logits, ["a"], [], b"")  # no constrained rows: a no-op
    assert torch.equal(logits, before)


def test_bitmask_bytes_must_split_into_rows():
    with pytest.raises(ValueError, match="does not split into 3 rows"):
        bitmask_to_device(bytes(8), 3, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the C loop; numpy
@pytest.mark.parametrize("vocab_size", [64, 100, 130, 49152])
def test_apply_plan_bitmask_on_host_matches_reference(dtype, vocab_size):
    # CPU logits: float32 through flowengine._cpu_ops.apply_token_bitmask, other float
    # dtypes through numpy; random words (all-zero and all-one words included), a mask
    # shorter than the vocabulary (130), rows out of order, one id not sampling.
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    num_words = (vocab_size + 31) // 32 - (1 if vocab_size == 130 else 0)
    words = torch.randint(-(1 << 31), 1 << 31, (3, num_words), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    words[0, 0], words[1, -1] = 0, -1
    logits = torch.randn(4, vocab_size, generator=gen, dtype=dtype)
    expected = _reference(logits, words[[2, 0]], [1, 3]) if vocab_size < 1000 else None
    before = logits.clone()
    apply_plan_bitmask(logits, ["a", "c", "x", "b"], ["b", "y", "c"], words.numpy().tobytes())
    bits = ((words.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)
    allowed = torch.zeros(3, vocab_size, dtype=torch.bool)
    n = min(vocab_size, bits.shape[1])
    allowed[:, :n] = bits[:, :n].bool()
    for k, r in ((0, 3), (2, 1)):  # "b" -> row 3, "c" -> row 1; "y" does not sample
        assert torch.equal(torch.isinf(logits[r]), ~allowed[k])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # rows without a constraint
    finite = torch.isfinite(logits)
    assert torch.equal(logits[finite], before[finite])  # allowed logits untouched
    if expected is not None:  # the per-token loop (small vocabularies)
        assert torch.equal(logits, expected)


def test_c_bitmask_rejects_rows_out_of_range():
    ops = pytest.importorskip("flowengine._cpu_ops")
    import numpy as np

    logits = torch.zeros(2, 64)
    words = np.zeros((1, 2), dtype=np.int32)
    for pair in ((0, 2), (1, 0), (-1, 0)):  # logits row past 2; bitmask row past 1
        table = np.asarray([pair], dtype=np.int64)
        with pytest.raises(IndexError, match="out of range"):
            ops.apply_token_bitmask(logits.data_ptr(), 2, 1, 64, 64, words.ctypes.data, 2,
                                    table.ctypes.data, 1)
    assert torch.equal(logits, torch.zeros(2, 64))  # nothing written
