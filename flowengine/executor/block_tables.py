"""Persistent block tables: each live request's KV block ids in a host row of its own.

vLLM's persistent batch (`vllm/v1/worker/block_table.py`): the executor keeps every
request's block table between steps, so a step writes only what changed since the
request's previous step, usually nothing (a decode step gains a block once every
block_size tokens), and gathers the rows of its requests into the staging buffer
(staging_buffer.py) with one numpy call, instead of converting every block id of the
batch from Python each step. A request's `BlockIds` list tells appends (the common
change: the tail is written) from other edits (speculative decoding's rollback, an
assignment: the row is rewritten).

The row of a request and what it holds are kept on its `RequestState`
(input_batch.py: table_owner, table_row, table_ids, table_stamp, table_num_blocks);
`InputBatch.prepare` compares them with the state's block_ids and calls `stage` when
they differ. A row is freed when its RequestState is garbage-collected.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flowengine.executor.input_batch import RequestState

# Stamps of BlockIds changes other than appends; globally unique, so a stamp also tells
# one list from another.
_edit_stamps = itertools.count(1)


class BlockIds(list):
    """A request's block table: a list of KV block ids that records edits other than
    appends (`append`, `extend`, `+=` stay the plain list's, at C speed).

    `edit_stamp` changes on every other mutation (deletion, assignment, insertion,
    removal, reordering), so `InputBatch` rewrites the request's persistent row in full
    after one and only the appended tail otherwise.
    """

    __slots__ = ("edit_stamp",)

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.edit_stamp = next(_edit_stamps)

    def _edited(self) -> None:
        self.edit_stamp = next(_edit_stamps)

    def __setitem__(self, index, value) -> None:  # type: ignore[no-untyped-def]
        super().__setitem__(index, value)
        self._edited()

    def __delitem__(self, index) -> None:  # type: ignore[no-untyped-def]
        super().__delitem__(index)
        self._edited()

    def __imul__(self, count):  # type: ignore[no-untyped-def]
        self._edited()
        return super().__imul__(count)

    def insert(self, index, value) -> None:  # type: ignore[no-untyped-def]
        super().insert(index, value)
        self._edited()

    def pop(self, index=-1):  # type: ignore[no-untyped-def]
        self._edited()
        return super().pop(index)

    def remove(self, value) -> None:  # type: ignore[no-untyped-def]
        super().remove(value)
        self._edited()

    def clear(self) -> None:
        super().clear()
        self._edited()

    def sort(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().sort(*args, **kwargs)
        self._edited()

    def reverse(self) -> None:
        super().reverse()
        self._edited()


class PersistentBlockTables:
    """Block-table rows of live requests, [num_rows, max_blocks_per_req] int32 on the
    host, zero past each request's blocks.

    Args:
        max_blocks_per_req: the row width (ceil(max_model_len / block_size)).
        num_rows: initial number of rows; more are allocated (doubling) when a new
            request finds none free.
    """

    def __init__(self, max_blocks_per_req: int, num_rows: int) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self._tables = np.zeros((max(num_rows, 1), max_blocks_per_req), dtype=np.int32)
        self._lens = np.zeros(max(num_rows, 1), dtype=np.int64)  # block ids held per row
        self._free_rows = list(range(self._tables.shape[0] - 1, -1, -1))
        self._extents: list[tuple[int, int]] = [(0, 0)]

    @property
    def num_rows(self) -> int:
        return self._tables.shape[0]

    def track_regions(self, num_regions: int) -> None:
        """Start tracking `num_regions` fresh (all-zero) staging regions that `gather`
        fills in turn (one per host buffer of the staging buffers)."""
        # Per region: the (rows, columns) that may be nonzero (the rest is zero), so a
        # step zeroes only what its own rows do not cover.
        self._extents = [(0, 0)] * num_regions

    def stage(self, state: RequestState) -> None:
        """Bring the request's row up to its block_ids: the appended ids only, or the
        whole row (after an edit, for a plain list, or on the request's first step
        here, which also takes a free row). The caller checked that the ids fit a row."""
        ids = state.block_ids
        if state.table_owner is not self:
            if not self._free_rows:
                self._grow()
            state.table_owner, state.table_row = self, self._free_rows.pop()
            state.table_ids, state.table_num_blocks = None, 0
            # The row returns to the free list with the state (rows are never shared).
            weakref.finalize(state, self._free_rows.append, state.table_row).atexit = False
        row = state.table_row
        kept = state.table_num_blocks
        if state.table_ids is not ids or ids.edit_stamp != state.table_stamp:
            kept = 0
        num_blocks = len(ids)
        table = self._tables[row]
        if kept < num_blocks:
            table[kept:num_blocks] = ids[kept:]
        old = int(self._lens[row])
        if old > num_blocks:
            table[num_blocks:old] = 0
        self._lens[row] = num_blocks
        state.table_num_blocks = num_blocks
        if type(ids) is BlockIds:
            state.table_ids, state.table_stamp = ids, ids.edit_stamp
        else:  # a plain list records no edits: rewritten every step
            state.table_ids = None

    def gather(self, region: np.ndarray, table_rows: list[int], rows: int,
               turn: int = 0) -> np.ndarray:
        """The step's [rows, max_blocks_per_req] int32 block tables, in the flat staging
        `region` number `turn` (see track_regions): row i is the persistent row
        table_rows[i], rows past len(table_rows) (padding) and columns past a request's
        blocks are zero. Writes only the columns some request uses, and zeroes only
        what this region's previous step left nonzero outside them."""
        width = self.max_blocks_per_req
        num_reqs = len(table_rows)
        block_tables = region[:rows * width].reshape(rows, width)
        num_cols = 0
        if num_reqs:
            index = np.asarray(table_rows, dtype=np.int64)
            num_cols = int(self._lens[index].max())
            block_tables[:num_reqs, :num_cols] = self._tables[index, :num_cols]
        old_rows, old_cols = self._extents[turn]
        full = region[:max(old_rows, rows) * width].reshape(-1, width)
        if old_cols > num_cols:
            full[:num_reqs, num_cols:old_cols] = 0
        if old_rows > num_reqs:
            full[num_reqs:old_rows, :old_cols] = 0
        self._extents[turn] = (num_reqs, num_cols)
        return block_tables

    def _grow(self) -> None:
        old = self._tables.shape[0]
        tables = np.zeros((2 * old, self.max_blocks_per_req), dtype=np.int32)
        tables[:old] = self._tables
        lens = np.zeros(2 * old, dtype=np.int64)
        lens[:old] = self._lens
        self._tables, self._lens = tables, lens
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
