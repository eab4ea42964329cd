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
    assert (inputs.input_ids.dtype == inputs.positions.dtype == meta.slot_mapping.dtype
            == torch.int64)
    assert (meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype
            == torch.int32)

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


def _tables(batch: InputBatch, states: list[RequestState], num_scheduled: list[int],
            **pad: int) -> list[list[int]]:
    return batch.prepare(states, num_scheduled, **pad).attn_metadata.block_tables.tolist()


def test_persistent_block_tables_across_steps() -> None:
    """Each request keeps its row of the persistent tables between steps; a step shows
    exactly its requests' block ids, in batch order, zeros elsewhere."""
    batch = InputBatch(block_size=2, max_blocks_per_req=4, device=torch.device("cpu"),
                       max_num_tokens=16, max_num_reqs=2)
    a = _state("a", [1, 2, 3], [4, 7], computed=0)
    b = _state("b", [5, 6], [9], computed=0)
    # Step 1: two prompts (a's table has one block more than its tokens need).
    assert _tables(batch, [a, b], [3, 2]) == [[4, 7], [9, 0]]
    row_a, row_b = a.table_row, b.table_row
    assert row_a != row_b
    a.num_computed_tokens, b.num_computed_tokens = 3, 2
    # Step 2: decodes, b first; b gains a block, a keeps its own.
    a.token_ids.append(8)
    b.token_ids.append(3)
    b.block_ids.append(2)
    inputs = batch.prepare([b, a], [1, 1])
    assert inputs.attn_metadata.block_tables.tolist() == [[9, 2], [4, 7]]
    assert inputs.attn_metadata.slot_mapping.tolist() == [2 * 2 + 0, 7 * 2 + 1]
    assert (a.table_row, b.table_row) == (row_a, row_b)
    # Step 3: a chunked-prefill request joins (more requests than the tables had rows:
    # they grow) beside a's and b's decodes (a gains a block); its second chunk then
    # adds two blocks.
    a.num_computed_tokens, b.num_computed_tokens = 4, 3
    a.token_ids.append(9)
    a.block_ids.append(5)
    b.token_ids.append(4)
    c = _state("c", list(range(20, 27)), [11, 12], computed=0)
    assert _tables(batch, [a, b, c], [1, 1, 4], pad_to=8) == [
        [4, 7, 5, 0], [9, 2, 0, 0], [11, 12, 0, 0], *[[0] * 4] * 5]
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 5, 4, 4
    c.block_ids.extend([13, 14])
    assert _tables(batch, [c], [3]) == [[11, 12, 13, 14]]
    # Step 4: a padded step after wider ones: no stale ids anywhere.
    a.token_ids.append(10)
    assert _tables(batch, [a], [1], pad_to=4) == [[4, 7, 5, 0], *[[0] * 4] * 3]


def test_block_table_rows_follow_edits_and_preemption() -> None:
    """Rows are rewritten after edits other than appends (speculative decoding's
    rollback, assignment, a plain list), and a resumed request (a new state of the same
    id) gets its new blocks; a dead request's row is reused without its old ids."""
    batch = InputBatch(block_size=2, max_blocks_per_req=4, device=torch.device("cpu"),
                       max_num_tokens=16, max_num_reqs=4)
    a = _state("a", list(range(8)), [1, 2, 3, 4], computed=5)
    assert _tables(batch, [a], [2]) == [[1, 2, 3, 4]]
    # Rollback then regrowth to the same length, with other ids.
    del a.block_ids[2:]
    a.block_ids.extend([5, 6])
    assert _tables(batch, [a], [2]) == [[1, 2, 5, 6]]
    a.block_ids[0] = 9
    assert _tables(batch, [a], [2]) == [[9, 2, 5, 6]]
    # Padded steps show the whole width: the dropped id is gone from the row.
    del a.block_ids[3]
    assert _tables(batch, [a], [1], pad_to=1) == [[9, 2, 5, 0]]
    a.block_ids = [7, 8, 1]  # a plain list: rewritten every step
    assert _tables(batch, [a], [1], pad_to=1) == [[7, 8, 1, 0]]
    a.block_ids.append(3)
    assert _tables(batch, [a], [1], pad_to=1) == [[7, 8, 1, 3]]
    # Preemption: the request comes back as a new state, recomputed from token 0.
    resumed = _state("a", list(range(8)), [6], computed=0)
    assert _tables(batch, [resumed], [2], pad_to=2) == [[6, 0, 0, 0], [0, 0, 0, 0]]
    assert resumed.table_row != a.table_row
    # Once a state is gone its row is free again, and a new request there sees zeros
    # past its own blocks.
    row = a.table_row
    del a
    import gc
    gc.collect()
    rows_seen = set()
    for i in range(4):
        s = _state(f"n{i}", [1, 2], [10 + i], computed=0)
        assert _tables(batch, [s], [2], pad_to=2) == [[10 + i, 0, 0, 0], [0, 0, 0, 0]]
        rows_seen.add(s.table_row)
        del s
    assert row in rows_seen


def test_block_ids_record_edits_but_not_appends() -> None:
    from flowengine.executor.block_tables import BlockIds

    ids = BlockIds([1, 2])
    stamp = ids.edit_stamp
    ids.append(3)
    ids.extend([4])
    ids += [5]
    assert ids == [1, 2, 3, 4, 5] and ids.edit_stamp == stamp
    edits = [lambda: ids.__setitem__(0, 7), lambda: ids.__delitem__(slice(3, None)),
             lambda: ids.insert(0, 8), ids.pop, lambda: ids.remove(8), ids.reverse,
             ids.sort, ids.clear, lambda: ids.__imul__(2)]
    for edit in edits:
        before = ids.edit_stamp
        edit()
        assert ids.edit_stamp != before
    assert BlockIds([1]).edit_stamp != BlockIds([1]).edit_stamp


def test_block_tables_with_two_host_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on CUDA: two host buffers filled in turn, each copied to the device buffer.
    Each buffer is cleared of what its own previous step left, not the other's."""
    import functools

    from flowengine.executor import input_batch

    monkeypatch.setattr(input_batch, "StagingBuffers",
                        functools.partial(input_batch.StagingBuffers, num_host=2))
    batch = InputBatch(block_size=2, max_blocks_per_req=3, device=torch.device("cpu"),
                       max_num_tokens=8, max_num_reqs=4)
    assert batch.buffers.num_host == 2
    a = _state("a", list(range(6)), [1, 2, 3], computed=0)
    b = _state("b", [1, 2, 3], [4, 5], computed=0)
    c = _state("c", [1], [6], computed=0)
    want = {  # step -> (states, scheduled, padded block tables)
        0: ([a, b], [6, 3], [[1, 2, 3], [4, 5, 0], *[[0] * 3] * 7]),
        1: ([c], [1], [[6, 0, 0]]),
        2: ([c], [1], [[6, 0, 0], [0, 0, 0]]),
        3: ([b], [2], [[4, 5, 0], [0, 0, 0]]),
        4: ([a, c], [2, 1], [[1, 2, 3], [6, 0, 0], [0, 0, 0]]),
        5: ([c], [1], [[6, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]),
    }
    for step, (states, num, tables) in want.items():
        got = _tables(batch, states, num, pad_to=len(tables))
        assert got == tables, step
        assert batch.buffers.turn == (step + 1) % 2


def test_states_sharing_one_block_ids_list() -> None:
    """What a row holds is tracked per state: two states of one BlockIds (e.g. a
    dataclasses.replace copy) both follow its appends and edits."""
    import dataclasses

    batch = InputBatch(block_size=2, max_blocks_per_req=3, device=torch.device("cpu"))
    a = _state("a", list(range(6)), [1, 2], computed=0)
    b = dataclasses.replace(a, req_id="b")
    assert b.block_ids is a.block_ids
    assert _tables(batch, [a, b], [4, 4]) == [[1, 2], [1, 2]]
    a.block_ids.append(3)
    assert _tables(batch, [a], [6]) == [[1, 2, 3]]
    assert _tables(batch, [b], [6]) == [[1, 2, 3]]
    a.block_ids[1] = 5
    assert _tables(batch, [b, a], [6, 6]) == [[1, 5, 3], [1, 5, 3]]
