"""The host-side fast paths of a constrained step (CPU runner, one step at a time).

- `apply_plan_bitmask` on CPU logits (numpy unpack, -inf written by numpy; bfloat16
  logits take the tensor path) sets exactly the
  logits that the tensor path (`apply_token_bitmask`, the device path) sets, for every
  row mapping: all rows in order, a subset, a shuffled order, ids that do not sample,
  and masks shorter or longer than the vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from flowengine.sample.grammar_bitmask import apply_plan_bitmask, apply_token_bitmask


@pytest.mark.parametrize("vocab_size,num_words", [(64, 2), (100, 4), (130, 4), (96, 5)])
@pytest.mark.parametrize("mapping", ["in_order", "subset", "shuffled", "absent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_apply_equals_the_tensor_path(vocab_size, num_words, mapping, dtype):
    gen = torch.Generator().manual_seed(vocab_size * 7 + num_words)
    sample_ids = [f"s{i}" for i in range(5)]
    if mapping == "in_order":
        structured = list(sample_ids)
    elif mapping == "subset":
        structured = ["s1", "s3"]
    elif mapping == "shuffled":
        structured = ["s4", "s0", "s2"]
    else:  # "z" does not sample in this step: its row is skipped
        structured = ["s2", "z", "s0"]
    with torch.inference_mode():
        logits = torch.randn(len(sample_ids), vocab_size, generator=gen).to(dtype)
    words = torch.randint(-(1 << 31), 1 << 31, (len(structured), num_words), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    index = {rid: i for i, rid in enumerate(sample_ids)}
    pairs = [(k, index[rid]) for k, rid in enumerate(structured) if rid in index]
    apply_token_bitmask(expected, words[[k for k, _ in pairs]],
                        torch.tensor([r for _, r in pairs], dtype=torch.int64))
    apply_plan_bitmask(logits, sample_ids, structured, words.numpy().tobytes())
    assert torch.equal(logits, expected)
    assert torch.isinf(logits).any()  # the masks did disallow something


def test_cpu_apply_checks_the_byte_count():
    with torch.inference_mode():
        logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="does not split into 2 rows"):
        apply_plan_bitmask(logits, ["a", "b"], ["a", "b"], bytes(12))
