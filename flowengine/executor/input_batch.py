"""Per-request executor state and the flattened inputs of one step.

`InputBatch` owns persistent host buffers (pinned when the device is CUDA) that hold
every integer input of a step in one byte buffer: the token ids, positions, slot
mapping, logits indices, query start locations, sequence lengths and block tables.
They are filled with vectorized numpy (the host loop is over requests, never tokens)
and reach the device with a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the executor keeps about one request between steps.

    token_ids: prompt followed by every sampled token (the executor appends them);
    num_computed_tokens: tokens whose K/V are in the cache before the coming step;
    block_ids: the request's block table (KV block ids in order).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class StepInputs:
    """Device tensors of one step.

    input_ids, positions: [T] int64. logits_indices: [R_s] int64 rows of the hidden
    states whose next-token distribution is needed, for the requests `sample_req_ids`
    (in batch order).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_req_ids: list[str]


# (name, numpy dtype, torch dtype) of each region of the staging buffer.
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
    """

    def __init__(self, block_size: int, max_blocks_per_req: int, device: torch.device,
                 max_num_tokens: int = 2048, max_num_reqs: int = 256) -> None:
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self._allocate(max_num_tokens, max_num_reqs)

    def _allocate(self, max_num_tokens: int, max_num_reqs: int) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        regions = {
            "input_ids": (_I64, max_num_tokens),
            "positions": (_I64, max_num_tokens),
            "slot_mapping": (_I64, max_num_tokens),
            "logits_indices": (_I64, max_num_reqs),
            "query_start_loc": (_I32, max_num_reqs + 1),
            "seq_lens": (_I32, max_num_reqs),
            "block_tables": (_I32, max_num_reqs * self.max_blocks_per_req),
        }
        offsets: dict[str, tuple[int, int]] = {}
        total = 0
        for name, ((np_dtype, _), count) in regions.items():
            nbytes = count * np.dtype(np_dtype).itemsize
            offsets[name] = (total, nbytes)
            total += -(-nbytes // 8) * 8  # keep every region 8-byte aligned
        pin = self.device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        host_np = self._host.numpy()
        # On CPU the host buffer is the device buffer: no copy at all.
        self._dev = self._host if self.device.type == "cpu" else torch.empty(
            total, dtype=torch.uint8, device=self.device
        )
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, ((np_dtype, torch_dtype), _) in regions.items():
            start, nbytes = offsets[name]
            self.np[name] = host_np[start:start + nbytes].view(np_dtype)
            self.dev[name] = self._dev[start:start + nbytes].view(torch_dtype)
        self.np["block_tables"] = self.np["block_tables"].reshape(max_num_reqs, -1)
        self.dev["block_tables"] = self.dev["block_tables"].view(max_num_reqs, -1)

    def prepare(self, states: list[RequestState], num_scheduled: list[int]) -> StepInputs:
        """Flatten one step: request i computes tokens
        token_ids[num_computed_tokens : num_computed_tokens + num_scheduled[i]].

        Raises ValueError when a request lacks the tokens or KV blocks it is scheduled for.
        """
        num_reqs = len(states)
        num_tokens = sum(num_scheduled)
        if num_tokens > self.max_num_tokens or num_reqs > self.max_num_reqs:
            self._allocate(max(num_tokens, self.max_num_tokens), max(num_reqs, self.max_num_reqs))
        b = self.np
        n_sched = np.asarray(num_scheduled, dtype=np.int64)
        n_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        qsl = b["query_start_loc"][:num_reqs + 1]
        qsl[0] = 0
        np.cumsum(n_sched, out=qsl[1:])
        seq_lens = n_computed + n_sched
        b["seq_lens"][:num_reqs] = seq_lens

        block_tables = b["block_tables"][:num_reqs]
        block_tables.fill(0)
        input_ids = b["input_ids"]
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        for i, state in enumerate(states):
            start, end = int(qsl[i]), int(qsl[i + 1])
            first = state.num_computed_tokens
            last = first + end - start
            if last > len(state.token_ids) or end <= start:
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
            input_ids[start:end] = state.token_ids[first:last]
            block_tables[i, :len(state.block_ids)] = state.block_ids
            if last == len(state.token_ids):  # the step ends at the last known token
                sample_rows.append(end - 1)
                sample_req_ids.append(state.req_id)

        req_idx = np.repeat(np.arange(num_reqs), n_sched)
        positions = b["positions"][:num_tokens]
        np.add(n_computed[req_idx], np.arange(num_tokens) - qsl[req_idx], out=positions)
        block_ids = block_tables[req_idx, positions // self.block_size].astype(np.int64)
        np.add(block_ids * self.block_size, positions % self.block_size,
               out=b["slot_mapping"][:num_tokens])
        b["logits_indices"][:len(sample_rows)] = sample_rows

        if self._dev is not self._host:
            # NOTE: the next prepare() rewrites the pinned buffer; whoever runs steps
            # back to back without a sync in between must wait for this copy first.
            self._dev.copy_(self._host, non_blocking=True)
        d = self.dev
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if num_reqs else 0
        meta = AttentionMetadata(
            query_start_loc=d["query_start_loc"][:num_reqs + 1],
            seq_lens=d["seq_lens"][:num_reqs],
            block_tables=d["block_tables"][:num_reqs, :max_blocks],
            slot_mapping=d["slot_mapping"][:num_tokens],
            max_query_len=int(n_sched.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens_cpu=self._host_tensor("seq_lens", num_reqs),
        )
        return StepInputs(
            input_ids=d["input_ids"][:num_tokens],
            positions=d["positions"][:num_tokens],
            attn_metadata=meta,
            logits_indices=d["logits_indices"][:len(sample_rows)],
            sample_req_ids=sample_req_ids,
        )

    def _host_tensor(self, name: str, count: int) -> torch.Tensor:
        return torch.from_numpy(self.np[name][:count])
