"""The draft model of speculative decoding: a smaller model with the target's
tokenizer, its own paged KV cache, in the target's executor (`{"model": DIR,
"num_speculative_tokens": k}`).

KV cache: one tensor per draft layer, [2, num_blocks + num_scratch_blocks, block_size,
draft_kv_heads, draft_head_dim], indexed by the *target's* block ids: position p of a
request lives at the same slot in both caches, so the scheduler's block tables cover
the draft too and prefix-cache hits hold the draft's KV as well (a full cached block's
tokens are fixed by its hash, so any request that wrote it wrote the same values).

Per step (`Executor` with a draft runner always takes the host path):

1. `forward(inputs)`: the draft runs the target's step inputs as they are (tokens,
   positions, slots, block tables), so its KV stays in lockstep with the target's:
   every position the target has computed, the draft has too, rejected drafts
   included (they are rewritten before a block is full of verified tokens);
2. `propose(states)`: after verification, for each request that sampled, k greedy
   draft steps: the last (bonus) token at position L - 1, then each draft token. These
   positions may lie past the request's blocks; they go to per-row scratch blocks
   appended to its block table for this call only (they hold only draft-of-draft KV,
   which the next step's lockstep forward recomputes where it matters).

Drafts are greedy (argmax), a point-mass proposal, so the executor's verification
(spec_verify.py) is exact rejection sampling for every request.
"""

from __future__ import annotations

import torch

from flowengine.executor.input_batch import RequestState, StepInputs
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.loader import load_model
from flowengine.model.model_config import ModelConfig


class DraftRunner:
    """Args:
        model_config: the draft model (its max_model_len set to the target's).
        num_speculative_tokens: k, drafts proposed per request and step.
        target_vocab_size: the target's vocabulary; the draft must have the same.
        num_blocks, block_size: the target's KV geometry.
        max_num_seqs: rows one propose() call may have (scratch blocks per row).
        device, dtype, load_format, seed: as the target's ModelRunner.

    Raises ValueError when the vocabularies differ.
    """

    def __init__(self, model_config: ModelConfig, num_speculative_tokens: int, *,
                 target_vocab_size: int, num_blocks: int, block_size: int,
                 max_num_seqs: int, device: torch.device, dtype: torch.dtype,
                 load_format: str = "auto", seed: int = 0) -> None:
        if model_config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model {model_config.model_path} has a vocabulary of "
                f"{model_config.vocab_size} tokens, the target {target_vocab_size}; a draft "
                "model must share the target's tokenizer")
        self.model_config = model_config
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.model = load_model(model_config, load_format, dtype, self.device, seed=seed)
        # Scratch blocks per row: positions L - 1 .. L + k - 2 past the row's blocks.
        self.scratch_per_row = (self.k - 1) // block_size + 1
        self.max_num_seqs = max_num_seqs
        shape = (2, num_blocks + max_num_seqs * self.scratch_per_row, block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(model_config.num_layers)]

    @staticmethod
    def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int,
                                 dtype: torch.dtype) -> int:
        """Bytes of one block over the draft's layers (to size num_blocks with it)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (2 * model_config.num_layers * block_size * model_config.num_kv_heads
                * model_config.head_dim * itemsize)

    # The draft model reads no hidden states of the target.
    aux_hidden_state_layers: tuple[int, ...] = ()

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, states: list[RequestState] | None = None,
                hidden: torch.Tensor | None = None,
                aux: list[torch.Tensor] | None = None) -> None:
        """Write the draft's KV for the target's step (lockstep, step 1 above); the
        target's states and hidden states (the proposer interface) are not needed."""
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    @torch.inference_mode()
    def propose(self, states: list[RequestState]) -> list[list[int]]:
        """k greedy draft tokens after each state's last token (token_ids verified,
        block_ids rolled back). Rows past max_model_len get fewer (none at the limit).
        Returns one list per state, in order."""
        if not states:
            return []
        max_len = self.model_config.max_model_len
        bs = self.block_size
        drafts: list[list[int]] = [[] for _ in states]
        for start in range(0, len(states), self.max_num_seqs):
            chunk = states[start:start + self.max_num_seqs]
            for i, row in enumerate(self._propose_rows(chunk, bs, max_len)):
                drafts[start + i] = row
        return drafts

    def _propose_rows(self, states: list[RequestState], bs: int, max_len: int
                      ) -> list[list[int]]:
        num_rows = len(states)
        lengths = [len(s.token_ids) for s in states]
        width = max(len(s.block_ids) for s in states) + self.scratch_per_row
        tables = torch.zeros(num_rows, width, dtype=torch.int32)
        for r, s in enumerate(states):
            scratch = [self.num_blocks + r * self.scratch_per_row + j
                       for j in range(self.scratch_per_row)]
            row = s.block_ids + scratch
            tables[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
        tokens = [s.token_ids[-1] for s in states]
        out: list[list[int]] = [[] for _ in states]
        tables_dev = tables.to(self.device)
        for step in range(self.k):
            positions = [n - 1 + step for n in lengths]
            live = [p < max_len - 1 for p in positions]  # a draft needs a position < max_len
            if not any(live):
                break
            pos = [min(p, max_len - 1) for p in positions]
            slots = []
            for r, p in enumerate(pos):
                block = int(tables[r, p // bs])
                slots.append(block * bs + p % bs)
            seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
            qsl = torch.arange(num_rows + 1, dtype=torch.int32)
            meta = AttentionMetadata(
                query_start_loc=qsl.to(self.device),
                seq_lens=seq_lens.to(self.device),
                block_tables=tables_dev,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                max_query_len=1,
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl,
                seq_lens_cpu=seq_lens,
            )
            hidden = self.model(torch.tensor(tokens, dtype=torch.int64, device=self.device),
                                torch.tensor(pos, dtype=torch.int64, device=self.device),
                                self.kv_caches, meta)
            next_ids = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for r in range(num_rows):
                if live[r] and len(out[r]) == step:
                    out[r].append(int(next_ids[r]))
            tokens = next_ids
        return out
