"""Proposers on the target's hidden states: EAGLE / EAGLE-3 heads and Medusa heads
(`{"method": "eagle" | "eagle3" | "medusa", "model": DIR, "num_speculative_tokens": k}`),
in the target's executor like the draft model (draft_runner.py), with the same two
calls per step:

1. `forward(inputs, states, hidden, aux)` right after the target's forward: keeps the
   features of the step's rows (EAGLE: the final-norm hidden states; EAGLE-3:
   `fc(concat)` of the three auxiliary layers' inputs; Medusa: the final-norm hidden
   states). A request whose step is a partial prefill chunk knows the token after each
   of its positions already, so the EAGLE head's KV for them is written at once.
2. `propose(states)` after verification (token_ids verified, block_ids and
   num_computed_tokens rolled back): EAGLE first runs its head over the positions this
   step verified, c .. num_computed - 1, position p reading the token p + 1 (the
   accepted drafts, then the token just sampled) and the target's feature of p
   (vLLM's shifted inputs), which writes the head's KV for them; its last row gives
   draft 1. Then k - 1 chained one-token steps, each reading its previous draft and the
   head's own output feature. Drafts are greedy (top-1 chain), so verification
   (spec_verify.py) is exact.

The head's KV cache (one [2, num_blocks + scratch, block_size, kv_heads, head_dim]
tensor per head layer) is indexed by the target's block ids, as the draft model's:
position p of a request is at the same slot in both, so the scheduler's block tables,
rollback and prefix-cache hits cover it. Chained positions past the request's blocks
go to per-row scratch blocks for that call; a later step's first pass rewrites every
position it verifies before the head reads it. (A prefix-cache hit brings the head's
KV of the block's last position as the writer computed it, from the writer's next
token: only draft quality depends on it, never the output.)

Medusa has no KV: each head reads the target's final-norm state of the last verified
position (the row whose logits gave the bonus token), head i proposing draft i + 1.
"""

from __future__ import annotations

import torch

from flowengine.executor.eagle_heads import (
    Eagle3Head,
    MedusaHeads,
    load_eagle_head,
    load_medusa_heads,
)
from flowengine.executor.input_batch import RequestState, StepInputs
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.model_config import ModelConfig
from flowengine.model.models.llama import LlamaModel


def _first_layer_backend(model: torch.nn.Module):
    return model.model.layers[0].self_attn.attn_backend


class _StepRecord:
    """What forward() keeps about one sampling request until propose()."""

    __slots__ = ("num_computed", "row_start")

    def __init__(self, num_computed: int, row_start: int) -> None:
        self.num_computed = num_computed
        self.row_start = row_start


class EagleRunner:
    """EAGLE-1/2 or EAGLE-3 head with its own paged KV cache (see the module docstring).

    Args:
        method: "eagle" or "eagle3"; path: the head's checkpoint directory.
        num_speculative_tokens: k; target: the target's model (LlamaForCausalLM family)
            and target_config its ModelConfig; num_blocks, block_size: the target's KV
            geometry; max_num_seeds: rows one propose() call may have.

    Raises ValueError for a head that does not fit the target or a wrong layout, and
    for EAGLE-3 on a target whose forward cannot return auxiliary hidden states.
    """

    def __init__(self, method: str, path: str, num_speculative_tokens: int, *,
                 target: torch.nn.Module, target_config: ModelConfig, num_blocks: int,
                 block_size: int, max_num_seqs: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        self.target = target
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = target_config.max_model_len
        self.head, self.config, aux = load_eagle_head(
            method, path, target_config, _first_layer_backend(target), self.device, dtype)
        self.is_eagle3 = isinstance(self.head, Eagle3Head)
        if self.is_eagle3:
            if type(target.model).forward is not LlamaModel.forward:
                raise ValueError(f"EAGLE-3 needs the target's auxiliary hidden states; the "
                                 f"{target_config.architecture} forward does not return them")
            target.model.aux_hidden_state_layers = aux
        self.aux_hidden_state_layers = aux
        self.scratch_per_row = (self.k - 1) // block_size + 1
        shape = (2, num_blocks + max_num_seqs * self.scratch_per_row, block_size,
                 self.config.num_kv_heads, self.config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(self.config.num_layers)]
        self._features: torch.Tensor | None = None
        self._records: dict[str, _StepRecord] = {}

    @staticmethod
    def kv_cache_bytes_per_block(path: str, target_config: ModelConfig, block_size: int,
                                 dtype: torch.dtype) -> int:
        """Bytes of one block over the head's layers (num_blocks is sized with it)."""
        from flowengine.executor.eagle_heads import head_model_config, read_head_config

        c = head_model_config(read_head_config(path), path, target_config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self.head, "embed_tokens", None)
        return own(token_ids) if own is not None else self.target.model.embed_tokens(token_ids)

    def _draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.is_eagle3:
            return self.head.draft_token_ids(hidden)
        return self.target.compute_logits(hidden).argmax(dim=-1)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, states: list[RequestState], hidden: torch.Tensor,
                aux: list[torch.Tensor] | None = None) -> None:
        """Keep the step's features; write the head's KV of partial prefill chunks."""
        self._features = self.head.combine(hidden, aux)
        self._records = {}
        qsl = inputs.attn_metadata.query_start_loc_cpu
        chunks = []
        for i, state in enumerate(states):
            start, end = int(qsl[i]), int(qsl[i + 1])
            first = state.num_computed_tokens
            if first + end - start == len(state.token_ids):
                self._records[state.req_id] = _StepRecord(first, start)
            else:  # a partial prefill chunk: every next token is a prompt token
                chunks.append((state, first, start, end - start))
        if chunks:
            self._run_first_pass(chunks, with_scratch=False)

    @torch.inference_mode()
    def propose(self, states: list[RequestState]) -> list[list[int]]:
        """k greedy drafts after each state's last (just verified) token; fewer near
        max_model_len. One list per state, in order."""
        drafts: list[list[int]] = [[] for _ in states]
        rows = [(i, s) for i, s in enumerate(states) if s.req_id in self._records]
        for begin in range(0, len(rows), self.max_num_seqs):
            chunk = rows[begin:begin + self.max_num_seqs]
            for (i, _), out in zip(chunk, self._propose_rows([s for _, s in chunk]),
                                   strict=True):
                drafts[i] = out
        self._records = {}
        self._features = None
        return drafts

    def _propose_rows(self, states: list[RequestState]) -> list[list[int]]:
        passes = []
        for s in states:
            rec = self._records[s.req_id]
            passes.append((s, rec.num_computed, rec.row_start,
                           s.num_computed_tokens - rec.num_computed))
        logits_hidden, feature, tables = self._run_first_pass(passes, with_scratch=True)
        tokens = self._draft_ids(logits_hidden)
        out = [[int(t)] for t in tokens.tolist()]
        bs = self.block_size
        tables_host = tables.cpu()
        num_rows = len(states)
        for step in range(1, self.k):
            positions = [s.num_computed_tokens - 1 + step for s in states]
            live = [p < self.max_model_len for p in positions]
            if not any(live):
                break
            pos = [min(p, self.max_model_len - 1) for p in positions]
            slots = [int(tables_host[r, p // bs]) * bs + p % bs if live[r] else -1
                     for r, p in enumerate(pos)]
            seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
            qsl = torch.arange(num_rows + 1, dtype=torch.int32)
            meta = AttentionMetadata(
                query_start_loc=qsl.to(self.device), seq_lens=seq_lens.to(self.device),
                block_tables=tables,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                max_query_len=1, max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
            logits_hidden, feature = self.head(
                self._embed(tokens), feature,
                torch.tensor(pos, dtype=torch.int64, device=self.device), self.kv_caches, meta)
            tokens = self._draft_ids(logits_hidden)
            for r, t in enumerate(tokens.tolist()):
                if live[r] and len(out[r]) == step:
                    out[r].append(int(t))
        return out

    def _run_first_pass(self, passes: list[tuple[RequestState, int, int, int]],
                        with_scratch: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over (state, first position c, first feature row, count m): position
        c + j reads token c + j + 1 and feature row + j. Returns the last row's (hidden
        for the logits, next feature) per pass, [len(passes), h] each, and the block
        tables used ([len(passes), width] int32 on the device, scratch blocks appended
        when with_scratch)."""
        assert self._features is not None
        bs = self.block_size
        scratch = self.scratch_per_row if with_scratch else 0
        width = max(len(s.block_ids) for s, *_ in passes) + scratch
        tables = torch.zeros(len(passes), width, dtype=torch.int32)
        token_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens = []
        for r, (s, c, row, m) in enumerate(passes):
            table = s.block_ids + [self.num_blocks + r * scratch + j for j in range(scratch)]
            tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
            token_ids.extend(s.token_ids[c + 1:c + m + 1])
            positions.extend(range(c, c + m))
            rows.extend(range(row, row + m))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + m))
            qsl.append(qsl[-1] + m)
            seq_lens.append(c + m)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        tables_dev = tables.to(self.device)
        meta = AttentionMetadata(
            query_start_loc=qsl_t.to(self.device), seq_lens=seq_t.to(self.device),
            block_tables=tables_dev,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            max_query_len=max(m for *_, m in passes), max_seq_len=int(seq_t.max()),
            query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t)
        dev = self.device
        features = self._features.index_select(
            0, torch.tensor(rows, dtype=torch.int64, device=dev))
        logits_hidden, feature = self.head(
            self._embed(torch.tensor(token_ids, dtype=torch.int64, device=dev)), features,
            torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_caches, meta)
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=dev)
        return logits_hidden.index_select(0, last), feature.index_select(0, last), tables_dev


class MedusaRunner:
    """Medusa heads on the target's final-norm hidden states (no KV cache).

    Args: path, num_speculative_tokens (<= the checkpoint's heads), target (the
    target's model), target_config, device, dtype. Raises ValueError as
    `load_medusa_heads`.
    """

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, path: str, num_speculative_tokens: int, *, target: torch.nn.Module,
                 target_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.k = num_speculative_tokens
        self.target = target
        self.device = torch.device(device)
        self.heads: MedusaHeads = load_medusa_heads(path, target_config, self.k, self.device,
                                                    dtype)
        self._hidden: torch.Tensor | None = None
        self._records: dict[str, _StepRecord] = {}

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, states: list[RequestState], hidden: torch.Tensor,
                aux: list[torch.Tensor] | None = None) -> None:
        """Keep the step's final-norm hidden states and each sampling request's rows."""
        qsl = inputs.attn_metadata.query_start_loc_cpu
        self._hidden = hidden
        self._records = {
            s.req_id: _StepRecord(s.num_computed_tokens, int(qsl[i]))
            for i, s in enumerate(states)
            if s.num_computed_tokens + int(qsl[i + 1]) - int(qsl[i]) == len(s.token_ids)}

    @torch.inference_mode()
    def propose(self, states: list[RequestState]) -> list[list[int]]:
        """k drafts per state from the state of its last verified position. Rows past
        max_model_len are cut by the scheduler's caps."""
        drafts: list[list[int]] = [[] for _ in states]
        rows, index = [], []
        for i, s in enumerate(states):
            rec = self._records.get(s.req_id)
            if rec is not None:
                rows.append(i)
                index.append(rec.row_start + s.num_computed_tokens - rec.num_computed - 1)
        if rows:
            assert self._hidden is not None
            hidden = self._hidden.index_select(
                0, torch.tensor(index, dtype=torch.int64, device=self.device))
            ids = self.heads.draft_token_ids(hidden, self.k, self.target.compute_logits)
            for i, row in zip(rows, ids.tolist(), strict=True):
                drafts[i] = [int(t) for t in row]
        self._records = {}
        self._hidden = None
        return drafts


def head_kv_cache_bytes_per_block(method: str, path: str, target_config: ModelConfig,
                                  block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block adds for the head of `method` (Medusa: 0)."""
    if method == "medusa":
        return 0
    return EagleRunner.kv_cache_bytes_per_block(path, target_config, block_size, dtype)


def attach_head_runner(runner, method: str, path: str, num_speculative_tokens: int, *,
                       num_blocks: int, block_size: int, max_num_seqs: int) -> None:
    """Give the target's ModelRunner its EAGLE / EAGLE-3 / Medusa proposer
    (`runner.draft_runner`). EAGLE-3's target returns auxiliary hidden states from now
    on, so captured CUDA graphs are captured again to return them too."""
    if method == "medusa":
        runner.draft_runner = MedusaRunner(path, num_speculative_tokens, target=runner.model,
                                           target_config=runner.model_config,
                                           device=runner.device, dtype=runner.dtype)
        return
    runner.draft_runner = EagleRunner(
        method, path, num_speculative_tokens, target=runner.model,
        target_config=runner.model_config, num_blocks=num_blocks, block_size=block_size,
        max_num_seqs=max_num_seqs, device=runner.device, dtype=runner.dtype)
    if runner.draft_runner.aux_hidden_state_layers and getattr(runner, "graphs", None):
        runner.capture_cuda_graphs()
