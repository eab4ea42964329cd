"""Per-request executor state and the flattened inputs of one step.

`InputBatch` fills persistent staging buffers (staging_buffer.py: pinned when the
device is CUDA) that hold every integer input of a step in one byte buffer: the token
ids, positions, slot mapping, logits indices, token slots, device-gather indices,
query start locations, sequence lengths and block tables. They are filled with
vectorized numpy (the host loop is over requests, never tokens) and reach the device
with a single copy.

Block tables persist between steps (vLLM's persistent batch, block_tables.py): each
request owns a row of a host table for its lifetime, a step writes only the block ids
added since the request's previous step, then gathers its rows into the staging buffer
with one numpy call.

Tokens sampled on the device but not yet known on the host (async overlap, DESIGN.md
§5) are placeholders in `RequestState.token_ids`; a step that computes one gets its
value on the device, from the runner's last-sampled-token tensor, through the
`gather_dst`/`gather_src` indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flowengine.executor.block_tables import BlockIds, PersistentBlockTables
from flowengine.executor.staging_buffer import Region, StagingBuffers
from flowengine.messages import TokenLogprobs
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.sample.metadata import SamplingState
from flowengine.sampling_params import SamplingParams

# Value held in RequestState.token_ids where the device knows a sampled token and the
# host does not yet.
PLACEHOLDER_TOKEN_ID = -1

@dataclass
class RequestState:
    """What the executor keeps about one request between steps.

    token_ids: prompt followed by every sampled token (the executor appends them);
    num_computed_tokens: tokens whose K/V are in the cache before the coming step;
    block_ids: the request's block table (KV block ids in order), stored as a
        `BlockIds` copy of the list given (assigning a plain list later works, but
        costs a full row write every step).
    placeholder_indices: indices of token_ids that hold PLACEHOLDER_TOKEN_ID, in order.
    token_slot: the request's row in the runner's last-sampled-token device tensor
        (-1: none; only runners that sample on the device assign one).
    prompt_logprobs: with `sampling_params.prompt_logprobs` set, the logprobs of prompt
        tokens 1.. collected so far (prefill chunk by chunk); None once delivered with
        the first sampled token (`take_prompt_logprobs`).
    num_draft_tokens: speculative decoding: the last num_draft_tokens of token_ids are
        this step's draft tokens, replaced by the verified ones after the step
        (`ModelRunner.apply_verified`).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    placeholder_indices: list[int] = field(default_factory=list)
    token_slot: int = -1
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_draft_tokens: int = 0
    # metadata.static_row of sampling_params, cached by SamplingMetadata.from_states.
    sampling_row: tuple | None = field(default=None, repr=False, compare=False)
    # Whether sampling reads the values of earlier tokens (reads_token_values).
    reads_token_values: bool = field(default=False, init=False, compare=False)
    # The request's row of PersistentBlockTables `table_owner` (block_tables.py) and
    # what it holds: block_ids[:table_num_blocks] of the BlockIds `table_ids` as of its
    # edit stamp `table_stamp`.
    table_owner: object = field(default=None, init=False, repr=False, compare=False)
    table_row: int = field(default=-1, init=False, repr=False, compare=False)
    table_ids: object = field(default=None, init=False, repr=False, compare=False)
    table_stamp: int = field(default=0, init=False, repr=False, compare=False)
    table_num_blocks: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.block_ids) is not BlockIds:
            # A copy: a plain list records no edits. (States may share one BlockIds:
            # what a row holds is tracked per state.)
            self.block_ids = BlockIds(self.block_ids)
        if self.sampling_params.prompt_logprobs is not None and self.num_computed_tokens == 0:
            self.prompt_logprobs = []
        self.reads_token_values = reads_token_values(self.sampling_params)

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs once all num_prompt_tokens - 1 are collected (then
        forgotten, so they are delivered once), else None."""
        lps = self.prompt_logprobs
        if lps is None or len(lps) < self.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs = None
        return lps

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    def sampling_state(self) -> SamplingState:
        """The sampler's view of this request. The prompt is copied only when the
        repetition penalty reads it (the sampler ignores it otherwise)."""
        params = self.sampling_params
        prompt = self.token_ids[:self.num_prompt_tokens] if params.repetition_penalty != 1.0 else []
        return SamplingState(params, prompt, self.output_token_ids, self.eos_token_id)


@dataclass
class StepInputs:
    """Device tensors of one step.

    input_ids, positions: [T] int64 (T includes padding tokens, if any).
    logits_indices: [R_s] int64 rows of the hidden states whose next-token distribution
    is needed, for the requests `sample_req_ids` (in batch order); sample_slots: [R_s]
    int64 their token slots. gather_dst / gather_src: [G] int64, input_ids[gather_dst]
    must be set to last_sampled[gather_src] on the device before the forward (None when
    G = 0). num_tokens / num_reqs: real (unpadded) counts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_req_ids: list[str]
    sample_slots: torch.Tensor
    gather_dst: torch.Tensor | None
    gather_src: torch.Tensor | None
    num_tokens: int
    num_reqs: int


def reads_token_values(params: SamplingParams) -> bool:
    """Whether sampling this request reads the values of its earlier tokens (the
    penalties and multi-token bad words do; min_tokens and per-request seeds only
    count them)."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or any(len(w) > 1 for w in params.bad_words_token_ids or ()))


_MAX_CACHED_VIEWS = 4096

_I64 = (np.int64, torch.int64)
_I32 = (np.int32, torch.int32)


class InputBatch:
    """Builds StepInputs from request states.

    Args:
        block_size: tokens per KV block.
        max_blocks_per_req: block-table width (ceil(max_model_len / block_size)).
        device: where the model runs.
        max_num_tokens, max_num_reqs: initial capacity; buffers grow when a step is
            larger (a reallocation, so size them from the scheduler limits).
        growable: False forbids growing (CUDA graphs read the buffers at fixed
            addresses); a larger step then raises ValueError.
    """

    def __init__(self, block_size: int, max_blocks_per_req: int, device: torch.device,
                 max_num_tokens: int = 2048, max_num_reqs: int = 256, *,
                 growable: bool = True) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.growable = growable
        self.block_tables = PersistentBlockTables(max_blocks_per_req, max_num_reqs)
        self._allocate(max_num_tokens, max_num_reqs)

    def _allocate(self, max_num_tokens: int, max_num_reqs: int) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        regions: dict[str, Region] = {
            "input_ids": (*_I64, max_num_tokens),
            "positions": (*_I64, max_num_tokens),
            "slot_mapping": (*_I64, max_num_tokens),
            "logits_indices": (*_I64, max_num_reqs),
            "sample_slots": (*_I64, max_num_reqs),
            "gather_dst": (*_I64, max_num_reqs),
            "gather_src": (*_I64, max_num_reqs),
            "query_start_loc": (*_I32, max_num_reqs + 1),
            "seq_lens": (*_I32, max_num_reqs),
            # Last: a step copies only the rows it uses.
            "block_tables": (*_I32, max_num_reqs * self.max_blocks_per_req),
        }
        self.buffers = StagingBuffers(regions, self.device)
        self.dev = dict(self.buffers.dev)
        self.dev["block_tables"] = self.dev["block_tables"].view(max_num_reqs, -1)
        self.block_tables.track_regions(self.buffers.num_host)  # zeroed regions
        # Tensor views of the buffers by (region, length[, columns]): slicing a tensor
        # costs more host time than a dict lookup, and the step sizes repeat.
        self._views: dict[tuple, torch.Tensor] = {}
        self._arange = np.arange(max(max_num_tokens, max_num_reqs), dtype=np.int64)

    @property
    def np(self) -> dict[str, np.ndarray]:
        """Numpy views of the host buffer of the latest step."""
        return self.buffers.np

    def prepare(self, states: list[RequestState], num_scheduled: list[int], *,
                pad_to: int | None = None, pad_reqs_to: int | None = None) -> StepInputs:
        """Flatten one step: request i computes tokens
        token_ids[num_computed_tokens : num_computed_tokens + num_scheduled[i]].

        pad_to: pad tokens and requests to this count (CUDA-graph batch sizes):
            padding requests are empty (seq_len 0), padding tokens belong to no request
            and have slot -1, and the block table keeps its full width.
        pad_reqs_to: with pad_to, pad the requests to this count instead (CUDA graphs of
            verification steps: pad_to tokens over pad_reqs_to requests).

        Raises ValueError when a request lacks the tokens or KV blocks it is scheduled
        for, when a placeholder other than a request's latest would be computed, or
        when the step exceeds a non-growable buffer.
        """
        num_reqs = len(states)
        num_tokens = sum(num_scheduled)
        rows, padded_tokens = num_reqs, num_tokens
        if pad_to is not None:
            if pad_to < max(num_reqs, num_tokens):
                raise ValueError(f"pad_to {pad_to} is below the step's {num_tokens} tokens "
                                 f"and {num_reqs} requests")
            rows = padded_tokens = pad_to
            if pad_reqs_to is not None:
                if pad_reqs_to < num_reqs:
                    raise ValueError(f"pad_reqs_to {pad_reqs_to} is below the step's "
                                     f"{num_reqs} requests")
                rows = pad_reqs_to
        if padded_tokens > self.max_num_tokens or rows > self.max_num_reqs:
            if not self.growable:
                raise ValueError(
                    f"step of {padded_tokens} tokens and {rows} requests exceeds the input "
                    f"buffers ({self.max_num_tokens} tokens, {self.max_num_reqs} requests); "
                    "the scheduler limits max_num_batched_tokens / max_num_seqs must not "
                    "exceed the runner's"
                )
            self._allocate(max(padded_tokens, self.max_num_tokens), max(rows, self.max_num_reqs))
        b = self.buffers.next_host()
        n_sched = np.asarray(num_scheduled, dtype=np.int64)
        n_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        qsl = b["query_start_loc"][:rows + 1]
        qsl[0] = 0
        np.cumsum(n_sched, out=qsl[1:num_reqs + 1])
        qsl[num_reqs + 1:] = num_tokens
        seq_lens = n_computed + n_sched
        b["seq_lens"][:num_reqs] = seq_lens
        b["seq_lens"][num_reqs:rows] = 0

        width = self.max_blocks_per_req
        # One pass over the requests in plain Python (list appends), then one numpy
        # write per buffer: a numpy call per request costs more than the request's work.
        bs = self.block_size
        step_ids: list[int] = []  # the tokens computed, in order
        table_rows: list[int] = []  # each request's row of the persistent block tables
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        sample_slots: list[int] = []
        gather_dst: list[int] = []
        gather_src: list[int] = []
        tables = self.block_tables
        end = 0
        for state, num in zip(states, num_scheduled, strict=True):
            start = end
            end += num
            first = state.num_computed_tokens
            last = first + num
            token_ids = state.token_ids
            block_ids = state.block_ids
            num_blocks = len(block_ids)
            if num < 1 or last > len(token_ids) or num_blocks > width or last > num_blocks * bs:
                self._check(state, first, last, num > 0)
            if num == 1:
                step_ids.append(token_ids[first])
            else:
                step_ids += token_ids[first:last]
            placeholders = state.placeholder_indices
            if placeholders:
                if len(placeholders) == 1 and state.token_slot >= 0:  # the usual case
                    gather = placeholders[0] if first <= placeholders[0] < last else None
                else:
                    gather = self._placeholder_in(state, first, last)
                if gather is not None:
                    gather_dst.append(start + gather - first)
                    gather_src.append(state.token_slot)
            if (state.table_num_blocks != num_blocks or state.table_ids is not block_ids
                    or state.table_owner is not tables
                    or block_ids.edit_stamp != state.table_stamp):
                tables.stage(state)
            table_rows.append(state.table_row)
            if last == len(token_ids):  # the step ends at the last known token
                sample_rows.append(end - 1)
                sample_req_ids.append(state.req_id)
                sample_slots.append(state.token_slot)
        input_ids = b["input_ids"]
        input_ids[:num_tokens] = step_ids
        block_tables = tables.gather(b["block_tables"], table_rows, rows, self.buffers.turn)

        positions = b["positions"][:num_tokens]
        arange = self._arange
        if num_tokens == num_reqs:  # one token per request (a decode step): no repeat
            req_idx = arange[:num_reqs]
            positions[:] = n_computed
        else:
            req_idx = np.repeat(arange[:num_reqs], n_sched)
            np.add(n_computed[req_idx], arange[:num_tokens] - qsl[req_idx], out=positions)
        block_ids = block_tables[req_idx, positions // self.block_size].astype(np.int64)
        np.add(block_ids * self.block_size, positions % self.block_size,
               out=b["slot_mapping"][:num_tokens])
        input_ids[num_tokens:padded_tokens] = 0
        b["positions"][num_tokens:padded_tokens] = 0
        b["slot_mapping"][num_tokens:padded_tokens] = -1
        num_sample = len(sample_rows)
        b["logits_indices"][:num_sample] = sample_rows
        b["sample_slots"][:num_sample] = sample_slots
        num_gather = len(gather_dst)
        b["gather_dst"][:num_gather] = gather_dst
        b["gather_src"][:num_gather] = gather_src

        # NOTE: block_tables is the last region: the rows of this step end the copy.
        self.buffers.copy_to_device(self.buffers.offsets["block_tables"][0] + rows * width * 4)
        max_seq_len = int(seq_lens.max()) if num_reqs else 0
        num_cols = width if pad_to is not None else -(-max_seq_len // self.block_size)
        view = self._view
        meta = AttentionMetadata(
            query_start_loc=view("query_start_loc", rows + 1),
            seq_lens=view("seq_lens", rows),
            block_tables=view("block_tables", rows, num_cols),
            slot_mapping=view("slot_mapping", padded_tokens),
            max_query_len=int(n_sched.max()) if num_reqs else 0,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=self._host_view("query_start_loc", rows + 1),
            seq_lens_cpu=self._host_view("seq_lens", rows),
        )
        return StepInputs(
            input_ids=view("input_ids", padded_tokens),
            positions=view("positions", padded_tokens),
            attn_metadata=meta,
            logits_indices=view("logits_indices", num_sample),
            sample_req_ids=sample_req_ids,
            sample_slots=view("sample_slots", num_sample),
            gather_dst=view("gather_dst", num_gather) if num_gather else None,
            gather_src=view("gather_src", num_gather) if num_gather else None,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
        )

    def _view(self, name: str, count: int, num_cols: int | None = None) -> torch.Tensor:
        """The device view of a region's first `count` elements (block_tables: rows,
        and their first num_cols columns), cached."""
        key = (name, count, num_cols)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            tensor = self.dev[name]
            view = tensor[:count] if num_cols is None else tensor[:count, :num_cols]
            self._views[key] = view
        return view

    def _host_view(self, name: str, count: int) -> torch.Tensor:
        """A torch view of the first `count` elements of a region of the host buffer
        being filled (no copy), cached."""
        key = (name, count, -1 - self.buffers.turn)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            view = self._views[key] = self.buffers.host_tensor(name, count)
        return view

    def _check(self, state: RequestState, first: int, last: int, has_tokens: bool) -> None:
        if last > len(state.token_ids) or not has_tokens:
            raise ValueError(
                f"request {state.req_id} is scheduled for tokens {first}..{last} but the "
                f"executor holds {len(state.token_ids)} tokens (num_scheduled must be "
                ">= 1 and cover only known tokens)"
            )
        if len(state.block_ids) > self.max_blocks_per_req:
            raise ValueError(
                f"request {state.req_id} has {len(state.block_ids)} KV blocks, more than "
                f"max_model_len allows ({self.max_blocks_per_req} of {self.block_size} tokens)"
            )
        if -(-last // self.block_size) > len(state.block_ids):
            raise ValueError(
                f"request {state.req_id} needs {-(-last // self.block_size)} KV blocks for "
                f"{last} tokens but has {len(state.block_ids)}; the scheduler must "
                "allocate blocks before scheduling tokens"
            )

    @staticmethod
    def _placeholder_in(state: RequestState, first: int, last: int) -> int | None:
        """Index of the placeholder this step computes, if any (only the latest sampled
        token lives on the device). Raises ValueError for an older one."""
        latest = state.placeholder_indices[-1]
        for index in state.placeholder_indices[:-1]:
            if first <= index < last:
                raise ValueError(
                    f"request {state.req_id} is scheduled to compute token {index}, sampled "
                    f"on the device but superseded by token {latest}; only the latest "
                    "sampled token is kept on the device (resolve earlier steps first)"
                )
        if not first <= latest < last:
            return None
        if state.token_slot < 0:
            raise ValueError(
                f"request {state.req_id} has a device-sampled token but no token slot"
            )
        return latest
