"""InputBatch flattening: exact token ids, positions, slots, block tables, logits rows."""

from __future__ import annotations

import pytest
import torch

from flowengine.executor.input_batch import InputBatch, RequestState
from flowengine.sampling_params import SamplingParams


def _state(req_id: str, tokens: list[int], blocks: list[int], computed: int) -> RequestState:
    return RequestState(req_id, tokens, len(tokens), SamplingParams(), None, blocks, computed)


def test_mixed_step_is_flattened_exactly() -> None:
    # Capacity below the step: the buffers grow.
    batch = InputBatch(block_size=4, max_blocks_per_req=8, device=torch.device("cpu"),
                       max_num_tokens=4, max_num_reqs=1)
    a = _state("a", list(range(10, 20)), [7, 2, 9], computed=6)  # last 4 tokens: samples
    b = _state("b", list(range(30, 35)), [5], computed=0)  # 3 of 5 prompt tokens: no sample
    inputs = batch.prepare([a, b], [4, 3])
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [16, 17, 18, 19, 30, 31, 32]
    assert inputs.positions.tolist() == [6, 7, 8, 9, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 2 * 4 + 3, 9 * 4, 9 * 4 + 1, 20, 21, 22]
    assert meta.query_start_loc.tolist() == [0, 4, 7]
    assert meta.query_start_loc_cpu.tolist() == [0, 4, 7]
    assert meta.seq_lens.tolist() == [10, 3] and meta.seq_lens_cpu.tolist() == [10, 3]
    assert meta.block_tables.tolist() == [[7, 2, 9], [5, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_reqs, meta.num_tokens) == (4, 10, 2, 7)
    assert inputs.logits_indices.tolist() == [3] and inputs.sample_req_ids == ["a"]
    assert inputs.input_ids.dtype == inputs.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32

    # Next step: b alone; the row it now occupies no longer shows a's blocks.
    b.block_ids.append(3)
    b.num_computed_tokens = 3
    inputs = batch.prepare([b], [2])
    assert inputs.input_ids.tolist() == [33, 34]
    assert inputs.attn_metadata.slot_mapping.tolist() == [23, 12]
    assert inputs.attn_metadata.block_tables.tolist() == [[5, 3]]
    assert inputs.logits_indices.tolist() == [1] and inputs.sample_req_ids == ["b"]


def test_inconsistent_requests_are_rejected() -> None:
    batch = InputBatch(block_size=4, max_blocks_per_req=8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 2 KV blocks for 5 tokens but has 1"):
        batch.prepare([_state("a", [1, 2, 3, 4, 5], [0], 0)], [5])
    with pytest.raises(ValueError, match="scheduled for tokens 2..4 but the executor holds 3"):
        batch.prepare([_state("a", [1, 2, 3], [0], 2)], [2])


def test_block_table_wider_than_max_model_len_is_rejected() -> None:
    batch = InputBatch(block_size=4, max_blocks_per_req=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="has 3 KV blocks, more than max_model_len allows"):
        batch.prepare([_state("a", [1, 2, 3], [0, 1, 2], 0)], [3])
